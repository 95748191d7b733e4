"""EngineCore's edges on fakeredis, without a model process (issue 13, bugs 1, 5 and 9)."""
from __future__ import annotations

from types import SimpleNamespace

import fakeredis
import pytest

from common import metrics
from common.protocol import FinishReason, SequenceRequest
from common.settings import Settings
from common.store import SequenceStore



@pytest.fixture
def store():
    return SequenceStore(fakeredis.FakeRedis(decode_responses=True))


def success(store) -> dict[str, float]:
    return metrics.read_snapshot(store.r)["success"]


def make_engine(store, max_model_len: int = 8, tokenizer=None):
    """An engine whose executor is only its model's description: admit(), update and publish
    never reach the model process (a test plays the model's StepResults)."""
    from worker.engine_core import EngineCore

    eos = tokenizer.eos_token_id if tokenizer else 2
    info = SimpleNamespace(max_model_len=max_model_len, vocab_size=50_000, eos_token_ids=(eos,),
                           generation_defaults={})
    return EngineCore("w1", Settings(), store, SimpleNamespace(info=info), tokenizer=tokenizer)


def step(engine, tokens: dict[str, int], pending=()):
    """One engine step with the model's sampled `tokens`: schedule, update, publish."""
    from worker.messages import StepResult

    engine._take_inbox(block=False)
    out = engine.workload_manager.schedule()
    engine.output.pending += list(pending)
    engine.output.update(out, StepResult(token_ids=tokens))
    engine.output.publish()
    return engine.output.pending


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def submit(store, seq_id: str, n_tokens: int = 3) -> None:
    store.create([SequenceRequest(seq_id=seq_id, prompt_token_ids=list(range(3, 3 + n_tokens)))])


# --- bug 5: every end is counted once --------------------------------------------------------
def test_prompt_rejected_at_admission_is_counted_as_error(store):
    engine = make_engine(store, max_model_len=8)
    submit(store, "long", n_tokens=20)
    assert engine.admit("long") is None
    assert store.get_job("long")["status"] == "failed"
    assert success(store) == {"error": 1}


@pytest.mark.parametrize("params", [{"stop_token_ids": [7, 50_000]},
                                    {"logit_bias": {-1: 1.0, 3: 2.0}}])
def test_token_ids_past_the_vocabulary_in_the_params_are_bad_input(store, params):
    """A stop token id past the vocabulary failed the sampler (with min_tokens: a 500) and a
    logit_bias id past it was dropped without a word; vLLM refuses both as bad input."""
    from common.protocol import SamplingParams

    engine = make_engine(store, max_model_len=64)
    store.create([SequenceRequest(seq_id="s", prompt_token_ids=[3, 4, 5],
                                  params=SamplingParams(min_tokens=2, **params))])
    assert engine.admit("s") is None
    job = store.get_job("s")
    assert job["status"] == "failed"
    assert job["error"]["code"] == "invalid_sampling_params"
    assert next(iter(params)) in job["error"]["message"]
    assert "50000" in job["error"]["message"] or "-1" in job["error"]["message"]


def test_cancel_of_a_queued_job_is_counted_once(store):
    submit(store, "q")
    store.request_cancel("q")
    store.request_cancel("q")   # a second cancel ends nothing, counts nothing
    assert store.get_job("q")["status"] == "cancelled"
    assert success(store) == {"cancelled": 1}


def test_engine_finish_is_counted_once_not_by_the_script_too(store):
    engine = make_engine(store)
    submit(store, "s")
    seq = engine.admit("s")
    engine._take_inbox(block=False)
    engine.output.abort(seq, FinishReason.CANCELLED)
    engine.output.publish()
    assert store.get_job("s")["status"] == "cancelled"
    assert success(store) == {"cancelled": 1}


# --- bug 9: one token event per generated token ----------------------------------------------
def test_the_eos_token_gets_its_token_event(store, tok):
    engine = make_engine(store, max_model_len=64, tokenizer=tok)
    submit(store, "s")
    seq = engine.admit("s")
    hello = tok.encode(" Hello", add_special_tokens=False)[0]
    assert step(engine, {"s": hello}) == []
    assert step(engine, {"s": tok.eos_token_id}) == []
    assert seq.done.is_set()
    events = store.read_events("s")
    assert [k for _, k, _ in events] == ["token", "token", "done"]
    assert [d["text"] for _, k, d in events if k == "token"] == [" Hello", ""]
    assert events[-1][2]["usage"]["completion_tokens"] == 2


# --- bug 1: a stale copy writes nothing ------------------------------------------------------
def test_restart_on_the_same_worker_drops_the_old_copys_pending_delta(store, tok):
    """Taken for dead and restarted here: the old copy's token, sampled before the new start
    arrived and not yet published, must not reach the record the new copy writes."""
    from worker.messages import StepResult

    engine = make_engine(store, max_model_len=64, tokenizer=tok)
    hello, world, hi = (tok.encode(w, add_special_tokens=False)[0]
                        for w in (" Hello", " world", " Hi"))
    submit(store, "s")
    engine.admit("s")
    step(engine, {"s": hello})
    out = engine.workload_manager.schedule()
    engine.output.update(out, StepResult(token_ids={"s": world}))
    stale, engine.output.pending = engine.output.pending, []   # not yet published
    assert store.reclaim("w1") == ["s"]       # taken for dead: queued again, with a reset
    assert engine.admit("s") is not None      # the record restarted here: attempt 2
    assert step(engine, {"s": hi}, pending=stale) == []
    events = store.read_events("s")
    kinds = [k for _, k, _ in events]
    assert kinds == ["token", "reset", "token"]
    assert events[-1][2]["text"] == " Hi"
    rec = store.get_record("s")
    assert (rec["text"], rec["completion_tokens"], rec["attempts"]) == (" Hi", "1", "2")
