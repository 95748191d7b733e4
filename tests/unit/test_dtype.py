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


def test_the_kv_cache_dtype_reaches_vllm_where_it_stores_it():
    """LLMQ_KV_CACHE_DTYPE as vLLM's kv_cache_dtype: the model's own for auto / model / its own
    name, float16 or bfloat16 through to CUDA, refused where vLLM would not keep it (its CPU
    build under another model dtype; float32 under a narrower model)."""
    from worker.backends.vllm_backend import _kv_cache_dtype

    for name in ("auto", "model", "float32"):
        assert _kv_cache_dtype(name, "float32", "cpu") == "auto"
    assert _kv_cache_dtype("bfloat16", "bfloat16", "cpu") == "auto"
    assert _kv_cache_dtype("float16", "bfloat16", "cuda") == "float16"
    assert _kv_cache_dtype("float16", "auto", "cuda") == "float16"
    with pytest.raises(ValueError, match="CPU build"):
        _kv_cache_dtype("float16", "float32", "cpu")
    with pytest.raises(ValueError, match="narrower"):
        _kv_cache_dtype("float32", "bfloat16", "cuda")
