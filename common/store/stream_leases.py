"""A key's open SSE streams and its requests waiting for a result, each held as a lease
that its holder renews while it lives."""
from __future__ import annotations

import secrets
import time

from ..keys import Keys
from .base import StorePart, owner_streams_key


def _slots_key(owner: str, waiting: bool) -> str:
    return Keys.owner_waiting(owner) if waiting else owner_streams_key(owner)


class StreamLeases(StorePart):
    """Caps a key's open SSE streams (expired leases, left by a dead API process, free)."""

    SCRIPTS = {"_open_stream": "open_stream"}

    def open_stream(self, owner: str, cap: int, lease_s: float,
                    waiting: bool = False) -> str | None:
        """Takes one of a key's `cap` stream slots (with `waiting`: slots of requests waiting
        for their result) for `lease_s` seconds (renew it with renew_stream while the stream
        lives); returns its token, or None when all are taken."""
        token, t = secrets.token_hex(8), time.time()
        ok = self._open_stream(keys=[_slots_key(owner, waiting)],
                               args=[t, t + lease_s, cap, token])
        return token if ok else None

    def renew_stream(self, owner: str, token: str, lease_s: float) -> None:
        self.r.zadd(owner_streams_key(owner), {token: time.time() + lease_s}, xx=True)

    def close_stream(self, owner: str, token: str, waiting: bool = False) -> None:
        self.r.zrem(_slots_key(owner, waiting), token)
