"""decode_layer.cpp's DecodeLayer: a small decode step's layers, one call each, compute what the
Python path (llama_forward.py's _fused, paged attention) computes, to the bit."""
from __future__ import annotations

import pytest
import torch

from factories import make_prompts, new_seq, sharpened
from worker.messages import StepRequest
from worker.model.transformers.backend import TransformersBackend
from worker.model.transformers.quantized_linear import quantize_linears


class Counted:
    """A DecodeLayer that counts the calls of all of them."""
    calls = 0

    def __init__(self, make, *args):
        self.layer = make(*args)

    def __call__(self, *args):
        Counted.calls += 1
        return self.layer(*args)


def run(worker: TransformersBackend, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Four sequences prefilled and decoded together past block boundaries (new blocks); a
    fifth prompt computed chunk by chunk beside them; 5 rows (over the quantized layers'
    limit); one freed, 4 rows again. Returns every step's logits."""
    seen = []
    sample = worker._sample

    def record(seq_ids, states, logits, res):
        seen.append(logits.clone())
        return sample(seq_ids, states, logits, res)

    worker._sample = record
    ids = [f"s{i}" for i in range(4)]

    def step(**kw):
        assert not worker.step(StepRequest(**kw)).errors

    step(prefill=[new_seq(s, p) for s, p in zip(ids, prompts)])
    for _ in range(10):
        step(decode_seq_ids=ids)
    step(prefill=[new_seq("late", prompts[4])], decode_seq_ids=ids, chunks={"late": 8})
    for _ in range(3):
        step(decode_seq_ids=ids, chunks={"late": 8})
    ids.append("late")
    for _ in range(3):
        step(decode_seq_ids=ids)
    step(decode_seq_ids=ids[1:], free_seq_ids=ids[:1])
    step(decode_seq_ids=ids[1:])
    step(free_seq_ids=ids[1:])
    return seen


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kv", ["float16", "float32"])
def test_whole_layers_give_the_python_paths_logits_to_the_bit(kernels, tiny_model, mode, kv):
    model, info = tiny_model
    quantized = sharpened(model, scale=1.0)   # (a copy)
    TransformersBackend(quantized, info, max_num_seqs=8)   # fuses q/k/v and gate/up, as load
    assert quantize_linears(quantized, mode, kernels, max_rows=4) > 0   # (5 rows: above)
    prompts = make_prompts(5, lengths=[3, 7, 8, 15, 30], vocab=info.vocab_size)
    runs = []
    for whole in (True, False):
        worker = TransformersBackend(quantized, info, max_num_seqs=8, kv_cache_dtype=kv)
        worker.llama.whole_layers = whole
        worker.llama.kernels = worker.llama.kernels._replace(
            decode_layer=lambda *a: Counted(kernels.DecodeLayer, *a))
        Counted.calls = 0
        runs.append(run(worker, prompts))
        # The 4-row decodes: 10, the one apart from the newcomer's first chunk, the last 2;
        # not those a chunk rides with, nor the 5-row ones
        assert Counted.calls == (13 * quantized.config.num_hidden_layers if whole else 0)
    assert len(runs[0]) == len(runs[1])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_a_model_not_all_quantized_runs_the_python_path(kernels, tiny_model):
    model, info = tiny_model
    worker = TransformersBackend(sharpened(model, scale=1.0), info, max_num_seqs=2)
    worker.llama.kernels = worker.llama.kernels._replace(
        decode_layer=lambda *a: Counted(kernels.DecodeLayer, *a))
    Counted.calls = 0
    worker.step(StepRequest(prefill=[new_seq("a", [5, 6, 7])]))
    assert not worker.step(StepRequest(decode_seq_ids=["a"])).errors
    assert Counted.calls == 0
    quantize_linears(worker.model, "int8", kernels)   # (replaces every layer's linears)
    assert not worker.step(StepRequest(decode_seq_ids=["a"])).errors
    assert Counted.calls == worker.model.config.num_hidden_layers
