"""A key's open SSE streams and its requests waiting for a result, each held as a lease
that its holder renews while it lives."""
from __future__ import annotations

import secrets
import time
from typing import Iterable

from ..keys import Keys
from .base import StorePart, owner_streams_key


def _slots_key(owner: str, waiting: bool) -> str:
    return Keys.owner_waiting(owner) if waiting else owner_streams_key(owner)


class StreamLeases(StorePart):
    """Caps a key's open SSE streams (expired leases, left by a dead API process, free)."""

    SCRIPTS = {"_open_stream": "open_stream", "_renew_slots": "renew_slots"}

    def open_stream(self, owner: str, cap: int, lease_s: float,
                    waiting: bool = False) -> str | None:
        """Takes one of a key's `cap` stream slots (with `waiting`: slots of requests waiting
        for their result) for `lease_s` seconds (renew it with renew_slots while the stream
        lives); returns its token, or None when all are taken."""
        token, t = secrets.token_hex(8), time.time()
        ok = self._open_stream(keys=[_slots_key(owner, waiting)],
                               args=[t, t + lease_s, cap, token])
        return token if ok else None

    def renew_slots(self, slots: Iterable[tuple[str, bool, str]], lease_s: float) -> None:
        """Gives each (owner, waiting, token) a lease of `lease_s` from now, in one round trip;
        slots closed meanwhile stay closed."""
        by_key: dict[str, list[str]] = {}
        for owner, waiting, token in slots:
            by_key.setdefault(_slots_key(owner, waiting), []).append(token)
        if not by_key:
            return
        t = time.time()
        pipe = self.r.pipeline(transaction=False)
        for key, tokens in by_key.items():
            self._renew_slots(keys=[key], args=[t, t + lease_s, *tokens], client=pipe)
        pipe.execute()

    def close_stream(self, owner: str, token: str, waiting: bool = False) -> None:
        self.r.zrem(_slots_key(owner, waiting), token)
