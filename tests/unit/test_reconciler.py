"""The unstarted index (written by the admission, start, finish and reclaim scripts) and the
reconciler's decisions (common/reconcile_store.py, worker/reconciler.py): a sequence still
`queued` with no message anywhere is sent again, once, whichever workers look at the same time;
one whose message waits in a list, was delivered lately or is held is left alone; kombu's
`unacked` is cleared of ended sequences' messages. fakeredis for Redis; the broker's messages
are the ones Celery builds (through kombu's memory transport), as kombu's Redis transport
writes them (kombu's JSON of the same dict)."""
from __future__ import annotations

import json
import time

import fakeredis
import kombu.transport.redis
import pytest
from celery import Celery
from kombu.utils.json import dumps

from common.keys import Keys
from common.llm_engine import new_seq_id
from common.protocol import GENERATE_TASK, FinishReason, SamplingParams, SequenceRequest
from common.reconcile_store import ReconcileStore
from common.store import SequenceStore, queue_lists
from worker.reconciler import Reconciler

from .factories import make_settings

QUEUE = "llmq"
LOST_AFTER_S = 15.0


@pytest.fixture
def r():
    return fakeredis.FakeRedis(decode_responses=True)


@pytest.fixture
def store(r):
    return SequenceStore(r, pending_ttl_s=3000)


@pytest.fixture
def recon(store):
    return store.beside(ReconcileStore, queue_lists(QUEUE))


def celery_message(seq_id: str, priority: int | None = None, task: str = GENERATE_TASK) -> str:
    """The message Celery sends for a task, as kombu's Redis transport stores it."""
    app = Celery("probe", broker="memory://")
    app.send_task(task, args=[seq_id], task_id=seq_id, queue=QUEUE, priority=priority)
    with app.connection() as conn:
        return dumps(conn.default_channel._get(QUEUE))


def accept(store, *seq_ids: str, priority: int | None = None, at: float | None = None) -> None:
    """What LLMEngine.submit writes before it sends the messages: admission, then records.
    `at`: when (the index's time), to age an admission."""
    assert store.admit(QUEUE, list(seq_ids), "", 1000, 0)[0] == "ok"
    store.create([SequenceRequest(seq_id=s, prompt="x", params=SamplingParams(),
                                  priority=priority) for s in seq_ids])
    store.sent(list(seq_ids))
    if at is not None:
        store.r.zadd(Keys.unstarted, {s: at for s in seq_ids})


def old() -> float:
    return time.time() - LOST_AFTER_S - 1


def deliver(r, message: str, at: float) -> str:
    """A consumer's delivery, as kombu writes it: the message in `unacked`, its time in
    `unacked_index`."""
    tag = json.loads(message)["properties"]["delivery_tag"]
    r.hset(Keys.kombu_unacked, tag, json.dumps([json.loads(message), "", QUEUE]))
    r.zadd(Keys.kombu_unacked_index, {tag: at})
    return tag


# --- the index ----------------------------------------------------------------------------------
def test_admission_enters_the_index_and_start_or_end_leaves_it(store, recon):
    accept(store, "seq-a", "seq-b", "seq-c")
    assert set(recon.unstarted()) == {"seq-a", "seq-b", "seq-c"}
    store.start("seq-a", "w1")
    store.request_cancel("seq-b")                       # ended while queued
    assert set(recon.unstarted()) == {"seq-c"}
    store.finish("seq-a", FinishReason.LENGTH)
    assert set(recon.unstarted()) == {"seq-c"}


def test_a_refused_or_taken_back_admission_leaves_nothing_in_the_index(store, recon):
    assert store.admit(QUEUE, ["seq-a"], "", 0, 0)[0] == "queue"   # the queue is full
    assert store.admit(QUEUE, ["seq-b"], "", 10, 0)[0] == "ok"
    store.unadmit(["seq-b"], "")                        # a later check refused it
    assert recon.unstarted() == {}


def test_a_sequence_taken_back_from_a_dead_worker_enters_the_index_again(store, recon):
    accept(store, "seq-a")
    store.start("seq-a", "dead")
    assert recon.unstarted() == {}
    before = time.time()
    assert store.reclaim("dead", sender="w1") == ["seq-a"]
    assert recon.unstarted()["seq-a"] >= before          # its new message is watched too


