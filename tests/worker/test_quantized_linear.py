"""QuantizedLinear: int8 / int4 weights at small steps, the float layer at large ones."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from common.settings import Settings
from factories import make_prompts, new_seq, sharpened
from worker.messages import StepRequest
from worker.model.transformers.backend import TransformersBackend
from worker.model.transformers.packed_linear import PackedLinear
from worker.model.transformers.quantized_linear import (AUTO, MAX_ROWS, QuantizedLinear,
                                                        dequantize, from_tiles, quantize_int8,
                                                        quantize_linears, resolve_quantization,
                                                        to_tiles)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 7])
@pytest.mark.parametrize("n", [70, 67])   # a last tile of two output rows, of three
def test_the_kernel_computes_the_matmul_over_the_dequantized_weight(kernels, mode, dtype, rows,
                                                                    n):
    torch.manual_seed(0)
    lin = nn.Linear(96, n, bias=True).to(dtype)
    q = QuantizedLinear(lin, lin.weight, mode, kernels, max_rows=rows)
    x = torch.randn(rows, 96).to(dtype)
    with torch.inference_mode():
        got = q(x)
        want = x.float() @ q.dequantized().t() + lin.bias.float()
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2   # (bfloat16: the output's rounding)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode, tol", [("int8", 0.01), ("int4", 0.1)])
def test_a_quantized_linear_stays_close_to_the_float_one(kernels, mode, tol):
    torch.manual_seed(0)
    lin = nn.Linear(576, 192, bias=False)
    x = torch.randn(1, 576)
    with torch.inference_mode():
        want = lin(x)
        got = QuantizedLinear(lin, lin.weight, mode, kernels)(x)
    # relative to the output's size: int8 rounds each weight to 1/254 of its group's largest,
    # int4 to 1/30 of its group's range
    assert (got - want).abs().max() <= tol * want.abs().max()


def test_one_large_weight_coarsens_only_its_own_group_of_32():
    """int8's scale is per 32 inputs: a weight 100x the rest (as an outlier channel makes)
    sets the rounding step of its own group only, and every other weight of its row keeps a
    step of 1/254 of its own group's largest."""
    torch.manual_seed(0)
    w = torch.randn(4, 128) * 0.02
    w[:, 5] = 2.0                                    # in the first group of every row
    q, scales = quantize_int8(w)
    err = (dequantize("int8", q, scales) - w).abs()
    rest = w[:, 32:].abs().reshape(4, -1, 32).amax(-1)
    assert scales.shape == (4, 4) and scales.dtype == torch.float16
    assert (err[:, 32:].reshape(4, -1, 32).amax(-1) <= rest / 254 * 1.01).all()
    assert err[:, :32].max() > rest.max() / 254     # (the outlier's own group is coarse)


@pytest.mark.parametrize("n", [8, 6])
def test_int8_weights_are_kept_tile_by_tile_as_the_kernel_streams_them(n):
    """A tile of four output rows (the last tile the rest) is one run of memory: group by
    group, its rows' 32 weights one after the other, and its rows' scales likewise."""
    q = torch.arange(n * 64).reshape(n, 64)            # two groups of 32 a row
    scales = torch.arange(n * 2).reshape(n, 2)
    tiled, tiled_scales = to_tiles(q, 32).flatten(), to_tiles(scales, 1).flatten()
    assert torch.equal(tiled[:128], torch.cat([q[r, :32] for r in range(4)]))
    assert torch.equal(tiled[128:256], torch.cat([q[r, 32:] for r in range(4)]))
    assert torch.equal(tiled[256:256 + 32 * (n - 4)], torch.cat([q[r, :32] for r in range(4, n)]))
    assert tiled_scales[:8].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(from_tiles(to_tiles(q, 32), 32), q)
    assert torch.equal(from_tiles(to_tiles(scales, 1), 1), scales)


