"""Webhook delivery (worker/webhooks.py), on fakeredis and loopback sockets: every attempt the
settings allow is made, nothing unforeseen loses an event, and a receiver cannot hold a task
thread (shared with generation) past the timeout."""
from __future__ import annotations

import socket
import threading

import fakeredis
import pytest
import redis

from common.batch_store import BatchStore
from common.file_store import FileStore
from common.reconcile_store import ReconcileStore
from common.store import SequenceStore
from common.webhook_guard import Target
from common.webhook_store import PENDING_KEY, WebhookStore, event_key, owner_key

from .factories import RecordingCelery, make_settings


SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
OWNER = "0123456789abcdef0123456789abcdef"   # an API key's owner id (app/auth.py)
PUBLIC = Target("http", "hooks.example.com", 80, "/in", ("93.184.216.34",))


@pytest.fixture
def delivery(monkeypatch):
    """(run, store, posts): run(**settings) delivers event msg_1 as the worker's task does
    (eagerly, retries included, their countdowns not waited); posts records each POST."""
    from worker import webhooks
    from worker.celery_app import create_celery
    from worker.services import Services

    r = fakeredis.FakeRedis(decode_responses=True)
    store = WebhookStore(r, 60)
    store.put_event("msg_1", "http://hooks.example.com/in", '{"type": "job.completed"}', OWNER)
    posts: list[tuple[bytes, dict]] = []
    monkeypatch.setattr(webhooks, "check_url", lambda url, allowed: PUBLIC)

    def run(answers, **overrides):
        def post(target, body, headers, timeout_s, connect_timeout_s=None):
            posts.append((body, headers))
            answer = answers[min(len(posts), len(answers)) - 1]
            if isinstance(answer, BaseException):
                raise answer
            return answer
        monkeypatch.setattr(webhooks, "post", post)
        settings = make_settings(webhook_secret=SECRET, **overrides)
        app = create_celery(settings)
        app.llmq_services = Services(settings, RecordingCelery(), SequenceStore(r), FileStore(r, 60),
                                     BatchStore(r, 60), store,
                                     ReconcileStore(r, ["llmq"]))
        return app.tasks["llmq.webhook"].apply(args=["msg_1"]).get()

    return run, store, posts


def test_a_receiver_that_keeps_failing_gets_every_attempt_the_settings_allow(delivery):
    """Celery's default max_retries (3) ended every event after 4 attempts, ~8 s in: a receiver
    down for ten seconds lost it, whatever LLMQ_WEBHOOK_MAX_ATTEMPTS said."""
    run, store, posts = delivery
    result = run([503], webhook_max_attempts=7)
    assert len(posts) == 7
    assert result["outcome"] == "given up: HTTP 503"
    assert store.get_event("msg_1")["attempts"] == "7"


def test_an_event_is_signed_with_its_owners_key_alone(delivery):
    """One key signed every tenant's events: any tenant could have llmq sign an event of its
    choosing to another's receiver (naming it as its own job's webhook), and it verified."""
    from worker.webhooks import sign

    run, _store, posts = delivery
    assert run([204])["outcome"] == "delivered"
    [(body, headers)] = posts
    server = make_settings(webhook_secret=SECRET).webhook_key()

    def verifies(key: bytes) -> bool:
        stamp = int(headers["webhook-timestamp"])
        return sign(key, headers["webhook-id"], stamp, body) == headers["webhook-signature"]
    assert verifies(owner_key(server, OWNER))
    assert not verifies(server) and not verifies(owner_key(server, "f" * 32))
    assert owner_key(server, "") == server        # a keyless server: LLMQ_WEBHOOK_SECRET's own


def test_an_unforeseen_error_is_a_failed_attempt_and_the_next_one_delivers(delivery):
    """Only urllib3's and OS errors were caught: anything else failed the task, which acks_late
    acknowledges, and the event was never tried again."""
    run, store, posts = delivery
    result = run([UnicodeEncodeError("latin-1", "x", 0, 1, "odd"), 204])
    assert result["outcome"] == "delivered" and len(posts) == 2
    assert store.get_event("msg_1")["delivered_at"]


def test_a_redis_error_is_retried_not_lost(delivery, monkeypatch):
    run, store, posts = delivery
    real, failed = store.get_event, []

    def flaky(event_id):
        if not failed:
            failed.append(event_id)
            raise redis.ConnectionError("Redis went away")
        return real(event_id)
    monkeypatch.setattr(store, "get_event", flaky)
    result = run([204])
    assert failed and result["outcome"] == "delivered" and len(posts) == 1


