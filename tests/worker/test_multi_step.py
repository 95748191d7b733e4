"""Multi-step decode in the transformers backend: a request of `num_steps` passes decodes the
running batch that many times in one step (vLLM's multi-step scheduling), each sequence getting
the tokens one pass a step gives it, stopping at its end, and the passes ending where the model
process's CutShort hook says so."""
from __future__ import annotations

import dataclasses

import pytest

from common.protocol import SamplingParams
from factories import GREEDY, make_prompts, new_seq
from worker.messages import StepRequest
from worker.model.backend import StepHooks
from worker.model.transformers.backend import TransformersBackend

PROMPTS = dict(zip("abc", make_prompts(3, lengths=[9, 14, 5], seed=11)))
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=3)


@pytest.fixture
def worker(sharp_model):
    model, info = sharp_model
    return TransformersBackend(model, info, 8)


def with_(params: SamplingParams, **kw) -> SamplingParams:
    return dataclasses.replace(params, **kw)


def multi_step(worker, params: dict, num_steps: int, stops: dict | None = None
               ) -> tuple[dict[str, list[int]], list[int]]:
    """Prefills the prompts `params` names, then sends decode steps of `num_steps` passes until
    every sequence has ended. Returns each sequence's tokens and the passes each step ran."""
    stops = stops or {}
    res = worker.step(StepRequest(prefill=[new_seq(sid, PROMPTS[sid], p, stops.get(sid, ()))
                                           for sid, p in params.items()]))
    out = {sid: [tok] for sid, tok in res.token_ids.items()}
    passes = []
    while live := [sid for sid in params if not worker.states[sid].ended]:
        res = worker.step(StepRequest(decode_seq_ids=live, num_steps=num_steps))
        assert not res.errors, res.errors
        passes.append(res.num_passes)
        for sid in live:
            out[sid] += [res.token_ids[sid], *res.more_token_ids.get(sid, [])]
    worker.step(StepRequest(free_seq_ids=list(params)))
    return out, passes


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_multi_step_passes_make_the_tokens_of_one_pass_a_step(worker, params):
    """A sequence that reaches max_tokens stops there while the others go on."""
    per = {"a": with_(params, max_tokens=7), "b": with_(params, max_tokens=11)}
    single, one = multi_step(worker, per, 1)
    multi, passes = multi_step(worker, per, 4)
    assert multi == single
    assert [len(multi[s]) for s in "ab"] == [7, 11]
    assert one == [1] * 10
    assert passes == [4, 4, 2]   # b alone in the last two passes of the second step, then 2


def test_multi_step_stops_a_sequence_at_a_stop_token_once_min_tokens_are_out(worker):
    first, _ = multi_step(worker, {"a": with_(GREEDY, max_tokens=12)}, 1)
    first = first["a"]
    k = next(i for i in range(2, 12) if first[i] not in first[:i])   # a token new at k
    stop = {"a": (first[k],)}
    out, passes = multi_step(worker, {"a": with_(GREEDY, max_tokens=50)}, 8, stop)
    assert out["a"] == first[:k + 1] and len(passes) == -(-k // 8)   # ends on it, mid-step
    out, _ = multi_step(worker, {"a": with_(GREEDY, max_tokens=k + 3, min_tokens=k + 2)}, 8,
                        stop)
    a = out["a"]   # the stop token masked for its first k + 2 tokens: it runs to the length
    assert a[:k] == first[:k] and first[k] not in a[:k + 2] and len(a) == k + 3


def test_a_batch_with_a_logprobs_sequence_runs_one_pass_a_step(worker):
    """Only the first pass's logprobs travel in a StepResult."""
    out, passes = multi_step(worker, {"a": with_(GREEDY, max_tokens=4),
                                      "c": with_(GREEDY, max_tokens=4, logprobs=1)}, 4)
    assert passes == [1, 1, 1] and all(len(t) == 4 for t in out.values())


def test_multi_step_passes_end_where_another_pass_says_so(worker):
    whole, _ = multi_step(worker, {"a": with_(GREEDY, max_tokens=9)}, 1)
    asked = []
    worker.hooks = StepHooks(another_pass=lambda: asked.append(1) or len(asked) % 3 != 0)
    cut, passes = multi_step(worker, {"a": with_(GREEDY, max_tokens=9)}, 8)
    assert cut == whole
    assert passes == [3, 3, 2]   # two more passes, cut at the third ask; then the last two


def test_a_step_with_a_prompt_chunk_riding_runs_one_pass(worker):
    """A prompt computed chunk by chunk beside the decode: its next chunk belongs to the next
    step, so the decode does not run ahead of it."""
    res = worker.step(StepRequest(prefill=[new_seq("a", PROMPTS["a"])]))
    res = worker.step(StepRequest(prefill=[new_seq("b", PROMPTS["b"])], decode_seq_ids=["a"],
                                  chunks={"b": 4}))
    res = worker.step(StepRequest(decode_seq_ids=["a"], chunks={"b": 4}, num_steps=4))
    assert res.num_passes == 1 and set(res.token_ids) == {"a"}
