"""EngineCore's edges on fakeredis, without a model process (issue 13, bugs 1, 5 and 9)."""
from __future__ import annotations

from types import SimpleNamespace

import fakeredis
import pytest

from common import metrics
from common.protocol import FinishReason, SequenceRequest
from common.settings import Settings
from common.store import SequenceStore

pytest.importorskip("lupa", reason="fakeredis needs lupa to run the store's Lua scripts")


@pytest.fixture
def store():
    return SequenceStore(fakeredis.FakeRedis(decode_responses=True))


def success(store) -> dict[str, float]:
    return metrics.read_snapshot(store.r)["success"]


def make_engine(store, max_model_len: int = 8):
    """An engine whose executor is only its model's description: admit() and the publish
    path never reach the model process."""
    from worker.engine_core import EngineCore

    info = SimpleNamespace(max_model_len=max_model_len, vocab_size=50, eos_token_ids=(2,),
                           generation_defaults={})
    return EngineCore("w1", Settings(), store, SimpleNamespace(info=info), tokenizer=None)


def submit(store, seq_id: str, n_tokens: int = 3) -> None:
    store.create([SequenceRequest(seq_id=seq_id, prompt_token_ids=list(range(3, 3 + n_tokens)))])


# --- bug 5: every end is counted once --------------------------------------------------------
def test_prompt_rejected_at_admission_is_counted_as_error(store):
    engine = make_engine(store, max_model_len=8)
    submit(store, "long", n_tokens=20)
    assert engine.admit("long") is None
    assert store.get_job("long")["status"] == "failed"
    assert success(store) == {"error": 1}


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
    engine.scheduler.add(engine.inbox.get_nowait())
    engine.scheduler.abort(seq, FinishReason.CANCELLED)
    engine._finish_many([seq])
    assert store.get_job("s")["status"] == "cancelled"
    assert success(store) == {"cancelled": 1}