# --- what is lost, what is not ------------------------------------------------------------------
def test_a_queued_sequence_with_no_message_anywhere_is_claimed_once_at_its_priority(store, recon):
    accept(store, "seq-lost", priority=4, at=old())
    accept(store, "seq-young", priority=4)               # admitted just now: not yet
    assert recon.claim_lost(LOST_AFTER_S) == [("seq-lost", 4)]
    # Claimed: another worker looking at the same moment (or the next pass) does not get it;
    # once the claim is as old as the cutoff (the re-send failed, or it was lost again) it does.
    assert recon.claim_lost(LOST_AFTER_S) == []
    store.r.zadd(Keys.unstarted, {"seq-lost": old()})
    assert recon.claim_lost(LOST_AFTER_S) == [("seq-lost", 4)]


def test_a_message_waiting_in_any_priority_list_is_not_lost(store, recon, r):
    accept(store, "seq-a", "seq-b", at=old())
    r.lpush(QUEUE, celery_message("seq-a"))
    r.lpush(queue_lists(QUEUE)[7], celery_message("seq-b", priority=7))
    assert recon.claim_lost(LOST_AFTER_S) == []
    # seen now: not looked for again (nor the lists read for it) for another LOST_AFTER_S
    assert min(recon.unstarted().values()) > time.time() - 5


def test_a_message_delivered_lately_is_not_lost_one_delivered_long_ago_to_nobody_is(
        store, recon, r):
    accept(store, "seq-recent", "seq-stale", at=old())
    deliver(r, celery_message("seq-recent"), time.time() - 1)
    # Delivered before the cutoff and held by no worker: its consumer died before its
    # task_received signal (the message would wait for kombu's visibility timeout).
    deliver(r, celery_message("seq-stale"), old())
    assert recon.claim_lost(LOST_AFTER_S) == [("seq-stale", None)]


def test_a_sequence_a_registered_worker_holds_is_its_own_or_its_reapers(store, recon, r):
    accept(store, "seq-held", "seq-resending", at=old())
    r.zadd(Keys.workers, {"w1": time.time(), "dead": time.time() - 100})
    store.hold("dead", "seq-held")                       # reserved by a worker not reaped yet
    r.sadd(Keys.running("w1"), "seq-resending")          # taken back, its message not sent yet
    assert recon.claim_lost(LOST_AFTER_S) == []


def test_ids_no_longer_queued_leave_the_index(store, recon):
    accept(store, "seq-run", "seq-done", "seq-gone", at=old())
    store.r.hset(Keys.record("seq-run"), "status", "running")   # a start without the script
    store.r.hset(Keys.record("seq-done"), "status", "succeeded")
    store.r.delete(Keys.record("seq-gone"))                       # expired
    assert recon.claim_lost(LOST_AFTER_S) == []
    assert recon.unstarted() == {}


def test_other_tasks_messages_are_not_mistaken_for_a_sequences(store, recon, r):
    accept(store, "seq-" + "a" * 32, at=old())
    r.lpush(QUEUE, celery_message("b" * 32, task="llmq.batch"))
    r.lpush(QUEUE, celery_message("msg_" + "a" * 32, task="llmq.webhook"))
    assert recon.claim_lost(LOST_AFTER_S) == [("seq-" + "a" * 32, None)]


# --- the reconciler -----------------------------------------------------------------------------
class Broker:
    def __init__(self):
        self.sent: list[tuple[str, int | None]] = []

    def send(self, seq_id: str, priority: int | None = None) -> None:
        self.sent.append((seq_id, priority))


def test_workers_reconciling_at_once_send_a_lost_sequence_once(store):
    accept(store, "seq-lost", priority=2, at=old())
    settings = make_settings(worker_stale_s=LOST_AFTER_S)
    brokers = [Broker() for _ in range(3)]
    for b in brokers:
        Reconciler(settings, store.beside(ReconcileStore, queue_lists(QUEUE)), b.send).run()
    assert sorted(s for b in brokers for s in b.sent) == [("seq-lost", 2)]


def test_a_pass_runs_every_half_stale_time():
    rec = Reconciler(make_settings(worker_stale_s=10), None, None)
    assert rec.due()
    rec._last = time.monotonic() - 4.9
    assert not rec.due()
    rec._last = time.monotonic() - 5.0
    assert rec.due()


