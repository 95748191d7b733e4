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

# {ahead, found}. KEYS: the queue's lists, priority 0 first. ARGV: id, its priority, scan.
# Its own list is read from both ends at once, a chunk at a time: a sequence just queued is
# near the left (the back of the line), one about to start near the right, so a poll finds
# either in its first chunks, and one in the middle of a long list after half of it.
_POSITION = """
local p = tonumber(ARGV[2])
local ahead = 0
for i = 1, p do ahead = ahead + redis.call('LLEN', KEYS[i]) end
local list = KEYS[p + 1]
local len = redis.call('LLEN', list)
local half = math.ceil(math.min(len, tonumber(ARGV[3])) / 2)
local chunk = 32
for start = 0, half - 1, chunk do
  local size = math.min(chunk, half - start)
  local right = redis.call('LRANGE', list, -(start + size), -(start + 1))
  for j = #right, 1, -1 do
    if string.find(right[j], ARGV[1], 1, true) then return {ahead + start + #right - j, 1} end
  end
  local left = redis.call('LRANGE', list, start, start + size - 1)
  for j = 1, #left do
    if string.find(left[j], ARGV[1], 1, true) then return {ahead + len - start - j, 1} end
  end
end
return {ahead, 0}
"""


def queue_lists(queue: str) -> list[str]:
    """The broker's lists of a queue, priority 0 first."""
    return [queue] + [f"{queue}{PRIORITY_SEP}{p}" for p in range(1, 10)]


class QueueStore:
    """Reads positions in the broker's queue."""

    def __init__(self, client: redis.Redis):
        self.r = client
        self._position = client.register_script(_POSITION)

    def position(self, queue: str, seq_id: str, priority: int | None, scan: int = 4096
                 ) -> int | None:
        """Messages ahead of the sequence's (of its priority or better); None when its message
        is not in the lists (a worker holds it, or it was never sent)."""
        p = min(9, max(0, priority or 0))
        ahead, found = self._position(keys=queue_lists(queue), args=[seq_id, p, scan])
        return int(ahead) if found else None
