"""StreamHub: one XREAD for every stream an API process follows, each subscription handed its
own entries in order, a newcomer's first entry not held up by the reader's block, Redis errors
passed on. Against a real redis-server (CLIENT UNBLOCK is what wakes the reader)."""
from __future__ import annotations

import threading

import pytest
import redis

from common.keys import Keys
from common.protocol import EVENT_TOKEN, encode_event
from common.store import SequenceStore
from common.stream_hub import StreamHub
from support import wait_until

WAIT_S = 10.0   # a bound for a broken hub to fail by, not a timing


@pytest.fixture
def hub(redis_client):
    return StreamHub(SequenceStore(redis_client))


def add(client, seq_id: str, text: str) -> str:
    return client.xadd(Keys.events(seq_id), encode_event(EVENT_TOKEN, {"text": text}))


def texts(events) -> list[tuple[str, str]]:
    return [(seq_id, data["text"]) for seq_id, _entry, _kind, data in events]


def read_all(sub, n: int) -> list:
    """Reads until n entries came (or a read came back empty)."""
    out = []
    while len(out) < n:
        got = sub.read(WAIT_S)
        if not got:
            break
        out += got
    return out


def test_each_subscription_gets_its_own_streams_entries_in_order(hub, redis_client):
    with hub.subscribe({"a": "0-0", "b": "0-0"}) as ab, hub.subscribe({"c": "0-0"}) as c:
        for i in range(3):
            for seq in "abc":
                add(redis_client, seq, f"{seq}{i}")
        got = read_all(ab, 6)
        assert sorted(texts(got)) == sorted((s, f"{s}{i}") for s in "ab" for i in range(3))
        assert [t for s, t in texts(got) if s == "a"] == ["a0", "a1", "a2"]
        assert texts(read_all(c, 3)) == [("c", "c0"), ("c", "c1"), ("c", "c2")]
        assert ab.positions["a"] == got[-1][1] or ab.positions["b"] == got[-1][1]


def test_a_newcomer_is_not_held_up_by_the_readers_block(hub, redis_client):
    hub.BLOCK_MS = 600_000   # the reader would sit in XREAD on the first stream for 10 minutes
    with hub.subscribe({"idle": "0-0"}) as idle:
        # The reader blocked in XREAD on "idle" alone (a newcomer before it would only join
        # that first read, and the unblocking would go untested).
        wait_until(lambda: any(c.get("cmd") == "xread" for c in redis_client.client_list()),
                   WAIT_S, "the reader to block")
        assert idle.read(0) == []
        with hub.subscribe({"new": "0-0"}) as new:
            add(redis_client, "new", "hello")
            assert texts(new.read(WAIT_S)) == [("new", "hello")]
        add(redis_client, "idle", "later")
        assert texts(idle.read(WAIT_S)) == [("idle", "later")]


def test_a_resumed_subscription_gets_only_what_follows_its_position(hub, redis_client):
    first = add(redis_client, "s", "one")
    second = add(redis_client, "s", "two")
    with hub.subscribe({"s": "0-0"}) as whole, hub.subscribe({"s": first}) as resumed:
        assert texts(read_all(whole, 2)) == [("s", "one"), ("s", "two")]
        got = resumed.read(WAIT_S)
        assert texts(got) == [("s", "two")] and got[0][1] == second
        add(redis_client, "s", "three")
        assert texts(whole.read(WAIT_S)) == [("s", "three")]
        assert texts(resumed.read(WAIT_S)) == [("s", "three")]


def test_a_dropped_sequence_is_no_longer_followed(hub, redis_client):
    with hub.subscribe({"x": "0-0", "y": "0-0"}) as sub:
        sub.drop("x")
        add(redis_client, "x", "unwanted")
        add(redis_client, "y", "wanted")
        assert texts(read_all(sub, 1)) == [("y", "wanted")]
        assert sub.read(0.2) == []


def test_a_redis_error_reaches_the_reader_of_a_subscription():
    # A port nothing listens on: the hub's reader cannot connect.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = redis.Redis(port=port, socket_connect_timeout=1, decode_responses=True)
    hub = StreamHub(SequenceStore(client))
    with hub.subscribe({"a": "0-0"}) as sub:
        with pytest.raises(redis.ConnectionError):
            sub.read(WAIT_S)


def test_a_position_that_is_not_a_stream_id_is_refused_before_it_reaches_the_shared_read(
        hub, redis_client):
    with hub.subscribe({"ok": "0-0"}) as ok:
        with pytest.raises(ValueError):
            hub.subscribe({"bad": "not-an-id"})
        add(redis_client, "ok", "still flowing")
        assert texts(ok.read(WAIT_S)) == [("ok", "still flowing")]


