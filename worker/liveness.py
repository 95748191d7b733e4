"""Liveness: this worker's heartbeat, and taking back what dead workers were running."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator

from common.store import SequenceStore

from .reconciler import Reconciler

log = logging.getLogger("llmq.engine")


class Liveness:
    """Heart-beats while the engine advances and, once it has beaten steadily itself, reaps
    workers whose heartbeat stopped (their running sequences go back to the queue) and runs
    the reconciler (sequences whose message the broker lost go back too)."""

    def __init__(self, name: str, settings, store: SequenceStore, stats: Callable[[], dict],
                 requeue: Callable[..., None], stop: threading.Event,
                 reconciler: Reconciler | None = None):
        self.name = name
        self.reconciler = reconciler
        self.settings = settings
        self.store = store
        self.stats = stats
        self.requeue = requeue
        self._stop = stop
        self._progress = time.monotonic()
        self._step_started: float | None = None
        self._beating_since: float | None = None   # start of the current run of good beats
        # Taken back and not yet marked sent, in order: True once its new message is sent
        # (then only the running set's mark is left to write).
        self._unsent: dict[str, bool] = {}

    def start(self) -> None:
        threading.Thread(target=self._beat_loop, name="llmq-heartbeat", daemon=True).start()
        self.beat()

    def take_back_own(self) -> None:
        """Whatever this worker name was running before a crash is ours to run again (and what
        its previous run took back from dead workers and had not sent again yet)."""
        self._send_again(self.store.reclaim(self.name, sender=self.name),
                         "re-queueing a sequence lost by this worker's previous run")

    def _send_again(self, taken: list[str], why: str = "", *args) -> None:
        """Sends a new message for each sequence taken back (and each an earlier call could not
        send), in order. Each stays in this worker's running set until its message is sent: a
        send that fails (the broker away) leaves the rest there, for this worker's next reap,
        or for whoever takes its sequences back should it die first."""
        for seq_id in taken:
            log.warning(why, *args, extra={"seq_id": seq_id})
            self._unsent.setdefault(seq_id, False)
        for seq_id, sent in list(self._unsent.items()):
            if not sent:
                self.requeue(seq_id)
                self._unsent[seq_id] = True
            # A Redis error here is retried with the next call, without a second message (the
            # id left in the running set had a later reap of this name send it once more).
            self.store.resent(self.name, seq_id)
            del self._unsent[seq_id]

    # --- what the engine reports ----------------------------------------------------------------
    def progress(self) -> None:
        """The loop turned (or published): it is alive."""
        self._progress = time.monotonic()

    def step_started(self) -> None:
        """A model step (or a model restart) began: progress for up to LLMQ_MAX_STEP."""
        self._step_started = time.monotonic()

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        self.step_started()
        try:
            yield
        finally:
            self._step_started = None

    def advancing(self) -> bool:
        """The loop turned recently, or a step is in flight for less than LLMQ_MAX_STEP (a long
        prefill is progress; a hang is not)."""
        now = time.monotonic()
        in_step = self._step_started is not None and (
            now - self._step_started < self.settings.max_step_s)
        return in_step or now - self._progress < self.settings.worker_stale_s / 2

    # --- the heartbeat --------------------------------------------------------------------------
    def _beat_loop(self) -> None:
        """A stuck engine goes silent: /readyz turns red and other workers reclaim its work."""
        while not self._stop.wait(self.settings.worker_heartbeat_s):
            if self.advancing():
                self.beat()
            else:
                self._beating_since = None

    def beat(self) -> None:
        try:
            self.store.heartbeat(self.name, self.stats(), ttl_s=self.settings.worker_stale_s * 4)
        except Exception as exc:  # noqa: BLE001 - Redis hiccup: try again next beat
            self._beating_since = None
            log.warning("heartbeat failed: %s", exc)
            return
        # Judge others dead only after beating without a gap for LLMQ_WORKER_STALE ourselves:
        # after a Redis outage (or a pause of this engine) every heartbeat in Redis is old, and
        # the first worker back would otherwise take its live peers' sequences from them.
        now = time.monotonic()
        if self._beating_since is None:
            self._beating_since = now
        if now - self._beating_since >= self.settings.worker_stale_s:
            try:
                self.reap_dead_workers()
            except Exception as exc:  # noqa: BLE001 - Redis hiccup: try again next beat
                log.warning("reaping failed: %s", exc)
            if self.reconciler is not None and self.reconciler.due():
                try:
                    self.reconciler.run()
                except Exception as exc:  # noqa: BLE001 - Redis or the broker: next pass
                    log.warning("reconciling failed: %s", exc)

    def reap_dead_workers(self) -> None:
        """Takes back what workers that stopped heart-beating were running (after sending what
        an earlier reap took back and could not send)."""
        self._send_again([])
        for name in self.store.stale_workers(self.settings.worker_stale_s):
            if name != self.name:
                self._send_again(
                    self.store.reclaim(name, self.settings.worker_stale_s, sender=self.name),
                    "re-queueing a sequence of dead worker %s", name)
