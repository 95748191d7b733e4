"""TransformersBackend.load: settings that shape what the engine is told about the model."""
from common.settings import Settings
from worker.model.transformers.backend import TransformersBackend


def test_max_model_len_caps_the_context_the_engine_sees(tiny_model_dir):
    own = TransformersBackend.load(Settings(model=tiny_model_dir, device="cpu", dtype="float32"))
    assert own.info.max_model_len == 512                 # the tiny config's positions
    capped = TransformersBackend.load(Settings(model=tiny_model_dir, device="cpu", dtype="float32",
                                       max_model_len=100))
    assert capped.info.max_model_len == 100
    wider = TransformersBackend.load(Settings(model=tiny_model_dir, device="cpu", dtype="float32",
                                      max_model_len=10_000))
    assert wider.info.max_model_len == 512                # never beyond what the model has


def test_layer_kernels_setting_picks_the_fused_ops_or_torchs(tiny_model_dir, monkeypatch):
    """LLMQ_LAYER_KERNELS=0 keeps torch's ops (transformers' logits to the bit); the default
    runs the fused C++ ops where the CPU kernels build."""
    from worker.model.transformers import cpu_kernels

    monkeypatch.setenv("LLMQ_LAYER_KERNELS", "0")
    off = TransformersBackend.load(Settings.from_env(model=tiny_model_dir, device="cpu",
                                             dtype="float32"))
    assert off.llama is not None and off.llama.kernels is None
    monkeypatch.delenv("LLMQ_LAYER_KERNELS")
    on = TransformersBackend.load(Settings.from_env(model=tiny_model_dir, device="cpu", dtype="float32"))
    assert (on.llama.kernels is not None) == (cpu_kernels.load() is not None)


def test_every_backend_ends_on_every_eos_id_the_model_names():
    """vLLM's backend took the tokenizer's EOS alone and llama.cpp's its vocabulary's: a model
    whose generation_config lists more (Llama 3 and Qwen instruct models) ran past them there,
    and stopped on them in the transformers backend. All three now take this union."""
    from worker.model_manager import eos_token_ids

    assert eos_token_ids([2, 0], 2, None) == (0, 2)
    assert eos_token_ids(None, (7,), 3, -1) == (3, 7)   # llama.cpp answers -1 for none
    assert eos_token_ids(None, None) == ()
