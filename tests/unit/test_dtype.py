"""LLMQ_DTYPE=auto: one function picks the dtype from the hardware (faked here) and backend."""
import pytest

from worker.model_manager import read_cpu_flags, resolve_dtype

AVX2 = frozenset({"avx", "avx2", "fma"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}
AMX = AVX2 | {"avx512f", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize("flags, want", [(AVX2, "float32"), (AVX512_BF16, "bfloat16"),
                                         (AMX, "bfloat16"), (frozenset(), "float32")])
def test_auto_on_cpu_is_bfloat16_only_where_the_cpu_computes_it(flags, want):
    assert resolve_dtype("auto", "cpu", cpu_flags=flags) == want


@pytest.mark.parametrize("bf16, want", [(True, "bfloat16"), (False, "float16")])
def test_auto_on_cuda_follows_the_gpu(bf16, want):
    assert resolve_dtype("auto", "cuda:0", cpu_flags=AVX2, cuda_bf16=bf16) == want


@pytest.mark.parametrize("explicit", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_wins(explicit):
    for flags in (AVX2, AMX):
        assert resolve_dtype(explicit, "cpu", cpu_flags=flags) == explicit
        assert resolve_dtype(explicit, "cpu", "vllm", cpu_flags=flags) == explicit


def test_vllm_on_cpu_gets_float32_under_auto_even_with_native_bf16():
    # vLLM's CPU path answered gibberish in bfloat16 (docs/settings.md)
    assert resolve_dtype("auto", "cpu", "vllm", cpu_flags=AMX) == "float32"
    assert resolve_dtype("auto", "cuda", "vllm", cuda_bf16=True) == "bfloat16"


def test_cpu_flags_come_from_proc_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some Xeon\n"
                    "flags\t\t: fpu avx2 avx512_bf16 amx_tile\n\nprocessor\t: 1\n")
    assert read_cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16", "amx_tile"}
    assert read_cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_vllm_keeps_its_kv_cache_in_the_model_dtype_or_refuses_at_start():
    """LLMQ_KV_CACHE_DTYPE as vLLM's kv_cache_dtype: vLLM's `auto` (the model's dtype) for auto,
    model or the served dtype named; another is refused (vLLM's CPU build took float16 under
    float32 silently and answered gibberish; on CUDA its other float choices are for fp8 models)."""
    from worker.model.vllm.backend import _kv_cache_dtype

    for name in ("auto", "model", "float32"):
        assert _kv_cache_dtype(name, "float32") == "auto"
    assert _kv_cache_dtype("bfloat16", "bfloat16") == "auto"
    for name, dtype in (("float16", "float32"), ("float32", "bfloat16"), ("float16", "auto")):
        with pytest.raises(ValueError, match="model's dtype"):
            _kv_cache_dtype(name, dtype)
