"""StreamHub: one reader per API process that tails every open stream's events in one XREAD.

An SSE response (OpenAI streaming, /v1/jobs/<id>/events, a waiting /v1/generate) follows its
sequences' Redis event streams. Each doing its own blocking XREAD cost one round trip per token
per stream: at 64 streams that was 64 XREADs per engine step, ~130 us of the API's CPU per
token, on machines where the model shares the cores with the API (CPU the API takes is
taken from the model's step). The hub's one
thread reads all of them with one XREAD (~5-30 us per token) and hands each subscription its
entries.

A new subscription wakes the reader out of its blocking XREAD with CLIENT UNBLOCK, so that its
first token waits for nothing (where that fails, for at most the reader's one-second block).
A subscriber that stops reading has its entries kept here, as many as its sequences have (what
Redis keeps of them anyway).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from redis.exceptions import RedisError

from common.store import SequenceStore, valid_stream_id

log = logging.getLogger("llmq.api.streams")

Event = tuple[str, str, str, dict[str, Any]]   # (seq_id, entry_id, kind, data)


def _after(a: str, b: str) -> bool:
    """Whether stream id a comes after b ("ms-seq")."""
    am, _, asq = a.partition("-")
    bm, _, bsq = b.partition("-")
    return (int(am), int(asq or 0)) > (int(bm), int(bsq or 0))


class Subscription:
    """One response's view of the hub: the entries after its positions, as they arrive."""

    def __init__(self, hub: "StreamHub", positions: dict[str, str]):
        self._hub = hub
        self.positions = dict(positions)   # seq_id -> the last entry handed out (or given)
        self._ready: list[Event] = []
        self._error: Exception | None = None
        self._cond = threading.Condition(hub._lock)   # its own: a delivery wakes its reader only

    def read(self, timeout_s: float) -> list[Event]:
        """The entries that arrived since the last read, waiting up to timeout_s for one; []
        when none came. Raises the reader's Redis error, as a direct XREAD would."""
        return self._hub._take(self, timeout_s)

    def drop(self, seq_id: str) -> None:
        """Stops following one sequence (its done event came)."""
        with self._hub._lock:
            self.positions.pop(seq_id, None)

    def close(self) -> None:
        self._hub._unsubscribe(self)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StreamHub:
    """Reads the event streams of every open subscription of this process with one XREAD."""

    BLOCK_MS = 1000   # the reader's XREAD block: a new subscription unblocks it, else at most this
    WAKE_S = 1.0      # how long a new subscription tries to unblock the reader
    COUNT = 512       # entries per stream per read

    def __init__(self, store: SequenceStore):
        self.store = store
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)        # the reader waits for subscriptions
        self._seen_cond = threading.Condition(self._lock)   # a subscriber for the reader to see it
        self._subs: set[Subscription] = set()
        self._pid: int | None = None     # the process the reader thread runs in (gunicorn forks)
        self._thread: threading.Thread | None = None
        self._gen = 0                    # bumped by each new subscription
        self._seen = 0                   # the generation the reader's next XREAD includes
        # The reader's dedicated store: its client_id() is the connection's current id (redis-py
        # may reconnect inside the XREAD and retry it under a new one).
        self._reader: SequenceStore | None = None

    def subscribe(self, positions: dict[str, str]) -> Subscription:
        """A subscription to these sequences' entries after these ids (close it when done).
        ValueError for a position that is not a stream id: one would fail the XREAD that
        every other subscription shares."""
        if bad := [p for p in positions.values() if not valid_stream_id(p)]:
            raise ValueError(f"not a stream id: {bad[0]!r}")
        sub = Subscription(self, positions)
        with self._lock:
            self._ensure_reader()
            self._subs.add(sub)
            self._gen += 1
            gen = self._gen
            self._cond.notify_all()
        self._wake(gen)
        return sub

    # --- the subscriptions' side --------------------------------------------------------------
    def _take(self, sub: Subscription, timeout_s: float) -> list[Event]:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not sub._ready and sub._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                sub._cond.wait(left)
            if sub._ready:   # (entries read after an error: the reader recovered, go on)
                ready, sub._ready, sub._error = sub._ready, [], None
                return ready
            err, sub._error = sub._error, None
        # A copy per subscriber, the reader's as its cause: one exception object raised in
        # many threads would chain all their frames onto one traceback.
        try:
            copy = type(err)(*err.args)
        except Exception:   # noqa: BLE001 - a constructor that wants other arguments
            copy = RedisError(f"{type(err).__name__}: {err}")
        raise copy from err

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    def _wake(self, gen: int) -> None:
        """Gets the reader to include generation `gen` in its XREAD: unblocks it until it has
        taken it in (a CLIENT UNBLOCK sent just before it blocks would be lost). Gives up
        after WAKE_S (a reconnecting reader): its block ends within BLOCK_MS anyway."""
        deadline = time.monotonic() + self.WAKE_S
        while time.monotonic() < deadline:
            with self._lock:
                if self._seen >= gen or self._pid != os.getpid():
                    return
                reader = self._reader
            if reader is not None:
                try:
                    self.store.unblock_client(reader.client_id())
                except RedisError:
                    return   # the reader sees the error too, and retries
            with self._lock:
                if self._seen < gen:
                    self._seen_cond.wait(0.002)

    # --- the reader ---------------------------------------------------------------------------
    def _ensure_reader(self) -> None:
        """Starts the reader thread in this process if it has none running (a fork's copy of the
        hub has no thread; a reader that died is replaced)."""
        if self._pid == os.getpid() and self._thread is not None and self._thread.is_alive():
            return
        if self._pid != os.getpid():
            self._subs = set()
        self._pid, self._reader, self._seen = os.getpid(), None, self._gen
        self._thread = threading.Thread(target=self._run, name="llmq-stream-hub", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn = None
        while True:
            with self._lock:
                while True:   # (a subscription whose sequences are all done follows nothing)
                    self._seen = self._gen
                    self._seen_cond.notify_all()
                    positions = self._positions()
                    if positions:
                        break
                    self._cond.wait()
            try:
                if conn is None:
                    conn = self.store.dedicated()
                    with self._lock:
                        self._reader = conn
                events = conn.read_events_many(positions, block_ms=self.BLOCK_MS,
                                               count=self.COUNT)
                if events:
                    self._deliver(events, positions)
            except Exception as err:   # noqa: BLE001 - Redis down, or a bug: tell them, go on
                self._fail(err)
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.5)   # a restarting server: try again, the subscribers see it

    def _positions(self) -> dict[str, str]:
        """Each followed sequence's earliest position over the subscriptions."""
        out: dict[str, str] = {}
        for sub in self._subs:
            for seq_id, after in sub.positions.items():
                if seq_id not in out or _after(out[seq_id], after):
                    out[seq_id] = after
        return out

    def _deliver(self, events: list[Event], read_from: dict[str, str]) -> None:
        """Hands each subscription the entries after its position. A subscription that is
        behind the position this XREAD read from (it came with an earlier one while the read
        was under way) gets nothing of that sequence now: the next XREAD reads from its
        position, so it misses none."""
        by_seq: dict[str, list[Event]] = {}
        for ev in events:
            by_seq.setdefault(ev[0], []).append(ev)
        with self._lock:
            for sub in self._subs:
                got = False
                for seq_id in by_seq.keys() & sub.positions.keys():
                    evs, at = by_seq[seq_id], sub.positions[seq_id]
                    if _after(read_from[seq_id], at):
                        continue
                    # (in order: skip what this one had, when another read from further back)
                    first = next((i for i, ev in enumerate(evs) if _after(ev[1], at)), None)
                    if first is not None:
                        sub._ready.extend(evs[first:])
                        sub.positions[seq_id] = evs[-1][1]
                        got = True
                if got:
                    sub._cond.notify()

    def _fail(self, err: Exception) -> None:
        if isinstance(err, (RedisError, OSError)):
            log.warning("stream reader: %s: %s", type(err).__name__, err)
        else:
            log.exception("stream reader failed")
        with self._lock:
            for sub in self._subs:
                sub._error = err
                sub._cond.notify()
            self._reader = None
