"""Taking back a dead worker's sequences (common/store/lua/reclaim.lua, worker/liveness.py)
when the new messages cannot all be sent: every sequence taken back keeps a trace in Redis
until its message is sent, so a broker that fails part-way, or a reaper that dies mid-way,
loses nothing. fakeredis for the store, a stand-in for Celery's send_task that can fail."""
from __future__ import annotations

import threading
import time

import fakeredis
import pytest
from kombu.exceptions import OperationalError

from common.keys import Keys
from common.protocol import SamplingParams, SequenceRequest
from common.store import SequenceStore, events_key, record_key
from worker.liveness import Liveness

from .factories import make_settings



@pytest.fixture
def store():
    return SequenceStore(fakeredis.FakeRedis(decode_responses=True), pending_ttl_s=3000)


class Broker:
    """Records each sequence sent again; once `fail_after` sends have gone, the rest fail as
    kombu's do when the broker is away."""

    def __init__(self, fail_after: int | None = None):
        self.sent: list[str] = []
        self.fail_after = fail_after

    def send(self, seq_id: str, priority=None) -> None:
        if self.fail_after is not None and len(self.sent) >= self.fail_after:
            raise OperationalError("Error 111 connecting to redis:6379. Connection refused.")
        self.sent.append(seq_id)


def running(store, worker: str, *seq_ids: str) -> None:
    """Records that `worker` started (tokens or not, they are `running` under its name)."""
    for seq_id in seq_ids:
        store.create([SequenceRequest(seq_id=seq_id, prompt="x", params=SamplingParams())])
        store.start(seq_id, worker)


def dead(store, worker: str) -> None:
    store.r.zadd(Keys.workers, {worker: time.time() - 100})   # its last beat, long ago


def liveness(store, name: str, broker: Broker) -> Liveness:
    return Liveness(name, make_settings(), store, dict, broker.send, threading.Event())


def test_a_reap_whose_sends_fail_part_way_sends_the_rest_at_the_next_reap(store):
    running(store, "dead", "a", "b", "c")
    dead(store, "dead")
    broker = Broker(fail_after=1)
    reaper = liveness(store, "w1", broker)
    with pytest.raises(OperationalError):   # beat() logs "reaping failed" and goes on
        reaper.reap_dead_workers()
    unsent = {"a", "b", "c"} - set(broker.sent)
    # Not sent, not forgotten: queued, and waiting in the reaper's running set.
    assert [store.get_job(s)["status"] for s in "abc"] == ["queued"] * 3
    assert store.running_ids("w1") == unsent
    assert store.reclaim("dead", stale_s=15) == []           # still one winner: the reaper
    broker.fail_after = None
    reaper.reap_dead_workers()                               # the next beat's reap
    assert sorted(broker.sent) == ["a", "b", "c"]            # each sent once
    assert store.running_ids("w1") == set() and store.running_ids("dead") == set()
    assert "dead" not in store.r.zrange(Keys.workers, 0, -1)


def test_a_reaper_that_dies_mid_send_leaves_the_rest_to_whoever_reaps_it(store):
    running(store, "dead", "a", "b", "c")
    dead(store, "dead")
    first = Broker(fail_after=1)
    with pytest.raises(OperationalError):
        liveness(store, "w1", first).reap_dead_workers()
    dead(store, "w1")                                        # the reaper dies in turn
    second = Broker()
    liveness(store, "w2", second).reap_dead_workers()
    assert sorted(first.sent + second.sent) == ["a", "b", "c"]
    assert store.running_ids("w1") == set() and store.running_ids("w2") == set()


def test_own_take_back_whose_sends_fail_is_finished_by_the_next_start(store):
    running(store, "w1", "a", "b")                           # this name's previous life
    with pytest.raises(OperationalError):                    # EngineCore.start fails: exit 3
        liveness(store, "w1", Broker(fail_after=0)).take_back_own()
    broker = Broker()
    liveness(store, "w1", broker).take_back_own()            # the supervisor's restart
    assert sorted(broker.sent) == ["a", "b"]
    # One reset each: the second take-back finds them queued, not running.
    assert all([k for _i, k, _d in store.read_events(s)] == ["reset"] for s in "ab")
    assert store.running_ids("w1") == set()


def test_a_sequence_the_sender_started_before_marking_it_sent_stays_in_its_running_set(store):
    """The sender's own consumer can take the new message and start the sequence before the
    sender marks it sent: it is running there now, and must stay reclaimable."""
    running(store, "dead", "a")
    dead(store, "dead")
    assert store.reclaim("dead", stale_s=15, sender="w1") == ["a"]
    store.start("a", "w1")                                   # the new message, taken at once
    store.resent("w1", "a")
    assert store.running_ids("w1") == {"a"}


def test_a_reset_event_written_by_a_reclaim_expires_with_its_record(store):
    """No token was published yet: the reclaim's reset event starts the stream, which must
    expire as every other writer's does, not outlive its record forever."""
    running(store, "dead", "s")
    assert store.reclaim("dead") == ["s"]
    assert 0 < store.r.ttl(record_key("s")) and 0 < store.r.ttl(events_key("s")) <= 3000


def test_a_send_whose_mark_fails_is_marked_at_the_next_reap_and_not_sent_again(store,
                                                                              monkeypatch):
    """The new message went, then Redis failed marking it sent: the id stayed in the reaper's
    running set for good, and a later reap of the reaper would queue it a second time."""
    import redis

    running(store, "dead", "a", "b")
    dead(store, "dead")
    broker = Broker()
    reaper = liveness(store, "w1", broker)
    resent, calls = store.resent, []

    def flaky(sender, seq_id):
        calls.append(seq_id)
        if len(calls) == 1:
            raise redis.ConnectionError("blip")
        resent(sender, seq_id)

    monkeypatch.setattr(store, "resent", flaky)
    with pytest.raises(redis.ConnectionError):
        reaper.reap_dead_workers()
    assert len(broker.sent) == 1 and store.running_ids("w1") == {"a", "b"}
    reaper.reap_dead_workers()                               # the next beat's reap
    assert sorted(broker.sent) == ["a", "b"]                 # the first not sent twice
    assert store.running_ids("w1") == set()
