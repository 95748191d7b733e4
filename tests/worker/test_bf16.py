"""The model worker in bfloat16: packed linears, bf16 KV cache and attention, fp32 sampling."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from common.protocol import SamplingParams
from common.settings import Settings
from factories import make_prompts, plain_logits, run_batch
from worker.model_manager import ModelManager
from worker.model.transformers.backend import TransformersBackend
from worker.model.transformers.packed_linear import PackedLinear
from worker.model.sampler import Sampler, SamplingState


@pytest.fixture(scope="module")
def bf16_worker(tiny_model_dir):
    return TransformersBackend.load(Settings(model=tiny_model_dir, device="cpu", dtype="bfloat16"))


def onednn_packs_bf16() -> bool:
    """Whether this CPU's oneDNN lays out a bf16 weight: it needs AVX512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and says so with a RuntimeError on an AVX2-only CPU."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 8)
        return True
    except RuntimeError:
        return False


def test_a_bf16_worker_packs_its_linears_where_onednn_can_and_keeps_its_cache_in_bf16(
        bf16_worker):
    w = bf16_worker
    assert w.info.dtype == "bfloat16"
    linears = sum(type(m) is nn.Linear for m in w.model.modules())
    packed = sum(isinstance(m, PackedLinear) for m in w.model.modules())
    if onednn_packs_bf16():
        assert linears == 0 and packed > 0
    else:   # AVX2-only: every layer stays nn.Linear, and the worker still serves
        assert packed == 0 and linears > 0
    run_batch(w, {"a": [5, 6, 7, 8]}, 2)
    assert w.cache.k[0].dtype == torch.bfloat16


def test_bf16_greedy_tokens_are_the_plain_bf16_models_up_to_near_ties(bf16_worker, tiny_model_dir):
    """Every token of a batch of different lengths (paged attention, packed linears) is the
    argmax of an uncached bf16 forward over the same context, or within bf16's rounding of it."""
    plain, info = ModelManager(tiny_model_dir).load_model("cpu", "bfloat16")
    prompts = make_prompts(4, lengths=[3, 11, 30, 7], vocab=info.vocab_size)
    out = run_batch(bf16_worker, {f"s{i}": p for i, p in enumerate(prompts)}, 6)
    exact = total = 0
    for i, p in enumerate(prompts):
        for j, tok in enumerate(out[f"s{i}"]):
            logits = plain_logits(plain, p + out[f"s{i}"][:j])
            best = int(logits.argmax())
            gap = float(logits[best] - logits[tok])
            assert gap <= 0.05 * float(logits.abs().max()), (i, j, tok, best, gap)
            exact += tok == best
            total += 1
    assert exact >= 0.75 * total


def test_the_sampler_takes_bf16_logits_in_fp32():
    torch.manual_seed(0)
    logits = torch.randn(3, 50).to(torch.bfloat16)
    states = [SamplingState.create(SamplingParams(temperature=t, seed=1, logprobs=2), [1], 0, (),
                                   "cpu") for t in (0.0, 0.7, 1.0)]
    tokens, lps = Sampler().sample(logits, states)
    assert tokens[0] == int(logits[0].float().argmax())
    want = torch.log_softmax(logits[0].float(), -1)[tokens[0]]
    assert lps[0].logprob == pytest.approx(float(want))
    assert all(0 <= t < 50 for t in tokens)


def test_the_bf16_kernels_label_names_kernels_that_run(tiny_model_dir, monkeypatch):
    """The heartbeat's kernels line says "bfloat16 kernels on AVX512-BF16" only when one of the
    C++ kernels runs: not when the module is loaded but the decode kernel does not fit the
    model's shapes and the layer ops are off."""
    import worker.model.transformers.backend as mw
    from worker.model.transformers import cpu_kernels

    module = cpu_kernels.load()
    if module is None:
        pytest.skip("the C++ kernels do not build here")
    monkeypatch.setattr(module, "wide_ops", lambda *on: True)   # as on an AVX512-BF16 CPU
    model, info = ModelManager(tiny_model_dir).load_model("cpu", "bfloat16")

    def worker(**kw):
        return TransformersBackend(model, info, max_num_seqs=2, kv_cache_bytes=1 << 20, **kw).info.kernels

    assert worker(layer_kernels=False).endswith("; bfloat16 kernels on AVX512-BF16")
    monkeypatch.setattr(mw, "kernel_fits", lambda model: False)
    neither = worker(layer_kernels=False)
    assert "gather + SDPA" in neither and "layer ops: torch" in neither
    assert "bfloat16 kernels" not in neither