class Receiver:
    """A loopback HTTP receiver that misbehaves: `trickle` answers one byte every 0.1 s for
    `seconds`, `huge` announces a 200 with a body of `size` bytes and writes it."""

    def __init__(self, mode: str, seconds: float = 8.0, size: int = 200_000_000):
        self.mode, self.seconds, self.size = mode, seconds, size
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.finished = threading.Event()    # it ran to its end (the client waited it out)
        self.sent = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def target(self) -> Target:
        return Target("http", "hooks.example.com", self.port, "/in", ("127.0.0.1",))

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.recv(65536)
            try:
                if self.mode == "trickle":
                    for _ in range(int(self.seconds / 0.1)):
                        conn.sendall(b"H")
                        if self.stop.wait(0.1):
                            return
                else:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % self.size)
                    chunk = b"x" * 65536
                    while self.sent < self.size:
                        conn.sendall(chunk)
                        self.sent += len(chunk)
                self.finished.set()
            except OSError:   # the client closed: it did not wait for the rest
                pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)
        self.sock.close()


def test_a_receiver_answering_a_byte_at_a_time_is_cut_off_at_the_timeout():
    """A socket timeout counts per read: each byte restarted it, and a receiver that trickles
    held a task thread, shared with generation, as long as it liked."""
    from worker.webhooks import post

    rx = Receiver("trickle")
    try:
        with pytest.raises(TimeoutError, match="within 0.5 s"):
            post(rx.target(), b"{}", {}, timeout_s=0.5)
        assert not rx.finished.is_set(), "post waited for the receiver to stop on its own"
    finally:
        rx.close()


def test_the_answers_body_is_not_read():
    """The status is all delivery needs; a 200 MB answer was read into memory whole."""
    from worker.webhooks import post

    rx = Receiver("huge")
    try:
        assert post(rx.target(), b"{}", {}, timeout_s=10) == 200
        rx.thread.join(15)
        assert not rx.finished.is_set() and rx.sent < rx.size
    finally:
        rx.close()


def test_the_default_retries_outlast_an_afternoon_of_downtime(delivery, monkeypatch):
    """10 attempts at 1, 2, 4 ... s ended ~9 minutes after the event: a receiver restarted over
    a lunch break lost every event of it."""
    from worker import webhooks

    run, _store, posts = delivery
    waits, backoff = [], webhooks.backoff_s
    monkeypatch.setattr(webhooks, "backoff_s", lambda retries: waits.append(
        backoff(retries)) or waits[-1])
    assert run([503])["outcome"] == "given up: HTTP 503"
    assert len(posts) == make_settings().webhook_max_attempts == len(waits) + 1
    assert sum(waits) >= 6 * 3600 and max(waits) <= 3600 * 1.25


# --- one receiver holds little of the delivery pool (issue 48) -----------------------------------
def test_a_connection_must_open_within_the_connect_timeout():
    """The one timeout covered the connect too: a host that never completes the handshake
    held a delivery thread for the whole LLMQ_WEBHOOK_TIMEOUT."""
    import time

    import urllib3

    from worker.webhooks import post

    srv = socket.create_server(("127.0.0.1", 0), backlog=0)   # never accepts: SYNs queue up
    port, fill = srv.getsockname()[1], []
    try:
        for _ in range(4):   # fill the accept queue; then connects hang
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            fill.append(c)
        start = time.monotonic()
        with pytest.raises(urllib3.exceptions.ConnectTimeoutError):
            post(Target("http", "hooks.example.com", port, "/in", ("127.0.0.1",)), b"{}", {},
                 timeout_s=20, connect_timeout_s=0.5)
        assert time.monotonic() - start < 5
    finally:
        for c in fill:
            c.close()
        srv.close()


@pytest.fixture
def slots():
    return WebhookStore(fakeredis.FakeRedis(decode_responses=True), 60)


def test_deliveries_in_flight_are_capped_per_host_and_per_key(slots):
    start = lambda eid, host, owner: slots.start_delivery(eid, host, owner, 30, 2, 3, 60)[0]
    assert [start(e, "a.example", "k1") for e in ("e1", "e2", "e3")] == ["ok", "ok", "host"]
    assert start("e2", "a.example", "k1") == "ok"        # its own slot again (a redelivery)
    assert start("e4", "b.example", "k1") == "ok"        # another host: the key's third
    assert start("e5", "c.example", "k1") == "key"       # the key's cap, whatever the host
    assert start("e6", "c.example", "k2") == "ok"        # another key is not held back
    slots.end_delivery("e1", "a.example", "k1", True, 5, 60)
    assert start("e3", "a.example", "k1") == "ok"        # a freed slot is taken


def test_a_dead_deliverys_slots_free_when_their_lease_runs_out(slots):
    assert slots.start_delivery("e1", "a.example", "k1", -1, 1, 1, 60)[0] == "ok"   # expired
    assert slots.start_delivery("e2", "a.example", "k1", 30, 1, 1, 60)[0] == "ok"