def test_steps_above_the_row_limit_take_a_float_layer_over_the_same_weights(kernels):
    """A larger step computes with the weights the kernel reads, dequantized, not the original
    float ones: a row gets the same numbers at a step of 2 rows and at one of 3 (to float
    summation order), so its tokens do not depend on how many rows share its step."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    q = QuantizedLinear(lin, lin.weight, "int8", kernels, max_rows=2)
    calls = []
    q.float_linear.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        small = q(x[:2])
        assert not calls
        large = q(x)
        assert calls
        want = x @ q.dequantized().t() + lin.bias
        torch.testing.assert_close(large, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(large[:2], small, rtol=1e-5, atol=1e-5)
        assert (large - lin(x)).abs().max() > 1e-4   # (the original weights give other numbers)


def test_a_tied_lm_heads_embedding_keeps_its_float_weights(kernels):
    torch.manual_seed(0)
    model = nn.Module()
    model.embed, model.head = nn.Embedding(32, 64), nn.Linear(64, 32, bias=False)
    model.head.weight = model.embed.weight           # tied, as SmolLM2's
    before = model.embed.weight.detach().clone()
    assert quantize_linears(model, "int8", kernels) == 1
    assert isinstance(model.head, QuantizedLinear)
    assert torch.equal(model.embed.weight, before)
    assert not torch.equal(model.head.float_linear.weight, before)


def worker_with(model_dir: str, quantization: str) -> TransformersBackend:
    return TransformersBackend.load(Settings(model=model_dir, device="cpu", dtype="float32",
                                             quantization=quantization, prefix_cache_mb=0))


def test_the_engine_takes_the_quantized_weights_at_one_row_and_the_float_ones_at_many(
        kernels, tiny_model_dir):
    worker = worker_with(tiny_model_dir, "int8")
    # (each layer's linears called from Python, where they can be counted; at one row they
    # are otherwise called from decode_layer.cpp, test_decode_layer.py)
    worker.llama.whole_layers = False
    layers = [m for m in worker.model.modules() if isinstance(m, QuantizedLinear)]
    # every linear layer (the fused qkv and gate/up, o, down, the lm_head), its float layer
    # packed inside it
    assert len(layers) == 4 * worker.model.config.num_hidden_layers + 1
    assert all(type(m.float_linear) is PackedLinear for m in layers)
    assert "int8 weights" in worker.info.kernels
    seen = {"quantized": 0, "float": 0}
    for m in layers:
        kernel = m._kernel
        m._kernel = lambda *a, k=kernel: (seen.__setitem__("quantized", seen["quantized"] + 1),
                                          k(*a))[1]
        m.float_linear.register_forward_hook(
            lambda *_: seen.__setitem__("float", seen["float"] + 1))

    def count(req: StepRequest) -> dict:
        seen.update(quantized=0, float=0)
        assert not worker.step(req).errors
        return dict(seen)

    n = MAX_ROWS["int8"] + 1
    prompts = make_prompts(n, lengths=[5] * n, vocab=worker.info.vocab_size)
    count(StepRequest(prefill=[new_seq("a", prompts[0])]))
    assert count(StepRequest(decode_seq_ids=["a"])) == {"quantized": len(layers), "float": 0}
    count(StepRequest(prefill=[new_seq(f"s{i}", p) for i, p in enumerate(prompts[1:])]))
    many = [f"s{i}" for i in range(n - 1)] + ["a"]
    assert count(StepRequest(decode_seq_ids=many)) == {"quantized": 0, "float": len(layers)}
    # the limit itself still takes the quantized weights (the multi-row kernel)
    assert count(StepRequest(decode_seq_ids=many[1:])) == {"quantized": len(layers), "float": 0}


def test_no_quantization_leaves_the_float_layers(tiny_model_dir):
    worker = worker_with(tiny_model_dir, "none")
    assert not any(isinstance(m, QuantizedLinear) for m in worker.model.modules())
    assert "weights" not in worker.info.kernels


@pytest.mark.parametrize("mode, agree", [("int8", 1.0), ("int4", 0.75)])
def test_greedy_tokens_at_one_row_against_the_float_model(kernels, tiny_model, mode, agree):
    """One sequence at a time (every decode step takes the quantized weights), 24 tokens each,
    on the tiny random model: int8 gives the float model's tokens, int4 most of them up to the
    first divergence (85 % here). (The sharpened model is no judge: its weights scaled 8x make
    every logit a near-tie, and even int8 kept only half the tokens there.)"""
    model, info = tiny_model
    quantized = sharpened(model, scale=1.0)   # (a copy)
    TransformersBackend(quantized, info, max_num_seqs=1)   # fuses q/k/v and gate/up, as load
    assert quantize_linears(quantized, mode, kernels) > 0
    prompts = make_prompts(6, lengths=[3, 17, 40, 9, 25, 60], vocab=info.vocab_size)
    same = total = 0
    for i, p in enumerate(prompts):
        runs = []
        for m in (model, quantized):
            w = TransformersBackend(m, info, max_num_seqs=1)
            tokens = list(w.step(StepRequest(prefill=[new_seq("x", p)])).token_ids.values())
            for _ in range(23):
                tokens += w.step(StepRequest(decode_seq_ids=["x"])).token_ids.values()
            runs.append(tokens)
        diverge = next((j for j, (a, b) in enumerate(zip(*runs)) if a != b), len(runs[0]))
        same += diverge
        total += len(runs[0])
    assert same / total >= agree


def test_auto_is_int8_under_float32_only():
    """The guard measured int8 under float32 (bench/quality.py); under bfloat16 auto is off."""
    assert resolve_quantization("auto", torch.float32) == AUTO == "int8"
    assert resolve_quantization("auto", torch.bfloat16) == "none"
    assert [resolve_quantization(m, torch.bfloat16) for m in ("none", "int8", "int4")] == [
        "none", "int8", "int4"]
