"""SequenceStore on fakeredis: records, the start/finish scripts, events, pub/sub, workers."""
from __future__ import annotations

import json
import time

import fakeredis
import pytest

from common.protocol import (EVENT_DONE, EVENT_RESET, EVENT_TOKEN, FinishReason, SamplingParams,
                             SequenceRequest, SequenceStatus)
from common.store import (CANCELLED_KEY, owner_streams_key, WORKERS_KEY, Finish, SequenceStore, TokenDelta, channel,
                          events_key, job_from_record, record_key, worker_key)


RESULT_TTL, PENDING_TTL = 300, 3000


@pytest.fixture
def r():
    return fakeredis.FakeRedis(decode_responses=True)


@pytest.fixture
def store(r):
    return SequenceStore(r, result_ttl_s=RESULT_TTL, pending_ttl_s=PENDING_TTL, stream_maxlen=1000)


def new(store, seq_id="seq-1", **kw):
    kw.setdefault("prompt", "Hello")
    return store.create([SequenceRequest(seq_id=seq_id, **kw)], model="m1")[0]


def kinds(events):
    return [k for _, k, _ in events]


class Subscriber:
    """A pub/sub subscription read without sleeping: fakeredis delivers synchronously."""

    def __init__(self, r, seq_id):
        self.p = r.pubsub()
        self.p.subscribe(channel(seq_id))
        self.p_channel = channel(seq_id)

    def messages(self):
        out = []
        while (m := self.p.get_message(timeout=0)) is not None:
            if m["type"] == "message":
                assert m["channel"] == self.p_channel
                out.append(json.loads(m["data"]))
        return out


