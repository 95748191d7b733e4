"""A running sequence's text on fakeredis (the real Lua scripts): each step APPENDs its new text
to the running text key, readers see it while the sequence runs, and the finish script writes
the whole text into the record once. Every guarantee of the per-step write holds for it:
fencing on the attempt, reset on a new start, TTLs, the stream and the record agreeing; and
what a step sends does not grow with the length."""
from __future__ import annotations

import time

import fakeredis
import pytest

from common.keys import Keys
from common.protocol import EVENT_TOKEN, FinishReason, SequenceRequest, SequenceStatus
from common.store import WORKERS_KEY, Finish, SequenceStore, TokenDelta

PENDING_TTL, RESULT_TTL = 3000, 300


@pytest.fixture
def store():
    return SequenceStore(fakeredis.FakeRedis(decode_responses=True), result_ttl_s=RESULT_TTL,
                         pending_ttl_s=PENDING_TTL)


def started(store, seq_id="s1", worker="w1") -> int:
    store.create([SequenceRequest(seq_id=seq_id, prompt="hi")])
    return store.start(seq_id, worker)[1]


def streamed(store, seq_id="s1") -> str:
    """The token events' text since the last reset: what a stream reader has."""
    text = ""
    for _i, kind, data in store.read_events(seq_id, count=1_000_000):
        text = "" if kind == "reset" else text + data["text"] if kind == EVENT_TOKEN else text
    return text


def test_readers_see_the_running_text_which_the_record_holds_only_at_the_end(store):
    a = started(store)
    store.publish_deltas([TokenDelta("s1", "Bon", 1, a)])
    store.publish_deltas([TokenDelta("s1", "jour ", 2, a), TokenDelta("s1", "🎉", 3, a)])
    assert store.r.hget(Keys.record("s1"), "text") == ""      # no step rewrote the record
    assert store.r.get(Keys.running_text("s1")) == "Bonjour 🎉"
    assert store.get_job("s1")["text"] == "Bonjour 🎉" == streamed(store)
    recs = store.get_records(["s1", "missing"])
    assert recs[0]["text"] == "Bonjour 🎉" and recs[1] == {}
    assert store.get_records(["s1"], text=False)[0]["status"] == "running"   # status readers
    assert store.finish("s1", FinishReason.LENGTH, text="Bonjour 🎉", completion_tokens=3,
                        only_if=(SequenceStatus.RUNNING,), attempt=a)
    assert store.r.exists(Keys.running_text("s1")) == 0
    assert store.r.hget(Keys.record("s1"), "text") == "Bonjour 🎉"
    assert store.get_job("s1")["text"] == "Bonjour 🎉"
    assert store.read_events("s1")[-1][2]["text"] == "Bonjour 🎉"   # the done event's job


def test_an_end_without_text_moves_the_running_text_into_the_record(store):
    a = started(store)
    store.publish_deltas([TokenDelta("s1", "partial", 1, a)])
    [done] = store.finish_many([Finish("s1", FinishReason.CANCELLED, attempt=a)])
    assert done and store.r.exists(Keys.running_text("s1")) == 0
    assert store.get_job("s1")["text"] == "partial" == store.read_events("s1")[-1][2]["text"]


def test_a_stale_attempts_append_is_refused(store):
    store.r.zadd(WORKERS_KEY, {"w1": time.time() - 100})   # w1 went silent
    first = started(store)
    store.publish_deltas([TokenDelta("s1", "old", 1, first)])
    assert store.reclaim("w1", stale_s=15) == ["s1"]
    second = store.start("s1", "w2")[1]
    store.publish_deltas([TokenDelta("s1", "new", 1, second)])
    assert store.publish_deltas([TokenDelta("s1", " late", 2, first)]) == [0]
    assert store.get_job("s1")["text"] == "new" == streamed(store)


def test_a_retried_step_is_not_appended_twice(store):
    a = started(store)
    step = [TokenDelta("s1", "He", 1, a), TokenDelta("s1", "llo", 2, a)]
    store.publish_deltas(step)
    store.publish_deltas(step)   # its reply was lost: sent again
    assert store.get_job("s1")["text"] == "Hello" == streamed(store)


@pytest.mark.parametrize("how", ["redelivered", "reclaimed"])
def test_a_new_start_clears_the_running_text(store, how):
    store.r.zadd(WORKERS_KEY, {"w1": time.time() - 100})
    a = started(store)
    store.publish_deltas([TokenDelta("s1", "first run", 1, a)])
    if how == "reclaimed":
        store.reclaim("w1", stale_s=15)
        assert store.get_job("s1")["text"] == ""
    assert store.start("s1", "w2")[1] == a + 1
    assert store.r.exists(Keys.running_text("s1")) == 0
    assert store.get_job("s1")["text"] == "" == streamed(store)
    store.publish_deltas([TokenDelta("s1", "again", 1, a + 1)])
    assert store.get_job("s1")["text"] == "again" == streamed(store)


def test_the_running_text_has_the_pending_ttl_and_goes_at_the_end(store):
    a = started(store)
    store.publish_deltas([TokenDelta("s1", "", 1, a)])   # no text yet: no key either
    assert store.r.exists(Keys.running_text("s1")) == 0
    store.publish_deltas([TokenDelta("s1", "x", 2, a)])
    assert RESULT_TTL < store.r.ttl(Keys.running_text("s1")) <= PENDING_TTL
    store.publish_deltas([TokenDelta("s1", "y", 3, a)])
    assert RESULT_TTL < store.r.ttl(Keys.running_text("s1")) <= PENDING_TTL
    store.finish("s1", FinishReason.STOP, text="xy", completion_tokens=3, attempt=a)
    assert store.r.exists(Keys.running_text("s1")) == 0
    assert 0 < store.r.ttl(Keys.record("s1")) <= RESULT_TTL


def test_an_unfenced_write_appends_too(store):
    started(store)
    store.publish_deltas([TokenDelta("s1", "a", 1), TokenDelta("s1", "b", 2)])
    assert store.get_job("s1")["text"] == "ab"
    assert 0 < store.r.ttl(Keys.running_text("s1")) <= PENDING_TTL


def _bytes_sent(store, monkeypatch) -> list[int]:
    """The bytes of the arguments of every pipeline store.r sends, one entry per execute."""
    sent: list[int] = []
    make = store.r.pipeline

    def pipeline(*a, **kw):
        pipe = make(*a, **kw)
        execute = pipe.execute

        def counted(*ea, **ekw):
            sent.append(sum(len(str(x).encode()) for args, _o in pipe.command_stack
                            for x in args))
            return execute(*ea, **ekw)

        pipe.execute = counted
        return pipe

    monkeypatch.setattr(store.r, "pipeline", pipeline)
    return sent


def test_what_a_step_sends_does_not_grow_with_the_length(store, monkeypatch):
    """8 sequences, 1,000 steps of a 16-character token each: the step that writes the
    1,000th tokens sends what the 100th did (the token counts' extra digit aside)."""
    ids = [f"s{i}" for i in range(8)]
    attempts = {s: started(store, s) for s in ids}
    sent = _bytes_sent(store, monkeypatch)
    piece = " a long-ish word"
    for n in range(1, 1001):
        store.publish_step([TokenDelta(s, piece, n, attempts[s]) for s in ids], ids)
    at_100, at_1000 = sent[99], sent[999]
    assert at_1000 <= at_100 + len(ids) * 2 * 1, (at_100, at_1000)
    assert store.get_job("s7")["text"] == piece * 1000 == streamed(store, "s7")