def test_a_subscriber_behind_a_read_under_way_gets_its_history_from_the_next_read(hub):
    # The reader's XREAD went out from "7-0" (the only subscriber then); a second subscriber
    # came from the start while it was under way, and the read returns entry 8.
    from common.stream_hub import Subscription

    ahead, behind = Subscription(hub, {"x": "7-0"}), Subscription(hub, {"x": "0-0"})
    hub._subs |= {ahead, behind}
    hub._deliver([("x", "8-0", EVENT_TOKEN, {"text": "8"})], read_from={"x": "7-0"})
    assert texts(ahead.read(0)) == [("x", "8")]
    assert behind.read(0) == [] and behind.positions == {"x": "0-0"}
    assert hub._positions() == {"x": "0-0"}   # the next XREAD reads from the start


def test_a_second_subscriber_joining_a_flowing_stream_gets_all_of_it(hub, redis_client):
    with hub.subscribe({"f": "0-0"}) as first:
        for i in range(20):
            add(redis_client, "f", str(i))
            if i == 10:
                late = hub.subscribe({"f": "0-0"})
        assert [t for _, t in texts(read_all(first, 20))] == [str(i) for i in range(20)]
        with late:
            assert [t for _, t in texts(read_all(late, 20))] == [str(i) for i in range(20)]


def test_a_newcomer_still_wakes_a_reader_whose_connection_was_replaced(hub, redis_client):
    """The reader's connection is killed in its blocking XREAD; redis-py reconnects (a new
    client id) and the reader blocks again. A newcomer must wake that new connection: an
    unblock sent to the old id would leave it waiting out the block (10 minutes here)."""
    hub.BLOCK_MS = 600_000
    with hub.subscribe({"idle": "0-0"}) as idle:
        assert idle.read(0.2) == []            # the reader is blocked by now
        old = hub._reader.client_id()
        redis_client.client_kill_filter(_id=old)
        # Until the reader has blocked again on a new connection (an error may reach `idle`).
        for _ in range(int(WAIT_S / 0.05)):
            clients = {int(c["id"]): c for c in redis_client.client_list()}
            blocked = [i for i, c in clients.items() if c.get("cmd") == "xread" and i != old]
            if blocked:
                break
            try:
                idle.read(0.05)
            except redis.RedisError:
                pass
        assert blocked, "the reader did not block again after its connection was killed"
        with hub.subscribe({"new": "0-0"}) as new:
            add(redis_client, "new", "hello")
            assert texts(new.read(WAIT_S)) == [("new", "hello")]


def unreachable_store() -> SequenceStore:
    """A store on a port nothing listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return SequenceStore(redis.Redis(port=port, socket_connect_timeout=1, decode_responses=True))


def test_each_subscriber_raises_its_own_copy_of_the_readers_error():
    """One exception object raised in many threads would chain all their frames onto one
    traceback: each gets a copy of the reader's error, which is its cause."""
    hub = StreamHub(unreachable_store())
    with hub.subscribe({"a": "0-0"}) as a, hub.subscribe({"b": "0-0"}) as b:
        raised = []
        for sub in (a, b):
            with pytest.raises(redis.ConnectionError) as info:
                sub.read(WAIT_S)
            raised.append(info.value)
        assert raised[0] is not raised[1]
        assert isinstance(raised[0].__cause__, redis.ConnectionError)
        assert raised[0].__cause__ is not raised[0]


def test_entries_read_after_an_error_are_handed_out_and_the_error_forgotten(hub):
    """The reader failed once, then recovered and read on: the subscriber gets the entries (the
    stream goes on), not an error that is over."""
    from common.stream_hub import Subscription

    sub = Subscription(hub, {"x": "0-0"})
    hub._subs.add(sub)
    hub._fail(redis.ConnectionError("the server restarted"))
    hub._deliver([("x", "1-0", EVENT_TOKEN, {"text": "after"})], read_from={"x": "0-0"})
    assert texts(sub.read(0)) == [("x", "after")]
    assert sub.read(0) == []


def test_a_reader_thread_that_died_is_replaced_by_the_next_subscription(hub, redis_client,
                                                                        monkeypatch):
    """An exception the reader does not catch (SystemExit from a library, say) ends its thread;
    the next subscription starts another instead of waiting on a reader that is gone."""
    calls, found = [], threading.Event()
    real = SequenceStore.read_events_many

    def dies_once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            found.wait(WAIT_S)   # alive until the test has found it among the threads
            raise SystemExit("the reader's thread ends here")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SequenceStore, "read_events_many", dies_once)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)   # (expected: no report)
    others = set(threading.enumerate())   # (other tests' hubs may still be reading)
    with hub.subscribe({"first": "0-0"}):
        # (threads other tests left behind may start meanwhile: the hub's has its name)
        [reader] = [t for t in set(threading.enumerate()) - others if t.name == "llmq-stream-hub"]
        found.set()
        reader.join(WAIT_S)
        assert calls and not reader.is_alive()
        with hub.subscribe({"second": "0-0"}) as second:
            add(redis_client, "second", "hello")
            assert texts(second.read(WAIT_S)) == [("second", "hello")]
