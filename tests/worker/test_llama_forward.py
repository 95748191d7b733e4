"""LlamaForward, the written-out Llama forward: transformers' logits bit for bit with torch's ops,
on every pass the model worker runs (whole prompts, chunks, prompt logprobs, decodes beside
chunks), in float32 and bfloat16, and within float32's last bits with the fused layer ops
(worker/model/transformers/layer_ops.cpp); transformers' forward for a model it does not know."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from common.protocol import SamplingParams
from worker.model.transformers import cpu_kernels
from worker.messages import StepRequest
from worker.model.transformers.backend import TransformersBackend
from worker.model.transformers.packed_linear import PackedLinear, pack_linears
from worker.model.transformers.paged_attention import use_paged_attention

from factories import GREEDY, Driver, load_model, make_prompts, new_seq, sharpened


def compared(worker: TransformersBackend, reference, atol: float = 0.0) -> list[int]:
    """Makes each of the worker's passes run twice on the same plan, transformers' forward of
    `reference` (the model as loaded: no fused projections) first, and asserts equal logits
    (and prompt-logprob rows), or within `atol`; returns the passes' sizes."""
    forward, ours, model, sizes = worker._forward, worker.llama, worker.model, []

    def both(plan, tokens_of, want, full=frozenset()):
        worker.llama, worker.model = None, reference
        ref_logits, ref_order, ref_rows = forward(plan, tokens_of, want, full)
        worker.llama, worker.model = ours, model
        logits, order, rows = forward(plan, tokens_of, want, full)   # (writes the same KV)
        assert order == ref_order and rows.keys() == ref_rows.keys()
        for ours_, ref in [(logits, ref_logits)] + [(rows[s], ref_rows[s]) for s in rows]:
            if atol:
                torch.testing.assert_close(ours_, ref, rtol=0, atol=atol)
            else:
                assert torch.equal(ours_, ref)
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
    worker = TransformersBackend(model, info, max_num_seqs=8, prefill_chunk=16, layer_kernels=False)
    assert worker.llama is not None and worker.llama.kernels is None
    # q/k/v and gate/up run as one matmul each (the weights moved into them, not copied)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, nn.Linear) and isinstance(mlp.gate_up_proj, nn.Linear)
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight"))
                   for n, _ in model.named_parameters())
    if packed:   # as TransformersBackend.load packs them: the reference's separate linears, ours fused
        if pack_linears(reference) == 0:
            pytest.skip("this torch cannot pack linears for oneDNN")
        assert pack_linears(model) > 0 and type(attn.qkv_proj) is PackedLinear
    run_every_pass(worker, compared(worker, reference), info)


def run_every_pass(worker: TransformersBackend, sizes: list[int], info) -> None:
    """Whole prompts, 16-token chunks, prompt logprobs, decodes beside chunks, a freed row."""
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


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.5)])
def test_the_fused_layer_ops_give_transformers_logits_to_float32s_last_bits(tiny_model_dir,
                                                                          dtype, atol):
    """The norm's sum and SiLU's exp differ from torch's in float32's last bits, and the sharpened
    model's logits are ~10-100: 1e-4 is a few of their ulps. In bfloat16 every fused op rounds
    where torch's do (equal here), but torch's own sums take another order on an AVX-512 CPU,
    and a last bit moved across a rounding is one bf16 ulp: 0.5 at logits of 64-128."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("the CPU kernels cannot be built here")
    model, info = load_model(tiny_model_dir)
    reference = sharpened(model).to(dtype)
    use_paged_attention(reference)
    worker = TransformersBackend(copy.deepcopy(reference), info, max_num_seqs=8, prefill_chunk=16)
    assert worker.llama.kernels.rotary is kernels.rotary
    run_every_pass(worker, compared(worker, reference, atol), info)


def test_a_model_it_does_not_know_runs_transformers_forward(tiny_model_dir):
    model, info = load_model(tiny_model_dir)
    other = copy.deepcopy(model)
    other.__class__ = type("OtherCausalLM", (type(model),), {})
    worker = TransformersBackend(other, info, max_num_seqs=2)
    assert worker.llama is None
    drive = Driver(worker)
    drive.step(prefill=[new_seq("a", [5, 6, 7], GREEDY)])
    drive.step()
    drive.finish()
