"""How batches of different keys share (worker/batch_shares.py): the lines in flight, counted
from the batch store on fakeredis, and a worker's batch driver slots, with threads."""
from __future__ import annotations

import threading

import fakeredis

from common.batch_store import BatchStore, new_batch_id
from common.file_store import new_file_id
from worker.batch_shares import DriverSlots, line_room


def new_batch(store: BatchStore, owner: str, lines: int) -> str:
    batch_id = new_batch_id()
    store.create({"id": batch_id, "owner": owner, "status": "in_progress",
                  "endpoint": "/v1/completions", "input_file_id": new_file_id(),
                  "completion_window": "24h", "created_at": 1.0, "expires_at": 9e9},
                 ['{"custom_id": "x"}'] * lines, {})
    return batch_id


def send(store: BatchStore, batch_id: str, n: int) -> None:
    for i in range(n):
        store.take_line(batch_id, i)
        store.line_sent(batch_id, i)


# --- lines in flight -----------------------------------------------------------------------------
def test_a_second_keys_batch_gets_its_share_of_the_lines_in_flight():
    store = BatchStore(fakeredis.FakeRedis(decode_responses=True), 3600)
    a1, a2 = new_batch(store, "a", 40), new_batch(store, "a", 40)
    send(store, a1, 16)
    send(store, a2, 16)
    # Key a alone fills all 32; its batches still have lines to send.
    assert line_room(32, "a", *store.inflight_by_owner()) == 0
    b = new_batch(store, "b", 40)
    inflight, wanting = store.inflight_by_owner()
    assert inflight == {"a": 32, "b": 0} and wanting == {"a", "b"}
    assert line_room(32, "b", inflight, wanting) == 0   # nothing has finished yet
    for i in range(4):   # four of key a's lines end: the room is key b's, not a's
        store.answer(a1, i, True, {"id": i})
    inflight, wanting = store.inflight_by_owner()
    assert line_room(32, "a", inflight, wanting) < 0
    assert line_room(32, "b", inflight, wanting) == 4
    send(store, b, 4)
    for i in range(4, 16):   # a drops to 16: b fills up to its half, a gets no more
        store.answer(a1, i, True, {"id": i})
    inflight, wanting = store.inflight_by_owner()
    assert line_room(32, "b", inflight, wanting) == 12
    assert line_room(32, "a", inflight, wanting) == 0


def test_a_key_with_nothing_left_to_send_leaves_its_share_to_the_others():
    store = BatchStore(fakeredis.FakeRedis(decode_responses=True), 3600)
    a, b = new_batch(store, "a", 40), new_batch(store, "b", 4)
    send(store, b, 4)   # every line of b's batch is sent
    inflight, wanting = store.inflight_by_owner()
    assert wanting == {"a"}
    assert line_room(32, "a", inflight, wanting) == 28
    assert line_room(5, "c", {}, {"a", "b", "c"}) == 2   # shares round up


# --- driver slots --------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def acquire_in_thread(slots: DriverSlots, owner: str):
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("slot", slots.acquire(owner)))
    t.start()
    return t, got


def test_a_key_holding_every_slot_gives_one_to_another_keys_batch():
    slots = DriverSlots(2, slice_s=60.0)
    first, second = slots.acquire("a"), slots.acquire("a")
    assert slots.acquire("a") is None   # a key's third batch waits: nobody gives way to it
    t, got = acquire_in_thread(slots, "b")
    assert second.give_way.wait(10)     # key a's newest driver is asked to give way...
    assert not first.give_way.is_set()
    assert slots.acquire("a") is None   # ...and key a cannot take the slot back meanwhile
    slots.release(second)               # (the driver hands its batch back)
    t.join(10)
    assert got["slot"] is not None and got["slot"].owner == "b"
    assert [s.owner for s in slots.held] == ["a", "b"]
    assert slots.acquire("a") is None   # one each now: a's batch is due again later


def test_keys_outnumbering_the_slots_take_turns():
    clock = Clock()
    slots = DriverSlots(2, slice_s=60.0, clock=clock)
    a = slots.acquire("a")
    clock.t = 10.0
    b = slots.acquire("b")
    clock.t = 59.0
    assert slots.acquire("c") is None   # both hold their one slot: c waits for a slice
    clock.t = 61.0
    t, got = acquire_in_thread(slots, "c")
    assert a.give_way.wait(10) and not b.give_way.is_set()   # the longest-running gives way
    slots.release(a)
    t.join(10)
    assert got["slot"].owner == "c"


def test_an_asker_gives_up_when_the_slot_does_not_come():
    slots = DriverSlots(2, slice_s=60.0, wait_s=0.05)
    slots.acquire("a")
    a = slots.acquire("a")
    t, got = acquire_in_thread(slots, "b")   # (nobody releases key a's slot)
    t.join(10)
    assert got["slot"] is None and a.give_way.is_set() and slots.waiting == 0
    slots.release(a)
    assert slots.acquire("c") is not None   # the slot is free to whoever asks next