def test_a_host_that_keeps_not_answering_is_left_alone_then_probed_once(slots, monkeypatch):
    from common import webhook_store

    now = [1000.0]
    monkeypatch.setattr(webhook_store.time, "time", lambda: now[0])

    def attempt(eid: str, answered: bool | None = None) -> str:
        reason = slots.start_delivery(eid, "down.example", "k1", 30, 0, 0, 60)[0]
        if reason == "ok" and answered is not None:
            slots.end_delivery(eid, "down.example", "k1", answered, 3, 60)
        return reason

    assert [attempt(f"e{i}", False) for i in range(3)] == ["ok"] * 3
    assert slots.start_delivery("e9", "down.example", "k1", 30, 0, 0, 60) == ("breaker", 60.0)
    assert attempt("x", True) == "breaker"      # another host's answer would not matter
    now[0] += 61
    assert attempt("probe") == "ok"             # one attempt probes the host ...
    assert attempt("other") == "breaker"        # ... the others wait for its outcome
    slots.end_delivery("probe", "down.example", "k1", False, 3, 60)
    assert attempt("other") == "breaker"        # it failed: open again
    now[0] += 61
    assert attempt("probe2", True) == "ok"      # it answered: closed
    assert attempt("other") == "ok"


def test_an_answer_of_any_status_keeps_the_breaker_closed(slots):
    """The breaker guards the pool's threads from hosts that hold them; a receiver answering
    503 at once holds none (its events get their attempts and backoff as before)."""
    for i in range(10):
        assert slots.start_delivery(f"e{i}", "busy.example", "k1", 30, 0, 0, 60)[0] == "ok"
        slots.end_delivery(f"e{i}", "busy.example", "k1", True, 3, 60)


def test_a_held_back_delivery_is_not_an_attempt_and_is_delivered_later(delivery, monkeypatch):
    run, store, posts = delivery
    real, held = store.start_delivery, []

    def once_busy(*args):
        if not held:
            held.append(args)
            return "host", 1.0
        return real(*args)
    monkeypatch.setattr(store, "start_delivery", once_busy)
    assert run([204])["outcome"] == "delivered"
    assert held and len(posts) == 1
    assert store.get_event("msg_1")["attempts"] == "1"


def test_webhook_deliveries_are_routed_to_their_own_queue():
    from common.celery_config import celery_config
    from common.webhook_store import WEBHOOK_TASK

    s = make_settings(queue="llmq")
    assert celery_config(s)["task_routes"] == {WEBHOOK_TASK: {"queue": "llmq.webhooks"}}
    assert s.webhook_queue != s.queue


def test_an_unforeseen_error_before_the_post_is_a_failed_attempt_too(delivery, monkeypatch):
    from worker import webhooks

    run, store, posts = delivery
    calls = []

    def check(url, allowed):
        calls.append(url)
        if len(calls) == 1:
            raise UnicodeError("odd host")
        return PUBLIC
    monkeypatch.setattr(webhooks, "check_url", check)
    assert run([204])["outcome"] == "delivered" and len(posts) == 1
    assert store.get_event("msg_1")["attempts"] == "2"


def test_a_delivery_held_back_again_and_again_waits_longer_each_time(monkeypatch):
    """Held back every ~2 s, thousands of one key's events behind one silent receiver would
    keep the delivery pool busy putting them off."""
    from worker import webhooks

    class Busy:
        def start_delivery(self, *args):
            return "key", 30.0

    monkeypatch.setattr(webhooks, "check_url", lambda url, allowed: PUBLIC)
    monkeypatch.setattr(webhooks.random, "uniform", lambda a, b: 1.0)
    s = make_settings(webhook_secret=SECRET)
    waits = []
    for retries in (0, 1, 2, 5, 50):
        with pytest.raises(webhooks.Deferred) as held:
            webhooks.attempt(s, Busy(), "msg_1", {"url": "x", "body": "{}"}, retries)
        waits.append(held.value.wait_s)
    assert waits == [2.0, 4.0, 8.0, 64.0, 64.0]


def test_a_delivery_sent_again_keeps_its_count_and_a_settled_one_is_not_posted(delivery):
    """The reconciler sends a delivery again when the broker lost its message (a new message:
    Celery's retries start at 0): the event's own count of attempts still bounds it, and once
    it is settled (given up, delivered) another message posts nothing."""
    run, store, posts = delivery
    store.r.hset(event_key("msg_1"), "attempts", 5)   # five attempts before the loss
    assert run([503], webhook_max_attempts=7)["outcome"] == "given up: HTTP 503"
    assert len(posts) == 2 and store.get_event("msg_1")["settled"] == "HTTP 503"
    assert store.r.zscore(PENDING_KEY, "msg_1") is None        # no longer watched
    assert run([204])["outcome"] == "settled before" and len(posts) == 2