# --- create ----------------------------------------------------------------------------------
def test_create_returns_queued_job_objects(store):
    before = time.time()
    jobs = store.create([SequenceRequest("a", prompt="Hi"),
                         SequenceRequest("b", messages=[{"role": "user", "content": "Yo"}])],
                        model="m1")
    assert [j["id"] for j in jobs] == ["a", "b"]
    a, b = jobs
    assert a["object"] == "job" and a["status"] == "queued"
    assert a["prompt"] == "Hi" and a["messages"] is None
    assert b["prompt"] is None and b["messages"] == [{"role": "user", "content": "Yo"}]
    assert a["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    assert a["text"] == "" and a["finish_reason"] is None and a["error"] is None
    assert a["model"] == "m1"
    assert before - 1 <= a["created_at"] <= time.time() + 1
    assert a["started_at"] is None and a["finished_at"] is None
    assert store.get_job("a") == a                   # what create returns is what get reads


def test_create_sets_pending_ttl_and_owner(store, r):
    new(store, "a", owner="o1", params=SamplingParams(max_tokens=3, stop=["x"]))
    assert 0 < r.ttl(record_key("a")) <= PENDING_TTL
    req = store.load_request("a")
    assert req.owner == "o1" and req.prompt == "Hello" and req.messages is None
    assert req.params == SamplingParams(max_tokens=3, stop=["x"])


def test_load_request_of_messages_and_missing(store):
    new(store, "a", prompt=None, messages=[{"role": "user", "content": "東京 🎉"}])
    req = store.load_request("a")
    assert req.prompt is None and req.messages == [{"role": "user", "content": "東京 🎉"}]
    assert store.load_request("nope") is None
    assert store.get_job("nope") is None


# --- start -----------------------------------------------------------------------------------
def test_start_queued_then_redelivered(store):
    new(store)
    assert store.start("seq-1", "w1") == ("queued", 1)
    job = store.get_job("seq-1")
    assert job["status"] == "running" and job["started_at"] is not None
    assert store.get_record("seq-1")["worker"] == "w1"
    assert store.read_events("seq-1") == []          # a first start emits nothing
    store.publish_deltas([TokenDelta("seq-1", "par", 1)])
    # The worker died; Celery redelivers: attempt 2, the partial text is dropped.
    assert store.start("seq-1", "w2") == ("running", 2)
    rec = store.get_record("seq-1")
    assert rec["text"] == "" and rec["completion_tokens"] == "0" and rec["worker"] == "w2"
    events = store.read_events("seq-1")
    assert kinds(events) == [EVENT_TOKEN, EVENT_RESET]
    assert events[-1][2] == {"attempt": 2, "reason": "worker lost"}


def test_start_of_finished_or_missing_does_not_run(store):
    new(store)
    store.start("seq-1", "w1")
    assert store.finish("seq-1", FinishReason.STOP, text="done")
    assert store.start("seq-1", "w1") == ("succeeded", 0)
    assert store.get_job("seq-1")["status"] == "succeeded"
    assert store.start("missing", "w1") == ("missing", 0)
    assert store.get_record("missing") is None       # start must not create a record


def test_start_of_cancelled_does_not_run(store):
    new(store)
    store.request_cancel("seq-1")
    assert store.start("seq-1", "w1") == ("cancelled", 0)


# --- finish ----------------------------------------------------------------------------------
def test_finish_only_once_and_done_event_is_final_job(store, r):
    new(store)
    store.start("seq-1", "w1")
    store.set_prompt_tokens("seq-1", 5)
    sub = Subscriber(r, "seq-1")
    assert store.finish("seq-1", FinishReason.LENGTH, text="hello world", completion_tokens=2)
    assert not store.finish("seq-1", FinishReason.ERROR, error="again")
    job = store.get_job("seq-1")
    assert job["status"] == "succeeded" and job["finish_reason"] == "length"
    assert job["text"] == "hello world" and job["error"] is None
    assert job["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert job["finished_at"] >= job["started_at"] >= job["created_at"]
    events = store.read_events("seq-1")
    assert kinds(events) == [EVENT_DONE]             # exactly one done event
    assert events[0][2] == job
    assert sub.messages() == [{"done": True, "job": job}]


def test_finish_sets_result_ttl(store, r):
    new(store)
    store.start("seq-1", "w1")
    store.publish_deltas([TokenDelta("seq-1", "x", 1)])
    assert r.ttl(events_key("seq-1")) > RESULT_TTL   # still the pending TTL while running
    store.finish("seq-1", FinishReason.STOP, text="x", completion_tokens=1)
    assert 0 < r.ttl(record_key("seq-1")) <= RESULT_TTL
    assert 0 < r.ttl(events_key("seq-1")) <= RESULT_TTL


def test_finish_with_error_fails_the_job(store):
    new(store)
    store.start("seq-1", "w1")
    assert store.finish("seq-1", FinishReason.ERROR, error="CUDA out of memory", text="")
    job = store.get_job("seq-1")
    assert job["status"] == "failed" and job["error"] == {"message": "CUDA out of memory"}


def test_finish_only_if_running_skips_queued(store):
    new(store)
    assert not store.finish("seq-1", FinishReason.STOP, only_if=(SequenceStatus.RUNNING,))
    assert store.get_job("seq-1")["status"] == "queued"
    assert store.read_events("seq-1") == []


def test_finish_missing_returns_false(store):
    assert store.finish("nope", FinishReason.STOP) is False


def test_finish_many_ends_each_in_order_and_reports_which_were_written(store, r):
    for i in range(4):
        new(store, f"s{i}")
    for i in range(3):
        store.start(f"s{i}", "w1")
    store.finish("s1", FinishReason.CANCELLED)   # already over: refused below
    subs = [Subscriber(r, f"s{i}") for i in range(4)]
    written = store.finish_many([
        Finish("s0", FinishReason.LENGTH, text="a", completion_tokens=1, cached_tokens=8,
               only_if=(SequenceStatus.RUNNING,), attempt=1),
        Finish("s1", FinishReason.LENGTH, text="b", completion_tokens=1),
        Finish("missing", FinishReason.STOP),
        Finish("s2", FinishReason.ERROR, error="boom", attempt=2),    # not this start
        Finish("s3", FinishReason.STOP, text="d", completion_tokens=1,
               only_if=(SequenceStatus.RUNNING,)),                  # still queued
    ])
    assert written == [True, False, False, False, False]
    assert store.get_job("s0")["text"] == "a" and store.get_job("s0")["status"] == "succeeded"
    assert store.get_job("s0")["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    assert store.get_job("s1")["status"] == "cancelled"
    assert [store.get_job(f"s{i}")["status"] for i in (2, 3)] == ["running", "queued"]
    assert kinds(store.read_events("s0")) == [EVENT_DONE]
    assert [len(s.messages()) for s in subs] == [1, 0, 0, 0]   # only the one written
    assert store.finish_many([]) == []


# --- cancel ----------------------------------------------------------------------------------
def test_cancel_queued_finishes_it(store, r):
    new(store)
    sub = Subscriber(r, "seq-1")
    store.request_cancel("seq-1")
    job = store.get_job("seq-1")
    assert job["status"] == "cancelled" and job["finish_reason"] == "cancelled"
    assert kinds(store.read_events("seq-1")) == [EVENT_DONE]
    assert sub.messages()[0]["job"]["status"] == "cancelled"
    assert store.cancelled_among(["seq-1"]) == set()   # nobody has to act on it any more
    assert not r.sismember(CANCELLED_KEY, "seq-1")


def test_cancel_running_only_flags_it(store):
    new(store, "a")
    new(store, "b")
    store.start("a", "w1")
    store.start("b", "w1")
    store.request_cancel("a")
    assert store.get_job("a")["status"] == "running"
    assert store.read_events("a") == []
    assert store.cancelled_among(["a", "b"]) == {"a"}
    assert store.cancelled_among([]) == set()
    # The engine finishes it, which also clears the flag.
    assert store.finish("a", FinishReason.CANCELLED, text="", completion_tokens=0,
                        only_if=(SequenceStatus.RUNNING,))
    assert store.get_job("a")["status"] == "cancelled"
    assert store.cancelled_among(["a", "b"]) == set()


def test_cancel_finished_leaves_it_alone_and_no_flag_behind(store, r):
    new(store)
    store.start("seq-1", "w1")
    store.finish("seq-1", FinishReason.STOP, text="ok")
    store.request_cancel("seq-1")
    assert store.get_job("seq-1")["status"] == "succeeded"
    assert kinds(store.read_events("seq-1")) == [EVENT_DONE]
    # Nothing will ever finish it again, so a flag left here would never be removed.
    assert not r.sismember(CANCELLED_KEY, "seq-1")


# --- events ----------------------------------------------------------------------------------
def test_publish_deltas_appends_tokens_and_updates_text(store, r):
    new(store, "a")
    new(store, "b")
    store.start("a", "w")
    store.start("b", "w")
    sub = Subscriber(r, "a")
    store.publish_deltas([TokenDelta("a", "Hel", 1), TokenDelta("b", "", 1)])
    store.publish_deltas([TokenDelta("a", "lo 🎉", 3)])
    assert [(k, d) for _, k, d in store.read_events("a")] == [
        (EVENT_TOKEN, {"text": "Hel"}), (EVENT_TOKEN, {"text": "lo 🎉"})]
    # A token without text (special, or half a character) is still an event, as in vLLM's
    # stream: a client sees the first token when it is made.
    assert [(k, d) for _, k, d in store.read_events("b")] == [(EVENT_TOKEN, {"text": ""})]
    assert store.get_record("b")["completion_tokens"] == "1"
    job = store.get_job("a")
    assert job["text"] == "Hello 🎉" and job["usage"]["completion_tokens"] == 3
    assert sub.messages() == [{"text": "Hel"}, {"text": "lo 🎉"}]
    assert sub.p_channel == "llmq:tokens:a"
    assert 0 < r.ttl(events_key("a")) <= PENDING_TTL


def test_publish_nothing_is_a_no_op(store, r):
    store.publish_deltas([])
    assert r.keys("*") == []


def test_read_events_after_an_id_returns_exactly_the_later_ones(store):
    new(store)
    store.start("seq-1", "w")
    for i in range(5):
        store.publish_deltas([TokenDelta("seq-1", f"t{i}", i + 1)])
    store.finish("seq-1", FinishReason.STOP, text="t0t1t2t3t4")
    events = store.read_events("seq-1")
    assert kinds(events) == [EVENT_TOKEN] * 5 + [EVENT_DONE]
    ids = [e for e, _, _ in events]
    assert len(set(ids)) == 6
    for i, entry_id in enumerate(ids):
        assert store.read_events("seq-1", after=entry_id) == events[i + 1:]
    assert store.read_events("seq-1", after="0-0", count=2) == events[:2]
    assert store.read_events("seq-1", after=ids[-1], block_ms=None) == []


def test_read_events_of_unknown_sequence_is_empty(store):
    assert store.read_events("nope") == []


# --- job_from_record -------------------------------------------------------------------------
def test_job_from_record_tolerates_missing_fields():
    job = job_from_record({"id": "x"})
    assert job["id"] == "x" and job["status"] is None and job["text"] == ""
    assert job["usage"]["total_tokens"] == 0 and job["created_at"] is None


# --- workers ---------------------------------------------------------------------------------
def test_heartbeat_and_live_workers(store, r):
    assert store.live_workers(10) == []
    store.heartbeat("w1@h", {"model_loaded": 1, "device": "cpu"}, 10)
    store.heartbeat("w2@h", {"model_loaded": 0}, 10)
    live = sorted(store.live_workers(10), key=lambda w: w["name"])
    assert live == [{"model_loaded": "1", "device": "cpu", "name": "w1@h"},
                    {"model_loaded": "0", "name": "w2@h"}]
    assert 0 < r.ttl(worker_key("w1@h")) <= 10


def test_stale_and_removed_workers_are_not_live(store, r):
    store.heartbeat("old", {"model_loaded": 1}, 10)
    r.zadd(WORKERS_KEY, {"old": time.time() - 100})    # its last heartbeat was long ago
    store.heartbeat("new", {"model_loaded": 1}, 10)
    assert [w["name"] for w in store.live_workers(15)] == ["new"]
    store.remove_worker("new")
    assert store.live_workers(15) == []
    assert not r.exists(worker_key("new"))


def test_worker_whose_info_expired_is_not_live(store, r):
    store.heartbeat("w", {"model_loaded": 1}, 10)
    r.delete(worker_key("w"))                          # what the TTL does
    assert store.live_workers(15) == []


def test_from_settings_uses_the_settings_ttls(r):
    from common.settings import Settings

    s = SequenceStore.from_settings(Settings(result_ttl_s=11, pending_ttl_s=22,
                                             stream_maxlen=33), client=r)
    assert (s.result_ttl_s, s.pending_ttl_s, s.stream_maxlen, s.r) == (11, 22, 33, r)


def test_cancel_unknown_sequence_leaves_no_flag(store, r):
    store.request_cancel("nope")
    assert store.get_record("nope") is None
    assert not r.sismember(CANCELLED_KEY, "nope")


# --- worker ownership: late redelivery and reclaiming a dead worker's sequences ------------------
def test_start_while_another_live_worker_runs_it_does_not_run(store):
    new(store)
    store.heartbeat("w1", {"model_loaded": 1}, 10)
    assert store.start("seq-1", "w1") == ("queued", 1)
    # A late redelivery to w2 while w1 is alive: w2 must not run it twice.
    assert store.start("seq-1", "w2", stale_s=15) == ("running-elsewhere", 0)
    rec = store.get_record("seq-1")
    assert (rec["worker"], rec["attempts"]) == ("w1", "1")
    assert store.read_events("seq-1") == []
    # Once w1 is stale, w2 may take it over.
    store.r.zadd(WORKERS_KEY, {"w1": time.time() - 100})
    assert store.start("seq-1", "w2", stale_s=15) == ("running", 2)


def test_reclaim_dead_worker_puts_its_sequences_back_once(store, r):
    from common.store import running_key

    new(store, "a")
    new(store, "b")
    new(store, "c")
    store.heartbeat("w1", {"model_loaded": 1}, 10)
    for s in ("a", "b", "c"):
        store.start(s, "w1")
    store.publish_deltas([TokenDelta("a", "partial", 1)])
    store.finish("c", FinishReason.STOP, text="done")      # finished: not reclaimed
    assert r.smembers(running_key("w1")) == {"a", "b"}
    assert store.reclaim("w1", stale_s=15) == []           # alive: nothing taken
    r.zadd(WORKERS_KEY, {"w1": time.time() - 100})
    assert store.stale_workers(15) == ["w1"]
    sub = Subscriber(r, "a")
    assert sorted(store.reclaim("w1", stale_s=15)) == ["a", "b"]
    assert store.reclaim("w1", stale_s=15) == []           # only one reclaimer wins
    job = store.get_job("a")
    assert job["status"] == "queued" and job["text"] == ""
    assert job["usage"]["completion_tokens"] == 0
    assert kinds(store.read_events("a")) == [EVENT_TOKEN, EVENT_RESET]
    # The same payload as a start's reset: the run to come, and why (issue 13, bug 9).
    assert store.read_events("a")[-1][2] == {"attempt": 2, "reason": "worker lost"}
    assert sub.messages() == [{"reset": True, "attempt": 2, "reason": "worker lost"}]
    assert store.get_job("c")["status"] == "succeeded"
    assert not r.exists(running_key("w1"))
    assert store.start("a", "w2") == ("queued", 2)          # runs again elsewhere


def test_reclaim_own_previous_life_is_forced(store):
    new(store)
    store.heartbeat("w1", {"model_loaded": 1}, 10)
    store.start("seq-1", "w1")
    assert store.reclaim("w1") == ["seq-1"]                 # no staleness check
    assert store.get_job("seq-1")["status"] == "queued"


def test_reset_payload_is_the_same_on_the_stream_and_pubsub(store, r):
    """Every reset says which run comes next and why, wherever it is read (issue 13, bug 9)."""
    new(store)
    store.start("seq-1", "w1")
    sub = Subscriber(r, "seq-1")
    store.start("seq-1", "w1")                              # restarted in place: attempt 2
    store.reclaim("w1", held=False, reason="handed back")   # handed back: attempt 3 comes next
    resets = [d for _, k, d in store.read_events("seq-1") if k == EVENT_RESET]
    assert resets == [{"attempt": 2, "reason": "worker lost"},
                      {"attempt": 3, "reason": "handed back"}]
    assert sub.messages() == [{"reset": True, **d} for d in resets]


def test_finish_removes_from_the_workers_running_set(store, r):
    from common.store import running_key

    new(store)
    store.start("seq-1", "w1")
    assert r.sismember(running_key("w1"), "seq-1")
    store.finish("seq-1", FinishReason.STOP, text="")
    assert not r.sismember(running_key("w1"), "seq-1")


def test_queue_depth_counts_every_priority_list(store, r):
    from common.store import PRIORITY_SEP

    assert store.queue_depth("llmq") == 0
    r.rpush("llmq", "m1", "m2")
    r.rpush(f"llmq{PRIORITY_SEP}3", "m3")
    r.rpush("other", "x")
    assert store.queue_depth("llmq") == 3


def test_reserve_usage_charges_until_a_limit_and_charges_nothing_refused(store, r):
    assert store.reserve_usage("o", 2, 100, 3, 0)[0] == ""
    hit, retry_after, key = store.reserve_usage("o", 2, 1, 3, 0)   # 4 sequences > 3
    assert hit == "rpm" and 1 <= retry_after <= 61
    assert store.reserve_usage("o", 1, 100, 3, 150)[0] == "tpm"   # 200 tokens > 150
    assert r.hgetall(key) == {"seqs": "2", "tokens": "100"}       # refused: not charged
    assert store.reserve_usage("other", 3, 150, 3, 150)[0] == ""  # windows are per owner
    assert 0 < r.ttl(key) <= 120


def test_reserved_tokens_count_max_tokens_and_the_prompt():
    from common.store import reserved_tokens

    req = SequenceRequest(seq_id="a", prompt="x" * 8001, params=SamplingParams(max_tokens=1))
    assert reserved_tokens(req) == 1 + 2001                       # a token per 4 bytes
    chat = SequenceRequest(seq_id="b", messages=[{"role": "user", "content": "abcd"}],
                           params=SamplingParams(max_tokens=10))
    assert reserved_tokens(chat) == 11


def test_finish_settles_the_token_reservation_with_the_real_counts(store, r):
    _hit, _ra, key = store.reserve_usage("o", 1, 500, 0, 1000)
    store.create([SequenceRequest(seq_id="seq-1", prompt="Hello", owner="o",
                                  params=SamplingParams(max_tokens=498))], charged_to=key)
    assert r.hget(record_key("seq-1"), "reserved_tokens") == "500"
    store.start("seq-1", "w1")
    store.set_prompt_tokens("seq-1", 7)
    store.finish("seq-1", FinishReason.STOP, text="hi", completion_tokens=3)
    assert r.hget(key, "tokens") == "10"                          # 7 prompt + 3 completion


def test_unfinished_of_counts_a_keys_queued_and_running_sequences(store):
    for i in range(3):
        store.create([SequenceRequest(seq_id=f"seq-{i}", prompt="x", owner="o")])
    store.create([SequenceRequest(seq_id="seq-x", prompt="x", owner="p")])
    assert store.unfinished_of("o") == 3
    store.start("seq-0", "w1")
    assert store.unfinished_of("o") == 3                          # running still counts
    store.finish("seq-0", FinishReason.STOP, text="", completion_tokens=0)
    store.request_cancel("seq-1")                                 # ended while queued
    assert store.unfinished_of("o") == 1 and store.unfinished_of("p") == 1


def test_stream_slots_cap_a_key_and_free_on_close_or_lease_end(store, r):
    tokens = [store.open_stream("o", 2, 30) for _ in range(2)]
    assert all(tokens) and store.open_stream("o", 2, 30) is None
    assert store.open_stream("p", 2, 30)                          # another key's own slots
    store.close_stream("o", tokens[0])
    assert store.open_stream("o", 2, 30)
    # An API process that died leaves leases that run out: they stop counting.
    r.zadd(owner_streams_key("q"), {"dead1": time.time() - 1, "dead2": time.time() - 1})
    assert store.open_stream("q", 2, 30)


def test_ids_are_checked_by_shape():
    from common.store import is_seq_id, valid_stream_id

    assert is_seq_id("seq-" + "0a" * 16)
    for bad in ["seq-" + "0" * 31, "seq-" + "0" * 32 + ":events", "seq-" + "0" * 32 + "\n",
                "seq-" + "G" * 32, "x"]:
        assert not is_seq_id(bad), bad
    assert valid_stream_id("1700000000000-0") and valid_stream_id(f"{2**64 - 1}-{2**64 - 1}")
    for bad in ["1-0\n", "1-", "-0", "1", f"{2**64}-0", "1" * 23 + "-0", "١-0", "1-0 "]:
        assert not valid_stream_id(bad), bad


def test_reclaim_takes_back_held_messages_never_started_once_each(store, r):
    """A message the dead worker received but never started: its record is still queued, so
    the reaper sends it again; one it held and started comes back once, not twice."""
    from common.store import held_key, running_key

    for s in ("held", "started", "done", "elsewhere"):
        new(store, s)
        store.hold("w1", s)
    store.heartbeat("w1", {"model_loaded": 1}, 10)
    store.heartbeat("w2", {"model_loaded": 1}, 10)
    store.start("started", "w1")
    store.start("done", "w1")
    store.finish("done", FinishReason.STOP, text="")
    store.start("elsewhere", "w2")                           # a duplicate message ran there
    assert store.running_ids("w1") == {"held", "started", "elsewhere", "done"}
    r.zadd(WORKERS_KEY, {"w1": time.time() - 100})
    assert sorted(store.reclaim("w1", stale_s=15)) == ["held", "started"]
    assert store.get_job("held")["status"] == "queued"
    assert kinds(store.read_events("held")) == []            # it never ran: no reset
    assert not r.exists(held_key("w1")) and not r.exists(running_key("w1"))
    assert store.running_ids("w1") == set()


def test_hand_back_leaves_held_messages_to_their_tasks(store, r):
    from common.store import held_key

    new(store, "a")
    new(store, "b")
    store.hold("w1", "a")
    store.hold("w1", "b")
    store.start("a", "w1")
    # Handing back at shutdown: the running one is queued again; both stay held until their
    # tasks return, so that a peer still finds them if this worker dies first.
    assert store.reclaim("w1", held=False) == ["a"]
    assert r.smembers(held_key("w1")) == {"a", "b"}
    store.release("w1", "a")
    assert store.running_ids("w1") == {"b"}


def test_publish_step_writes_fenced_tokens_and_reports_cancels_even_after_a_script_flush(
        store, r):
    """The engine's per-step write and cancel look share one pipeline (EVALSHA, not the
    Script object); a Redis that lost its scripts (restarted) still gets the tokens written,
    the stale attempt refused and the cancels reported."""
    for sid in ("a", "b"):
        new(store, sid)
    _, attempt_a = store.start("a", "w1")
    _, attempt_b = store.start("b", "w1")
    store.request_cancel("b")
    # never loaded, then loaded by the first call, then flushed
    for n, flush in ((1, False), (2, False), (3, True)):
        if flush:
            r.script_flush()
        refused, cancelled = store.publish_step(
            [TokenDelta("a", "x", n, attempt_a),
             TokenDelta("b", "y", n, attempt_b + 1)],   # not b's start: refused
            ["a", "b"])
        assert (refused, cancelled) == ([1], {"b"})
        assert store.get_job("a")["text"] == "x" * n
        assert kinds(store.read_events("a")) == [EVENT_TOKEN] * n
        assert store.read_events("b") == []
    assert store.publish_step([], []) == ([], set())
    assert store.publish_step([], ["a"]) == ([], set())
