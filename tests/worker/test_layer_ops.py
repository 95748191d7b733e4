"""The fused layer ops (worker/model/transformers/layer_ops.cpp) against the torch ops they replace
(worker/model/transformers/llama_forward.py's): equal to the bit where they round alike (the residual add, the
rotary embedding, bfloat16), within float32's last bits where the order of a sum or the exp
differs; each row the same whatever rows are around it. bfloat16's are checked on both of its
paths: AVX2's and, where the CPU has AVX512-BF16, the 16-lane one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model.transformers import cpu_kernels
from worker.model.transformers.llama_forward import _rms_norm, _rotary

ops = cpu_kernels.load()
pytestmark = pytest.mark.skipif(ops is None, reason="the CPU kernels cannot be built here")

DTYPES = (torch.float32, torch.bfloat16)
WIDE = ops is not None and ops.wide_ops()


class Norm:
    """What _rms_norm reads of a LlamaRMSNorm."""

    def __init__(self, width: int, dtype: torch.dtype, eps: float = 1e-5):
        self.weight = (1 + torch.randn(width) / 4).to(dtype)
        self.variance_epsilon = eps


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in float32 ulps of the reference's magnitude."""
    a, b = a.float(), b.float()
    return ((a - b).abs() / torch.finfo(torch.float32).eps / b.abs().clamp_min(1e-6)).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_add_rms_norm_adds_in_place_and_norms_as_llama_rms_norm(dtype, rows, path):
    torch.manual_seed(rows)
    norm = Norm(576, dtype)
    x, delta = rand(rows, 576, dtype=dtype, scale=3), rand(rows, 576, dtype=dtype)
    want_x = x + delta
    want = _rms_norm(norm, want_x)
    got = ops.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)
    assert torch.equal(x, want_x)                     # the residual stream, updated in place
    if dtype == torch.float32:
        assert ulps(got, want) < 8                    # the sum of squares in another order
    else:
        # rounded to bf16 where torch rounds; a float32 sum's last bit can still carry one
        # element across a rounding boundary
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)
    alone = ops.add_rms_norm(x.clone(), None, norm.weight, norm.variance_epsilon)
    assert torch.equal(alone, ops.add_rms_norm(x.clone(), torch.zeros_like(x), norm.weight,
                                               norm.variance_epsilon))
    if dtype == torch.float32:
        assert ulps(alone, _rms_norm(norm, x)) < 8


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_of_gate_times_up(dtype, path):
    torch.manual_seed(0)
    gate_up = rand(7, 2 * 1536, dtype=dtype, scale=4)
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -20.0, -0.0, 0.0, 20.0, 90.0, 200.0])
    gate, up = gate_up.split(1536, -1)
    want = F.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert got.shape == (7, 1536) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=4e-7 if dtype == torch.float32 else 2 ** -7,
                               atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
def test_rotary_is_torchs_to_the_bit_in_the_layout_attention_takes(dtype, heads, kv_heads,
                                                                  path):
    torch.manual_seed(heads)
    rows, dim = 11, 64
    qkv = rand(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)
    pos = torch.arange(100, 100 + rows).float()
    freqs = torch.outer(pos, 1 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q, k, _ = qkv[None].split((heads * dim, kv_heads * dim, kv_heads * dim), -1)
    want_q = _rotary(q.view(1, rows, heads, dim).transpose(1, 2), cos[None, None], sin[None, None])
    want_k = _rotary(k.view(1, rows, kv_heads, dim).transpose(1, 2), cos[None, None],
                     sin[None, None])
    got_q, got_k = ops.rotary(qkv, cos, sin, heads, kv_heads)
    assert got_q.shape == (rows, heads, dim) and got_k.shape == (rows, kv_heads, dim)
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_whatever_rows_are_around_it(dtype, path):
    """Batch invariance: rows are split among threads by count, never summed across."""
    torch.manual_seed(1)
    norm = Norm(576, dtype)
    x, delta, gate_up = rand(64, 576, dtype=dtype), rand(64, 576, dtype=dtype), \
        rand(64, 3072, dtype=dtype)
    full = ops.add_rms_norm(x.clone(), delta, norm.weight, 1e-5)
    one = ops.add_rms_norm(x[5:6].clone(), delta[5:6], norm.weight, 1e-5)
    assert torch.equal(full[5:6], one)
    assert torch.equal(ops.silu_mul(gate_up)[40:41], ops.silu_mul(gate_up[40:41].clone()))


def test_what_they_do_not_take_is_refused_not_misread():
    x = rand(4, 576)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.add_rms_norm(x, None, torch.ones(576, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.add_rms_norm(rand(576, 4).t(), None, torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_mul(rand(2, 64, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="multiple"):
        ops.silu_mul(rand(2, 40))


def test_the_wide_path_is_taken_where_the_cpu_has_avx512_bf16():
    """The runtime check must see what /proc/cpuinfo reports: a build or a check that missed it
    would serve bfloat16 on the slower path without a word."""
    assert ops.wide_ops() == cpu_kernels._cpu_has("avx512f", "avx512bw", "avx512vl", "avx512dq",
                                                  "avx512_bf16")


@pytest.mark.skipif(not WIDE, reason="this CPU has no AVX512-BF16")
def test_the_wide_path_gives_the_avx2_paths_bits():
    """Rounded at the same places with the same exp: the same bits, but for the norm's sum of
    squares, summed in 16 parts instead of 8 (its last bit may cross a rounding boundary)."""
    torch.manual_seed(3)
    norm = Norm(576, torch.bfloat16)
    x, delta = rand(64, 576, dtype=torch.bfloat16, scale=3), rand(64, 576, dtype=torch.bfloat16)
    gate_up = rand(64, 3072, dtype=torch.bfloat16, scale=4)
    qkv, cs = rand(64, 15 * 64, dtype=torch.bfloat16), rand(2, 64, 64, dtype=torch.bfloat16)

    def run():
        xs = x.clone()
        return (ops.add_rms_norm(xs, delta, norm.weight, 1e-5), xs, ops.silu_mul(gate_up),
                *ops.rotary(qkv, cs[0], cs[1], 9, 3))

    wide = run()
    ops.wide_ops(False)
    try:
        narrow = run()
    finally:
        ops.wide_ops(True)
    assert (wide[0] != narrow[0]).float().mean() < 0.01
    torch.testing.assert_close(wide[0], narrow[0], rtol=2 ** -7, atol=0)
    for a, b in zip(wide[1:], narrow[1:]):
        assert torch.equal(a, b)
