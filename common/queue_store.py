"""Where a queued sequence stands in the broker's queue, read in Redis.

Celery's Redis transport (kombu) keeps one list per queue and priority step (`<queue>` for 0,
`<queue>\\x06\\x16<p>` for 1..9), pushes on the left and pops on the right, and takes the lists
in priority order. So the sequences ahead of one are every message of a better priority plus
those to its right in its own list. Found by the task id in the message (the sequence id), in a
script that reads at most `scan` messages of its list (half from each end) and returns a count,
not the messages.
"""
from __future__ import annotations

import redis

from .store import PRIORITY_SEP
from .store.lua_scripts import register


def queue_lists(queue: str) -> list[str]:
    """The broker's lists of a queue, priority 0 first."""
    return [queue] + [f"{queue}{PRIORITY_SEP}{p}" for p in range(1, 10)]


class QueueStore:
    """Reads positions in the broker's queue."""

    def __init__(self, client: redis.Redis):
        self.r = client
        self._position = register(client, "queue_position")

    def position(self, queue: str, seq_id: str, priority: int | None, scan: int = 4096
                 ) -> int | None:
        """Messages ahead of the sequence's (of its priority or better); None when its message
        is not in the lists (a worker holds it, or it was never sent)."""
        p = min(9, max(0, priority or 0))
        ahead, found = self._position(keys=queue_lists(queue), args=[seq_id, p, scan])
        return int(ahead) if found else None
