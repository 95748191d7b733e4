"""Queue visibility on a job or response: where a queued one stands (`queue_position`: the
sequences of its priority or better ahead of it in the broker's queue, across workers) and
when it may start (`estimated_start_s`, from the service's recent rate), and for a finished
one how it went (`metrics`: queue_s, ttft_s, tokens_per_s, attempts), from its record and the
times of its stored stream entries (a stream entry's id is its time in milliseconds).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from flask import current_app

from common.protocol import EVENT_RESET, EVENT_TOKEN, SequenceStatus
from common.queue_store import QueueStore

RATE_WINDOW_S = 120.0   # the service rate is measured over at most this much of the past
RATE_MIN_S = 5.0        # and at least this much (before that, no estimate)


class ServiceRate:
    """Sequences finished per second by the live workers, lately: samples of their
    `num_finished` counters (reported with each heartbeat) kept in this API process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, dict[str, float]]] = deque()

    def per_second(self, workers: list[dict[str, str]]) -> float | None:
        now = time.monotonic()
        counts = {w["name"]: float(w.get("num_finished") or 0) for w in workers}
        with self._lock:
            while self._samples and now - self._samples[0][0] > RATE_WINDOW_S:
                self._samples.popleft()
            if not self._samples or now - self._samples[-1][0] >= 1.0:
                self._samples.append((now, counts))
            then, old = self._samples[0]
        if now - then < RATE_MIN_S:
            return None
        done = 0.0
        for name, n in counts.items():
            before = old.get(name, 0.0)
            done += n - before if n >= before else n   # (a restarted worker counts from 0)
        return done / (now - then)


def annotate(obj: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """`obj` (the job itself, or the response made of it) with its queue figures added."""
    status = SequenceStatus(job["status"])
    if status == SequenceStatus.QUEUED:
        obj["queue_position"], obj["estimated_start_s"] = _position(job["id"], job.get("model"))
    elif status.is_finished:
        obj["metrics"] = _metrics(job)
    return obj


def _position(seq_id: str, model: str | None) -> tuple[int, float | None]:
    """Its place in its model's queue, and that model's workers' recent rate."""
    ext = current_app.extensions["llmq"]
    s, store = ext["settings"], ext["store"]
    served = s.resolve_model(model) or s.served_models()[0]
    queue = ext.setdefault("queue_store", store.beside(QueueStore))
    ahead = queue.position(served.queue, seq_id, store.priority_of(seq_id), scan=s.max_queued)
    ahead = ahead or 0   # (not in the lists: a worker holds its message; it starts next)
    workers = store.live_workers(s.worker_stale_s)
    if len(s.served_models()) > 1:
        workers = [w for w in workers if (w.get("model_name") or s.served_models()[0].name)
                   == served.name]
    rate = ext.setdefault("service_rate", {}).setdefault(
        served.name, ServiceRate()).per_second(workers)
    return ahead, (round(ahead / rate, 1) if rate else None)


def _metrics(job: dict[str, Any]) -> dict[str, Any]:
    store = current_app.extensions["llmq"]["store"]
    rec = store.get_record(job["id"], text=False) or {}   # (its attempts only)
    attempts = int(rec.get("attempts") or 0)
    created, started, finished = job.get("created_at"), job.get("started_at"), \
        job.get("finished_at")
    first = _first_token_at(store, job["id"], attempts) if started else None
    tokens = job["usage"]["completion_tokens"]
    return {
        "queue_s": _span(created, started),
        "ttft_s": _span(created, first),
        "tokens_per_s": (round(tokens / (finished - started), 2)
                         if started and finished and finished > started and tokens else None),
        "attempts": attempts,
    }


def _span(a: float | None, b: float | None) -> float | None:
    return round(max(0.0, b - a), 3) if a is not None and b is not None else None


def _first_token_at(store, seq_id: str, attempts: int) -> float | None:
    """The time of the first token of the run that finished: the first token entry after the
    last reset (one entry read for a sequence that ran once)."""
    after, found = "0-0", None
    while True:
        entries = store.read_events(seq_id, after, count=1 if attempts <= 1 else 512)
        if not entries:
            return found
        for entry_id, kind, _data in entries:
            if kind == EVENT_RESET:
                found = None
            elif kind == EVENT_TOKEN and found is None:
                found = int(entry_id.partition("-")[0]) / 1000
        if attempts <= 1:
            return found
        after = entries[-1][0]
