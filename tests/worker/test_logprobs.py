"""Logprobs from the model worker: the same logits the sampler used, the raw distribution (vLLM's
default: before penalties and temperature), the sampled token's rank, and prompt logprobs equal
to one plain forward pass over the prompt."""
from __future__ import annotations

import torch

from common.protocol import SamplingParams
from factories import make_prompts, new_seq
from worker.messages import StepRequest
from worker.model.transformers.backend import TransformersBackend
from worker.model.sampler import Sampler, SamplingState


def state(params: SamplingParams, token_ids=(1,)) -> SamplingState:
    return SamplingState.create(params, list(token_ids), 0, (), "cpu")


def test_logprobs_are_of_the_raw_distribution():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 50, generator=gen)
    raw = torch.log_softmax(logits, -1)
    greedy = SamplingParams(temperature=0.0, logprobs=3)
    # Penalised and hot: the sampled token changes, the reported distribution does not.
    shaped = SamplingParams(temperature=1.7, seed=3, repetition_penalty=1.9, logprobs=3,
                            presence_penalty=1.0)
    tokens, lps = Sampler().sample(logits.clone(), [state(greedy), state(shaped, [1, 7, 7])])
    best = int(raw[0].argmax())
    assert tokens[0] == best and lps[0].rank == 1 and lps[0].top_ids[0] == best
    assert lps[0].logprob == float(raw[0, best])
    top = torch.topk(raw[1], 3)
    assert lps[1].top_ids == top.indices.tolist()
    assert lps[1].top_logprobs == top.values.tolist()
    assert lps[1].logprob == float(raw[1, tokens[1]])
    assert lps[1].rank == int((raw[1] > raw[1, tokens[1]]).sum()) + 1


def test_rows_without_logprobs_get_none_and_the_same_tokens():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    plain = [state(SamplingParams(temperature=0.0)) for _ in range(3)]
    asked = [state(SamplingParams(temperature=0.0, logprobs=0 if i == 1 else None))
             for i in range(3)]
    tokens, lps = Sampler().sample(logits.clone(), asked)
    assert tokens == Sampler()(logits.clone(), plain)
    assert lps[0] is None and lps[2] is None
    assert lps[1].top_ids == [] and lps[1].rank == 1


def test_worker_returns_logprobs_for_prefill_and_decode(tiny_model):
    model, info = tiny_model
    prompts = make_prompts(2, lengths=[7, 19], seed=4)
    worker = TransformersBackend(model, info, 4)
    params = SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=1)
    res = worker.step(StepRequest(prefill=[new_seq("a", prompts[0], params),
                                           new_seq("b", prompts[1])]))
    assert set(res.logprobs) == {"a"} and set(res.prompt_logprobs) == {"a"}
    assert res.logprobs["a"].top_ids[0] == res.token_ids["a"]
    # Prompt logprobs: one per prompt token after the first, as one plain forward pass says.
    with torch.inference_mode():
        full = torch.log_softmax(model(torch.tensor([prompts[0]])).logits[0].float(), -1)
    got = res.prompt_logprobs["a"]
    assert len(got) == len(prompts[0]) - 1
    for i, (tok, lp) in enumerate(zip(prompts[0][1:], got)):
        assert abs(lp.logprob - float(full[i, tok])) < 1e-4
        assert lp.top_ids == [int(full[i].argmax())]
    res = worker.step(StepRequest(decode_seq_ids=["a", "b"]))
    assert set(res.logprobs) == {"a"} and res.logprobs["a"].rank == 1


def test_a_scored_prompt_keeps_every_position_and_the_others_only_their_last(tiny_model):
    """One flat pass over the newcomers (the paged cache): the scored prompt's logits are kept
    at each of its positions, the other newcomers' at their last only."""
    model, info = tiny_model
    prompts = make_prompts(3, lengths=[12, 12, 12], seed=6)
    worker = TransformersBackend(model, info, 4)
    kept = []
    forward = worker.llama   # (the model's forward pass: tokens in, kept logits out)
    worker.llama = lambda ids, pos, plan, keep: kept.append(len(keep)) or forward(ids, pos,
                                                                                 plan, keep)
    res = worker.step(StepRequest(prefill=[
        new_seq("a", prompts[0]), new_seq("b", prompts[1]),
        new_seq("s", prompts[2], SamplingParams(temperature=0.0, prompt_logprobs=0))]))
    assert kept == [3 + 12]
    assert len(res.prompt_logprobs["s"]) == 11 and set(res.token_ids) == {"a", "b", "s"}


def test_a_scored_prompt_is_chunked_like_any_other(tiny_model):
    """A prompt with prompt logprobs is computed in chunks of at most the step's chunk size,
    beside a decoding sequence (its chunks ride in the decode's pass), and answered at its
    last chunk with logprobs at every position equal to a run that computes it whole."""
    model, info = tiny_model
    long, short = make_prompts(2, lengths=[500, 9], seed=8)
    params = SamplingParams(temperature=0.0, prompt_logprobs=3)
    whole = TransformersBackend(model, info, 4, prefill_chunk=2048)
    ref = whole.step(StepRequest(prefill=[new_seq("s", long, params)])).prompt_logprobs["s"]

    worker = TransformersBackend(model, info, 4, prefill_chunk=128)
    passes = []
    forward = worker.llama
    worker.llama = lambda ids, pos, plan, keep: passes.append(len(ids)) or forward(ids, pos,
                                                                                  plan, keep)
    worker.step(StepRequest(prefill=[new_seq("d", short)]))
    res = worker.step(StepRequest(prefill=[new_seq("s", long, params)], decode_seq_ids=["d"]))
    steps = 1
    while "s" not in res.token_ids:
        assert not res.prompt_logprobs and not res.errors
        res = worker.step(StepRequest(decode_seq_ids=["d", "s"]))
        steps += 1
    assert steps == 4   # 500 tokens in chunks of 128
    assert max(passes) <= 128 + 1   # a chunk and the decoding sequence's token
    got = res.prompt_logprobs["s"]
    assert len(got) == len(ref) == len(long) - 1
    for a, b in zip(got, ref):
        # (chunks change the sums' order: logits that near-tie the target's may swap with it)
        assert abs(a.logprob - b.logprob) < 1e-4 and abs(a.rank - b.rank) <= 5
        assert a.top_ids == b.top_ids
        assert all(abs(x - y) < 1e-4 for x, y in zip(a.top_logprobs, b.top_logprobs))
    assert not worker.scored   # nothing kept once answered
