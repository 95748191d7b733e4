"""A key's slots (open streams, waiting requests) as leases: renewed while held, never
lapsing with the set that holds them, never brought back once closed (common/store/
stream_leases.py, app/slot_keeper.py)."""
from __future__ import annotations

import threading
import time

import fakeredis

from app.slot_keeper import SlotKeeper
from common.keys import Keys
from common.store import StreamLeases
from support import wait_until


def test_renewing_lengthens_the_lease_and_the_sets_life_but_revives_no_closed_slot():
    r = fakeredis.FakeRedis(decode_responses=True)
    leases = StreamLeases(r)
    key = Keys.owner_streams("o")
    kept, closed = leases.open_stream("o", 2, 5), leases.open_stream("o", 2, 5)
    assert 4000 < r.pttl(key) <= 6000
    # A shorter lease taken later does not end the set, and the longer lease with it.
    assert leases.open_stream("o", 3, 1) and r.pttl(key) > 4000
    leases.close_stream("o", closed)
    leases.renew_slots([("o", False, kept), ("o", False, closed)], 60)
    scores = dict(r.zrange(key, 0, -1, withscores=True))
    assert scores[kept] > time.time() + 55 and closed not in scores
    assert r.pttl(key) > 55_000                        # the set outlives the renewed lease
    # A waiting slot is renewed in its own set.
    waiting = leases.open_stream("o", 1, 5, waiting=True)
    leases.renew_slots([("o", True, waiting)], 60)
    assert r.zscore(Keys.owner_waiting("o"), waiting) > time.time() + 55


class _Store:
    """Records what the keeper renews."""

    def __init__(self):
        self.renewed: list[list] = []
        self.lock = threading.Lock()

    def renew_slots(self, slots, lease_s):
        with self.lock:
            self.renewed.append(sorted(slots))


def test_the_keeper_renews_what_is_held_until_let_go_and_then_stops():
    store = _Store()
    keeper = SlotKeeper(store, lease_s=0.15)
    keeper.hold("o", False, "t1")
    keeper.hold("o", True, "t2")
    wait_until(lambda: [("o", False, "t1"), ("o", True, "t2")] in store.renewed, 10,
               "both slots to be renewed")
    keeper.let_go("o", False, "t1")
    wait_until(lambda: store.renewed[-1] == [("o", True, "t2")], 10, "t1 to be let go")
    keeper.let_go("o", True, "t2")
    wait_until(lambda: keeper._thread is None, 10, "the keeper's thread to end")
    keeper.hold("o", False, "t3")                      # a new hold starts it again
    wait_until(lambda: store.renewed[-1] == [("o", False, "t3")], 10, "t3 to be renewed")
    keeper.let_go("o", False, "t3")
