"""The store's guards that make at-least-once delivery safe, checked directly on fakeredis (with
the real Lua scripts): what the fault tests rely on, in milliseconds.

- start guard: a late redelivery of a finished sequence, or of one a live worker runs, is not
  run again;
- fencing: a worker's tokens and result are written only while the record still runs the
  attempt (start) that produced them, so a worker taken for dead cannot write into a record
  that was handed back or restarted meanwhile;
- idempotent publishing: a batch of deltas retried after its reply was lost is not appended
  twice.
"""
from __future__ import annotations

import time

import fakeredis
import pytest

from common.protocol import FinishReason, SamplingParams, SequenceRequest, SequenceStatus
from common.store import WORKERS_KEY, SequenceStore, TokenDelta


@pytest.fixture
def store():
    return SequenceStore(fakeredis.FakeRedis(decode_responses=True))


def _new(store, seq_id="s1"):
    store.create([SequenceRequest(seq_id=seq_id, prompt="hi", params=SamplingParams())])


def _kinds(store, seq_id="s1"):
    return [k for _i, k, _d in store.read_events(seq_id)]


def test_late_redelivery_is_skipped(store):
    _new(store)
    store.heartbeat("w1", {"model_loaded": 1}, ttl_s=60)
    assert store.start("s1", "w1") == ("queued", 1)
    # w1 is alive: a duplicate message reaching w2 does not start it a second time.
    assert store.start("s1", "w2", stale_s=15) == ("running-elsewhere", 0)
    assert store.finish("s1", FinishReason.LENGTH, text="ok", completion_tokens=1, attempt=1)
    # Finished: a redelivery hours later (visibility timeout) does nothing.
    assert store.start("s1", "w2")[1] == 0
    assert _kinds(store) == ["done"]


def test_a_reaped_workers_late_tokens_and_result_are_refused(store):
    _new(store)
    store.r.zadd(WORKERS_KEY, {"w1": time.time() - 100})      # w1 went silent long ago
    assert store.start("s1", "w1")[1] == 1
    assert store.publish_deltas([TokenDelta("s1", "a", 1, attempt=1)]) == []
    assert store.reclaim("w1", stale_s=15) == ["s1"]           # another worker takes it back
    assert store.start("s1", "w2") == ("queued", 2)            # ... and starts it again
    assert store.publish_deltas([TokenDelta("s1", "x", 1, attempt=2)]) == []
    # w1 wakes up: its next step and its result are refused, w2's record is untouched.
    refused = store.publish_deltas([TokenDelta("s1", "b", 2, attempt=1),
                                    TokenDelta("s1", "y", 2, attempt=2)])
    assert refused == [0]
    assert not store.finish("s1", FinishReason.LENGTH, text="ab", completion_tokens=2,
                            only_if=(SequenceStatus.RUNNING,), attempt=1)
    rec = store.get_record("s1")
    assert rec["status"] == "running" and rec["text"] == "xy" and rec["worker"] == "w2"
    assert store.finish("s1", FinishReason.LENGTH, text="xy", completion_tokens=2,
                        only_if=(SequenceStatus.RUNNING,), attempt=2)
    events = store.read_events("s1")
    assert [k for _i, k, _d in events] == ["token", "reset", "token", "token", "done"]
    after_reset = [d["text"] for _i, k, d in events[2:] if k == "token"]
    assert "".join(after_reset) == events[-1][2]["text"] == "xy"


def test_a_retried_batch_of_deltas_is_not_appended_twice(store):
    _new(store)
    store.start("s1", "w1")
    batch = [TokenDelta("s1", "He", 1, attempt=1),
             TokenDelta("s1", "llo", 2, attempt=1)]
    assert store.publish_deltas(batch) == []
    assert store.publish_deltas(batch) == []                   # the reply was lost: again
    assert store.publish_deltas([TokenDelta("s1", "!", 3, attempt=1)]) == []
    texts = [d["text"] for _i, k, d in store.read_events("s1") if k == "token"]
    assert texts == ["He", "llo", "!"]
    rec = store.get_record("s1")
    assert rec["text"] == "Hello!" and rec["completion_tokens"] == "3"
