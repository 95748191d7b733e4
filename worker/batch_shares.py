"""How batches of different keys share: a worker's batch driver slots, and the batch lines in
flight over all workers (LLMQ_BATCH_MAX_INFLIGHT). Without these rules one key's two long
batches held every driver slot and every line in flight, and other keys' batches waited for
up to their completion window (issue 48)."""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field


def line_room(max_inflight: int, owner: str, inflight: dict[str, int],
              wanting: set[str]) -> int:
    """Lines a batch of `owner` may queue now: what `max_inflight` leaves over every batch's
    lines in flight (`inflight`, by key), and no more than the key's equal share of it (rounded
    up) while batches of other keys (`wanting`) have lines left to send. A key alone takes all
    of it; a key whose batches have sent every line leaves its share to the others."""
    share = -(-max_inflight // len(wanting | {owner}))
    return min(max_inflight - sum(inflight.values()), share - inflight.get(owner, 0))


@dataclass(eq=False)
class DriverSlot:
    """One running driver's slot: its key, since when, and whether it is asked to give way."""

    owner: str
    since: float
    give_way: threading.Event = field(default_factory=threading.Event)


class DriverSlots:
    """A worker's batch driver slots, shared by key. A free slot goes to whoever asks. When
    they are all taken, a driver of a key below its share (the slots split evenly between the
    keys holding or asking, at least one each) asks a driver of the key furthest above its
    share to give way; a key that holds none asks the driver that has run longest, once it has
    run `slice_s` (keys outnumber slots: they take turns). The asker waits up to `wait_s` for
    the slot (a driver gives way between two of its steps, handing its batch back to be driven
    again later); whoever asks meanwhile finds no free slot."""

    def __init__(self, size: int, slice_s: float, wait_s: float = 5.0, clock=time.monotonic):
        self.size, self.slice_s, self.wait_s, self.clock = size, slice_s, wait_s, clock
        self.held: list[DriverSlot] = []
        self.waiting = 0
        self._cond = threading.Condition()

    def acquire(self, owner: str) -> DriverSlot | None:
        """A slot for a driver of `owner`'s batch; None: none now (its batch is due again
        later)."""
        with self._cond:
            if len(self.held) + self.waiting < self.size:
                return self._take(owner)
            victim = self._victim(owner)
            if victim is None:
                return None
            victim.give_way.set()
            self.waiting += 1
            try:
                if not self._cond.wait_for(lambda: len(self.held) < self.size, self.wait_s):
                    return None
                return self._take(owner)
            finally:
                self.waiting -= 1

    def release(self, slot: DriverSlot) -> None:
        with self._cond:
            self.held.remove(slot)
            self._cond.notify_all()

    def _take(self, owner: str) -> DriverSlot:
        slot = DriverSlot(owner, self.clock())
        self.held.append(slot)
        return slot

    def _victim(self, owner: str) -> DriverSlot | None:
        """The driver that gives `owner` its slot, if any (those already giving way count as
        gone)."""
        staying = [s for s in self.held if not s.give_way.is_set()]
        counts = Counter(s.owner for s in staying)
        share = max(1, self.size // len(set(counts) | {owner}))
        if counts[owner] >= share:
            return None
        over = [o for o, n in counts.items() if n > share]
        if over:
            worst = max(over, key=counts.__getitem__)
            return next(s for s in reversed(staying) if s.owner == worst)
        if counts[owner]:
            return None
        oldest = min(staying, key=lambda s: s.since, default=None)
        if oldest is not None and self.clock() - oldest.since >= self.slice_s:
            return oldest
        return None
