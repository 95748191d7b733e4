"""The worker registry: heartbeats, what each worker runs and holds, and taking it back."""
from __future__ import annotations

import json
import time
from typing import Any

from ..keys import Keys
from ..protocol import EVENT_RESET, SequenceStatus
from .base import (UNSTARTED_KEY, WORKERS_KEY, StorePart, channel, events_key, held_key, now,
                   record_key, running_key, text_key, worker_key)
from .events import append_event, reset_data


class WorkerRegistry(StorePart):
    """Which workers live, which sequences each started or holds, and reclaiming a dead one's."""

    SCRIPTS = {"_start": "start", "_reclaim": "reclaim", "_resent": "resent"}

    def start(self, seq_id: str, worker: str, stale_s: float = 15.0,
              running: int | None = None) -> tuple[str, int]:
        """Marks a sequence running. Returns (previous status, attempt); attempt 0 = do not run.
        `running`: the attempt of it this worker's engine runs now, if any (a second message
        for it is skipped)."""
        prev, attempt = self._start(
            keys=[record_key(seq_id), WORKERS_KEY, running_key(worker), UNSTARTED_KEY,
                  text_key(seq_id)],
            args=[now(), worker, time.time() - stale_s, seq_id,
                  "" if running is None else int(running)])
        if prev == SequenceStatus.RUNNING.value and attempt:
            # A redelivered sequence restarts from scratch: readers drop what they have.
            append_event(self.r, seq_id, EVENT_RESET, reset_data(int(attempt), "worker lost"),
                         self.stream_maxlen, self.pending_ttl_s)
        return prev, int(attempt)

    def hold(self, worker: str, seq_id: str) -> None:
        """A worker received the sequence's message (before its task starts it)."""
        self.r.sadd(held_key(worker), seq_id)

    def release(self, worker: str, seq_id: str) -> None:
        """The worker's task for the sequence returned: the message is acknowledged next."""
        self.r.srem(held_key(worker), seq_id)

    def reclaim(self, worker: str, stale_s: float | None = None, held: bool = True,
                reason: str = "worker lost", sender: str | None = None) -> list[str]:
        """Sequences of a dead worker (or, with stale_s None, this worker's own): those it ran
        are put back to queued with a reset event and, with `held`, those whose message it held
        unstarted (still queued) are added. The caller queues them all again. A live worker
        handing back at shutdown leaves `held` out: its tasks still hold those messages, and
        should it die before it has queued them again, a peer finds them there. With `sender`
        (the worker that queues them again), each waits in its running set until `resent`."""
        cutoff = "force" if stale_s is None else str(time.time() - stale_s)
        return list(self._reclaim(
            keys=[running_key(worker), WORKERS_KEY, held_key(worker),
                  running_key(sender or worker), UNSTARTED_KEY],
            args=[worker, cutoff, json.dumps(reason), self.stream_maxlen, "1" if held else "0",
                  self.pending_ttl_s, "1" if sender else "0",
                  *Keys.around(record_key), *Keys.around(events_key), *Keys.around(channel),
                  *Keys.around(text_key), time.time()]))

    def resent(self, sender: str, seq_id: str) -> None:
        """A sequence `sender` took back has its new message (see reclaim)."""
        self._resent(keys=[record_key(seq_id), running_key(sender)], args=[sender, seq_id])

    def stale_workers(self, stale_s: float) -> list[str]:
        return self.r.zrangebyscore(WORKERS_KEY, "-inf", time.time() - stale_s)

    def heartbeat(self, name: str, info: dict[str, Any], ttl_s: float) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(WORKERS_KEY, {name: time.time()})
        pipe.hset(worker_key(name), mapping={k: str(v) for k, v in info.items()})
        pipe.expire(worker_key(name), max(1, int(ttl_s)))
        pipe.execute()

    def running_ids(self, name: str) -> set[str]:
        """What a worker has taken and not finished (its reclaimable sequences): started,
        received and not yet started, or taken back and not yet sent again."""
        return self.r.sunion(running_key(name), held_key(name))

    def remove_worker(self, name: str) -> None:
        self.r.zrem(WORKERS_KEY, name)
        self.r.delete(worker_key(name))

    def live_workers(self, stale_s: float) -> list[dict[str, str]]:
        """Workers whose engine stepped within stale_s seconds, with what they report."""
        names = self.r.zrangebyscore(WORKERS_KEY, time.time() - stale_s, "+inf")
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(worker_key(n))
        return [dict(info, name=n) for n, info in zip(names, pipe.execute()) if info]
