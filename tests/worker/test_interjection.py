"""Interjection in the model worker: a better priority's prefill run between two layers of the
step in flight (issue 16). The interrupted step and the interjected newcomers get exactly the
tokens they get when the same passes run one after the other; a prompt being computed chunk by
chunk stays the interrupted step's; nothing interjects inside an interjection."""
from __future__ import annotations

import time

import pytest

from factories import GREEDY, make_prompts, make_worker, new_seq
from worker.messages import StepRequest
from worker.model.backend import StepHooks
from worker.model.transformers.backend import TransformersBackend, decoder_layers

N = 6
PROMPTS = dict(zip(("a", "b", "chat", "long"), make_prompts(4, lengths=[9, 14, 5, 40], seed=5)))


@pytest.fixture
def worker(sharp_model):
    model, info = sharp_model
    return TransformersBackend(model, info, 8)


def start_batch(worker: TransformersBackend) -> dict[str, list[int]]:
    """a and b prefilled, then the long prompt joins with its first chunk of 16 tokens."""
    res = worker.step(StepRequest(prefill=[new_seq("a", PROMPTS["a"]),
                                           new_seq("b", PROMPTS["b"])]))
    out = {sid: [tok] for sid, tok in res.token_ids.items()}
    res = worker.step(StepRequest(prefill=[new_seq("long", PROMPTS["long"])],
                                  decode_seq_ids=["a", "b"], chunks={"long": 16}))
    for sid, tok in res.token_ids.items():
        out[sid].append(tok)
    assert set(out) == {"a", "b"}
    return out


def finish(worker: TransformersBackend, out: dict[str, list[int]]) -> dict[str, list[int]]:
    """Decodes everyone until each has N tokens; the long prompt's rest rides along."""
    while any(len(out.get(s, [])) < N for s in ("a", "b", "chat", "long")):
        res = worker.step(StepRequest(decode_seq_ids=["a", "b", "chat", "long"],
                                      chunks={"long": 16}))
        assert not res.errors
        for sid, tok in res.token_ids.items():
            out.setdefault(sid, []).append(tok)
    return {sid: toks[:N] for sid, toks in out.items()}


def serially(worker: TransformersBackend) -> dict[str, list[int]]:
    """The reference: the step with the long prompt's second chunk, then chat's prefill after it."""
    out = start_batch(worker)
    res = worker.step(StepRequest(decode_seq_ids=["a", "b", "long"], chunks={"long": 16}))
    for sid, tok in res.token_ids.items():
        out[sid].append(tok)
    res = worker.step(StepRequest(prefill=[new_seq("chat", PROMPTS["chat"])], interject=True))
    out["chat"] = [res.token_ids["chat"]]
    return finish(worker, out)


def test_an_interjection_between_layers_gives_the_tokens_of_the_passes_in_turn(sharp_model):
    model, info = sharp_model
    reference = serially(TransformersBackend(model, info, 8))

    worker = TransformersBackend(model, info, 8)
    out = start_batch(worker)
    answers, calls = [], []

    def between_layers():   # as the model process's: the request arrives before layer 2
        calls.append(len(calls))
        if len(calls) == 2:
            answers.append(worker.step(StepRequest(prefill=[new_seq("chat", PROMPTS["chat"])],
                                                   interject=True)))

    worker.hooks = StepHooks(between_layers=between_layers)
    res = worker.step(StepRequest(decode_seq_ids=["a", "b", "long"], chunks={"long": 16}))
    worker.hooks = StepHooks()
    layers = len(decoder_layers(model))
    assert layers == model.config.num_hidden_layers and worker.interjects
    # Called before every layer of the interrupted pass, never inside the interjection's.
    assert len(calls) == layers
    [side] = answers
    assert side.interjected and not res.interjected
    assert set(side.token_ids) == {"chat"}      # the long prompt's chunk was not computed twice
    assert set(res.token_ids) == {"a", "b"}
    assert worker.cache.lengths["long"] == 32   # its second chunk, once
    for sid, tok in res.token_ids.items():
        out[sid].append(tok)
    out["chat"] = [side.token_ids["chat"]]
    assert finish(worker, out) == reference


def test_interjection_time_is_left_out_of_the_interrupted_steps_timing(worker):
    """StepTiming's model compute counts the step's own passes, not the interjection's."""
    start_batch(worker)
    worker.hooks = StepHooks(between_layers=lambda: None if worker._interjected_s else worker.step(
        StepRequest(prefill=[new_seq("chat", PROMPTS["chat"])], interject=True)))
    t = time.perf_counter()
    res = worker.step(StepRequest(decode_seq_ids=["a", "b", "long"], chunks={"long": 16}))
    wall = time.perf_counter() - t
    lent = worker._interjected_s
    assert "chat" in worker.cache.tables and lent > 0
    assert 0 < res.prefill_s + res.decode_s <= wall - lent + 1e-4