def test_a_duplicate_of_a_message_that_was_not_lost_is_skipped(store, recon, r):
    """The reconciler cannot see a message in a live consumer's two round trips (BRPOP, then
    HSET unacked): it sends another. Whichever starts first runs it; the other is skipped by
    the start guard, while it runs and after it ended, and the late one cannot write."""
    accept(store, "seq-a", at=old())
    r.zadd(Keys.workers, {"w1": time.time(), "w2": time.time()})
    assert recon.claim_lost(LOST_AFTER_S) == [("seq-a", None)]
    assert store.start("seq-a", "w1", running=None) == ("queued", 1)      # the re-sent one
    assert store.start("seq-a", "w2") == ("running-elsewhere", 0)         # the original
    assert store.start("seq-a", "w1", running=1) == ("running-here", 0)   # or both on w1
    assert store.finish("seq-a", FinishReason.LENGTH, text="t", attempt=1)
    assert store.start("seq-a", "w2") == ("succeeded", 0)
    assert not store.finish("seq-a", FinishReason.LENGTH, text="other", attempt=2)
    assert store.get_job("seq-a")["text"] == "t" and recon.unstarted() == {}


# --- kombu's unacked ----------------------------------------------------------------------------
def test_unacked_messages_of_ended_sequences_are_dropped_once_delivered_long_ago(store, recon, r):
    long_ago = time.time() - LOST_AFTER_S - 1
    done, late, queued, gone = (new_seq_id() for _ in range(4))
    accept(store, done, late, queued)
    for s in (done, late):
        store.finish(s, FinishReason.LENGTH)
    tags = {s: deliver(r, celery_message(s), long_ago) for s in (done, queued, gone)}
    tags[late] = deliver(r, celery_message(late), time.time())
    tags["batch"] = deliver(r, celery_message("c" * 32, task="llmq.batch"), long_ago)
    assert recon.sweep_unacked(LOST_AFTER_S) == 2     # ended, and expired (no record)
    kept = set(r.hkeys(Keys.kombu_unacked))
    assert kept == set(r.zrange(Keys.kombu_unacked_index, 0, -1))
    assert kept == {tags[late], tags[queued], tags["batch"]}


def test_the_kombu_keys_are_kombus():
    channel = kombu.transport.redis.Channel
    assert (channel.unacked_key, channel.unacked_index_key) == (
        Keys.kombu_unacked, Keys.kombu_unacked_index)


# --- webhook deliveries -------------------------------------------------------------------------
def test_a_webhook_delivery_lost_in_the_broker_is_claimed_once_a_waiting_one_is_not(r, recon):
    from common.webhook_store import WebhookStore

    hooks = WebhookStore(r, 600)
    for eid in ("msg_lost", "msg_queued", "msg_retrying", "msg_done", "msg_given_up"):
        hooks.put_event(eid, "http://hooks.example.com/in", "{}", "")
    r.zadd(Keys.webhooks_pending, {eid: old() for eid in r.zrange(Keys.webhooks_pending, 0, -1)})
    r.lpush(QUEUE, celery_message("msg_queued", task="llmq.webhook"))
    # A retry waits in a worker for its countdown (delivered long ago, not acknowledged).
    deliver(r, celery_message("msg_retrying", task="llmq.webhook"), old() - 3600)
    hooks.record_attempt("msg_done", "HTTP 204", delivered=True)
    hooks.record_attempt("msg_given_up", "HTTP 503", delivered=False, final=True)
    assert set(r.zrange(Keys.webhooks_pending, 0, -1)) == {"msg_lost", "msg_queued",
                                                            "msg_retrying"}
    assert recon.claim_lost_events(LOST_AFTER_S) == ["msg_lost"]
    assert recon.claim_lost_events(LOST_AFTER_S) == []          # claimed (and the rest seen)
    r.delete(Keys.webhook_event("msg_lost"))                    # expired: no longer watched
    r.zadd(Keys.webhooks_pending, {"msg_lost": old()})
    assert recon.claim_lost_events(LOST_AFTER_S) == []
    assert "msg_lost" not in r.zrange(Keys.webhooks_pending, 0, -1)
