"""LlamaForward, the written-out Llama forward: transformers' logits bit for bit, on every pass
the model worker runs (whole prompts, chunks, prompt logprobs, decodes beside chunks), in
float32 and bfloat16; transformers' forward for a model it does not know."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from common.protocol import SamplingParams
from worker.messages import StepRequest
from worker.model_worker import ModelWorker
from worker.packed_linear import PackedLinear, pack_linears
from worker.paged_attention import use_paged_attention

from factories import GREEDY, Driver, load_model, make_prompts, new_seq, sharpened


def compared(worker: ModelWorker, reference) -> list[int]:
    """Makes each of the worker's passes run twice on the same plan, transformers' forward of
    `reference` (the model as loaded: no fused projections) first, and asserts equal logits
    (and prompt-logprob rows); returns the passes' sizes."""
    forward, ours, model, sizes = worker._forward, worker.llama, worker.model, []

    def both(plan, tokens_of, want, full=frozenset()):
        worker.llama, worker.model = None, reference
        ref_logits, ref_order, ref_rows = forward(plan, tokens_of, want, full)
        worker.llama, worker.model = ours, model
        logits, order, rows = forward(plan, tokens_of, want, full)   # (writes the same KV)
        assert order == ref_order and rows.keys() == ref_rows.keys()
        assert torch.equal(logits, ref_logits)
        assert all(torch.equal(rows[s], ref_rows[s]) for s in rows)
        sizes.append(len(plan.rows))
        return logits, order, rows

    worker._forward = both
    return sizes


@pytest.mark.parametrize("dtype,packed", [(torch.float32, False), (torch.bfloat16, False),
                                          (torch.float32, True)])
def test_the_written_out_forward_gives_transformers_logits_bit_for_bit(tiny_model_dir, dtype,
                                                                      packed):
    model, info = load_model(tiny_model_dir)
    reference = sharpened(model).to(dtype)   # tokens that depend on the whole context
    use_paged_attention(reference)
    model = copy.deepcopy(reference)
    worker = ModelWorker(model, info, max_num_seqs=8, prefill_chunk=16)
    assert worker.llama is not None
    # q/k/v and gate/up run as one matmul each (the weights moved into them, not copied)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, nn.Linear) and isinstance(mlp.gate_up_proj, nn.Linear)
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight"))
                   for n, _ in model.named_parameters())
    if packed:   # as ModelWorker.load packs them: the reference's separate linears, ours fused
        if pack_linears(reference) == 0:
            pytest.skip("this torch cannot pack linears for oneDNN")
        assert pack_linears(model) > 0 and type(attn.qkv_proj) is PackedLinear
    sizes = compared(worker, reference)
    prompts = make_prompts(5, lengths=[3, 40, 7, 70, 12], vocab=info.vocab_size)
    scored = SamplingParams(temperature=0.0, prompt_logprobs=2)
    joins = {0: [new_seq("a", prompts[0]), new_seq("b", prompts[1], scored)],
             4: [new_seq("c", prompts[3]), new_seq("d", prompts[2])],   # c in 16-token chunks
             11: [new_seq("e", prompts[4])]}
    running, made = [], {}
    for step in range(15):
        free = ["a"] if step == 11 else []
        running = [r for r in running if r not in free]
        res = worker.step(StepRequest(prefill=joins.get(step, []), decode_seq_ids=running,
                                      free_seq_ids=free))
        assert not res.errors, res.errors
        running += [n.seq_id for n in joins.get(step, [])]
        for sid, tok in res.token_ids.items():
            made.setdefault(sid, []).append(tok)
    assert len(made["c"]) < len(made["d"])   # c's prompt took several steps
    assert len(sizes) >= 14 and max(sizes) >= 4


def test_a_model_it_does_not_know_runs_transformers_forward(tiny_model_dir):
    model, info = load_model(tiny_model_dir)
    other = copy.deepcopy(model)
    other.__class__ = type("OtherCausalLM", (type(model),), {})
    worker = ModelWorker(other, info, max_num_seqs=2)
    assert worker.llama is None
    drive = Driver(worker)
    drive.step(prefill=[new_seq("a", [5, 6, 7], GREEDY)])
    drive.step()
    drive.finish()
