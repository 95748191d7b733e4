"""The CPU decode-attention kernel (worker/model/transformers/decode_attention.cpp) against torch's attention.

Random pools, shuffled block tables and ragged lengths: each row's output must be its own
attention over its first `length` slots, in fp32 and bf16, with and without grouped query
heads; paged attention with the kernel must equal its torch path on a pass mixing decode and
prefill rows. bfloat16's cases run on both of its paths (AVX2's, and AVX512-BF16's where the
CPU has it). Skipped where the kernel cannot be built (no compiler: the torch path serves).
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from worker.model.transformers import cpu_kernels
from worker.model.transformers.kv_cache import PagedKVCache
from worker.model.transformers.paged_attention import paged_attention_forward

kernel = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="the decode kernel does not build here")


def reference(q, kpool, vpool, tables, lengths, block_size, scale):
    """Each row's attention over its slots, in fp32, the kv heads repeated for GQA."""
    rows, heads, dim = q.shape
    kv_heads = kpool.shape[1]
    out = torch.empty(rows, heads, dim)
    for i in range(rows):
        n = int(lengths[i])
        blocks = tables[i, :-(-n // block_size)]
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        k = kpool[slots].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        v = vpool[slots].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        out[i] = F.scaled_dot_product_attention(q[i, :, None].float(), k, v,
                                                scale=scale)[:, 0]
    return out


def random_case(rows, heads, kv_heads, dim, block_size, dtype, seed, longest=70, kv_dtype=None):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    lengths = [rng.choice([1, block_size, block_size + 1, rng.randint(1, longest)])
               for _ in range(rows)]
    width = max(-(-n // block_size) for n in lengths)
    ids = list(range(rows * width + 3))
    rng.shuffle(ids)                                  # blocks scattered over the pool
    tables = torch.tensor(ids[:rows * width]).view(rows, width)
    slots = len(ids) * block_size
    kpool = (torch.randn(slots, kv_heads, dim) * 2).to(kv_dtype or dtype)   # * 2: peaked too
    vpool = torch.randn(slots, kv_heads, dim).to(kv_dtype or dtype)
    q = torch.randn(rows, heads, dim).to(dtype)
    return q, kpool, vpool, tables, torch.tensor(lengths)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
@pytest.mark.parametrize("block_size", [8, 4, 16])
def test_each_row_attends_its_own_blocks(dtype, tol, heads, kv_heads, dim, block_size, path):
    q, kpool, vpool, tables, lengths = random_case(13, heads, kv_heads, dim, block_size, dtype,
                                                   seed=dim)
    scale = dim ** -0.5
    out = torch.full_like(q, float("nan"))
    kernel.decode_attention(q, kpool, vpool, tables, lengths, block_size, scale, out)
    want = reference(q, kpool, vpool, tables, lengths, block_size, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_float32_queries_over_a_half_width_cache(kv_dtype):
    """A float32 model over a float16 (or bfloat16) cache: the kernel widens each key and value
    as it reads it, so the output is float32 attention over the stored values, to float32's
    precision (the reference reads the same stored values)."""
    q, kpool, vpool, tables, lengths = random_case(11, 9, 3, 64, 8, torch.float32, seed=7,
                                                   kv_dtype=kv_dtype)
    out = torch.full_like(q, float("nan"))
    kernel.decode_attention(q, kpool, vpool, tables, lengths, 8, 0.125, out)
    assert out.dtype == torch.float32 and kpool.dtype == kv_dtype
    torch.testing.assert_close(out, reference(q, kpool, vpool, tables, lengths, 8, 0.125),
                               rtol=1e-5, atol=1e-5)


def test_a_cache_of_another_dtype_than_its_queries_is_refused_unless_supported():
    q, kpool, vpool, tables, lengths = random_case(2, 4, 2, 16, 8, torch.bfloat16, seed=1,
                                                   kv_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="unsupported dtypes"):
        kernel.decode_attention(q, kpool, vpool, tables, lengths, 8, 0.25, torch.empty_like(q))


def test_strided_query_and_output_rows():
    """The model's queries come as a view ([heads, tokens, dim] transposed) and the output is
    the first rows of a larger tensor: both are read and written through their strides."""
    q, kpool, vpool, tables, lengths = random_case(5, 6, 2, 16, 4, torch.float32, seed=3)
    q_view = q.transpose(0, 1).contiguous().transpose(0, 1)     # strides of a transpose
    out = torch.zeros(8, 6, 16)
    kernel.decode_attention(q_view, kpool, vpool, tables, lengths, 4, 0.25, out[:5])
    torch.testing.assert_close(out[:5], reference(q, kpool, vpool, tables, lengths, 4, 0.25),
                               rtol=1e-5, atol=1e-5)
    assert out[5:].abs().sum() == 0                   # nothing written past the rows


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 16), (torch.bfloat16, 64)])
def test_slots_past_a_rows_length_are_never_read(dtype, dim, path):
    """A row's last block holds stale slots (the pool is torch.empty): NaN there changes
    nothing."""
    q, kpool, vpool, tables, lengths = random_case(6, 4, 2, dim, 8, dtype, seed=5)
    want = torch.empty_like(q)
    kernel.decode_attention(q, kpool, vpool, tables, lengths, 8, 0.25, want)
    for i, n in enumerate(lengths.tolist()):
        block = tables[i, (n - 1) // 8]
        for slot in range(block * 8 + (n - 1) % 8 + 1, block * 8 + 8):
            kpool[slot], vpool[slot] = float("nan"), float("nan")
    assert (lengths % 8 != 0).any()
    out = torch.empty_like(q)
    kernel.decode_attention(q, kpool, vpool, tables, lengths, 8, 0.25, out)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("longest", [70, 300])
def test_the_wide_path_agrees_with_the_avx2_path(longest):
    """AVX512-BF16's scores sum the bfloat16 products 32 at a time in another order: the two
    paths' outputs differ by a bfloat16 rounding at most, over short and long rows (in float32
they differ in the last bits; rounded to bfloat16, mostly not at all)."""
    if not kernel.wide_ops():
        pytest.skip("this CPU has no AVX512-BF16")
    q, kpool, vpool, tables, lengths = random_case(16, 9, 3, 64, 16, torch.bfloat16, seed=11,
                                                   longest=longest)
    wide, narrow = torch.empty_like(q), torch.empty_like(q)
    kernel.decode_attention(q, kpool, vpool, tables, lengths, 16, 0.125, wide)
    kernel.wide_ops(False)
    try:
        kernel.decode_attention(q, kpool, vpool, tables, lengths, 16, 0.125, narrow)
    finally:
        kernel.wide_ops(True)
    torch.testing.assert_close(wide.float(), narrow.float(), rtol=2 ** -7, atol=2 ** -8)


class FakeAttention(torch.nn.Module):
    def __init__(self, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx


@pytest.mark.parametrize("dtype,kv_dtype,tol", [(torch.float32, None, 1e-5),
                                                 (torch.bfloat16, None, 2e-2),
                                                 (torch.float32, torch.float16, 1e-5)])
def test_paged_attention_with_the_kernel_equals_its_torch_path(dtype, kv_dtype, tol, path):
    """A pass of decode rows (ragged, their blocks interleaved) and a prefill chunk: the
    kernel changes only how the decode rows are computed, not what; a float16 cache under
    float32 queries too (the torch path widens what it gathers)."""
    torch.manual_seed(1)
    heads, kv_heads, dim = 9, 3, 64
    cache = PagedKVCache(num_blocks=300, block_size=8, max_group_slots=64, dtype=kv_dtype)
    past = {"a": 3, "b": 50, "c": 20, "d": 21, "e": 8, "chunk": 9}
    for sid in past:
        cache.add(sid)
    for n in range(max(past.values())):               # grown together: blocks interleave
        step = [(s, 1) for s, m in past.items() if n < m]
        plan = cache.plan(step)
        k, v = (torch.randn(1, kv_heads, len(step), dim, dtype=dtype) for _ in "kv")
        paged_attention_forward(FakeAttention(), torch.randn(1, heads, len(step), dim,
                                                             dtype=dtype), k, v, None,
                                kv_plan=plan)
        cache.commit(plan)
    new = [("a", 1), ("b", 1), ("chunk", 5), ("c", 1), ("d", 1), ("e", 1)]
    plan = cache.plan(new)
    total = sum(n for _s, n in new)
    q = torch.randn(1, heads, total, dim, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, total, dim, dtype=dtype) for _ in "kv")
    want, _ = paged_attention_forward(FakeAttention(), q, k, v, None, kv_plan=plan)
    assert len(plan.decode_groups) > 1                 # the torch path ran several groups
    assert cache.layer(0, k)[0].dtype == (kv_dtype or dtype) and want.dtype == dtype
    cache.decode_kernel = kernel.decode_attention
    got, _ = paged_attention_forward(FakeAttention(), q, k, v, None, kv_plan=plan)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_the_model_worker_uses_the_kernel_on_a_cpu_unless_turned_off(tiny_model):
    from worker.model.transformers.backend import TransformersBackend

    model, info = tiny_model
    on = TransformersBackend(model, info, max_num_seqs=4, kv_cache_bytes=1 << 20)
    off = TransformersBackend(model, info, max_num_seqs=4, kv_cache_bytes=1 << 20, decode_kernel=False)
    assert on.cache.decode_kernel is kernel.decode_attention and off.cache.decode_kernel is None


def test_the_cache_is_float16_under_a_float32_model_only_where_the_kernel_reads_it(tiny_model):
    """LLMQ_KV_CACHE_DTYPE=auto: float16 under the float32 model on a CPU with the kernel (half
    the bytes to read), the model's dtype without the kernel (every read would be a widening
    copy) or when asked for; the budget counts the cache's own bytes, so it holds twice the
    tokens."""
    from worker.model.transformers.backend import TransformersBackend, resolve_kv_dtype

    model, info = tiny_model
    assert model.dtype == torch.float32
    auto = TransformersBackend(model, info, max_num_seqs=4, kv_cache_bytes=1 << 20)
    own = TransformersBackend(model, info, max_num_seqs=4, kv_cache_bytes=1 << 20,
                      kv_cache_dtype="model")
    no_kernel = TransformersBackend(model, info, max_num_seqs=4, kv_cache_bytes=1 << 20,
                            decode_kernel=False)
    assert (auto.kv_dtype, own.kv_dtype, no_kernel.kv_dtype) == (
        torch.float16, torch.float32, torch.float32)
    # ... and says so to the engine, whose heartbeat carries it (/readyz, the bench)
    assert (auto.info.kv_cache_dtype, own.info.kv_cache_dtype, no_kernel.info.kv_cache_dtype) \
        == ("float16", "float32", "float32")
    assert "decode attention: C++ kernel" in auto.info.kernels
    assert "decode attention: gather + SDPA" in no_kernel.info.kernels
    assert auto.cache.num_blocks == 2 * own.cache.num_blocks
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("auto", torch.bfloat16, cpu, True) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32, gpu, False) == torch.float32
    assert resolve_kv_dtype("bfloat16", torch.float32, cpu, False) == torch.bfloat16
    with pytest.raises(ValueError, match="fp8"):
        resolve_kv_dtype("fp8", torch.float32, cpu, True)
