"""Keeping the per-key slot leases (open streams, waiting requests) of this API process alive
while the threads that hold them live."""
from __future__ import annotations

import logging
import threading

import redis

log = logging.getLogger(__name__)

# A slot's lease in Redis. Renewed every third of it by one thread of the process, whatever
# its request thread is doing (a write blocked on a client that does not read renews nothing
# itself), so a live slot never lapses; a process that dies stops renewing, and its slots
# free themselves within this.
SLOT_LEASE_S = 15.0


class SlotKeeper:
    """Renews the leases of the slots this process holds until each is let go; its thread
    runs only while some slot is held."""

    def __init__(self, store, lease_s: float = SLOT_LEASE_S):
        self.store, self.lease_s = store, lease_s
        self._held: set[tuple[str, bool, str]] = set()   # (owner, waiting, token)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()   # never set: the renewal interval's timer

    def hold(self, owner: str, waiting: bool, token: str) -> None:
        with self._lock:
            self._held.add((owner, waiting, token))
            if self._thread is None:
                self._thread = threading.Thread(target=self._renew, name="llmq-slot-keeper",
                                                daemon=True)
                self._thread.start()

    def let_go(self, owner: str, waiting: bool, token: str) -> None:
        with self._lock:
            self._held.discard((owner, waiting, token))

    def _renew(self) -> None:
        while True:
            self._wake.wait(self.lease_s / 3)
            with self._lock:
                held = list(self._held)
                if not held:
                    self._thread = None   # the next hold starts another
                    return
            try:
                self.store.renew_slots(held, self.lease_s)
            except redis.RedisError as exc:
                # Redis is down: the streams say so themselves; the next round tries again
                # (leases outlast two missed rounds).
                log.warning("could not renew %d slot leases: %s", len(held), exc)
