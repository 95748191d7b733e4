"""What the batch driver and the webhook sender share inside a worker: the Redis stores, an
API-side engine to submit sequences with, and background loops that end with the worker.

Built once per Celery app (`services(app)`), on the engine's own Redis client when the worker
has one.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from common.batch_store import BatchStore
from common.file_store import FileStore
from common.reconcile_store import ReconcileStore
from common.store import SequenceStore, queue_lists
from common.webhook_store import WEBHOOK_TASK, WebhookStore

from .batch_shares import DriverSlots

log = logging.getLogger("llmq.worker")
_lock = threading.Lock()

# Batch drivers run in the worker's task threads, the ones its sequences need: at most this
# many at once per worker, so that batches can never hold every thread while their lines wait
# for one (more drivers would add nothing: LLMQ_BATCH_MAX_INFLIGHT bounds all batches' lines).
# Keys share them (worker/batch_shares.py).
MAX_DRIVERS = 2


@dataclass
class Services:
    """The stores and clients of one worker's batch and webhook work."""

    settings: object
    celery: object
    sequences: SequenceStore
    files: FileStore
    batches: BatchStore
    webhooks: WebhookStore
    reconcile: ReconcileStore
    stopping: threading.Event = field(default_factory=threading.Event)
    driver_slots: DriverSlots | None = None

    def __post_init__(self):
        if self.driver_slots is None:
            self.driver_slots = DriverSlots(MAX_DRIVERS, self.settings.batch_driver_slice_s)

    def submitter(self):
        """The API's engine (admission control, records, send_task), for batch lines."""
        from common.llm_engine import LLMEngine

        return LLMEngine(self.settings, self.sequences, BatchLineSender(self.celery))

    def send_delivery(self, event_id: str) -> None:
        """Queues one webhook event's delivery task (under the event's id, on every send), on
        the delivery workers' queue (common/celery_config.py's task_routes)."""
        self.celery.send_task(WEBHOOK_TASK, args=[event_id], task_id=event_id, priority=0)


class BatchLineSender:
    """Sends the generate task as batch lines are sent: the same task, shown in Flower and in
    the worker's logs as `llmq.batch_line` (Celery's `shadow` name)."""

    NAME = "llmq.batch_line"

    def __init__(self, celery):
        self.celery = celery

    def send_task(self, name: str, **options):
        return self.celery.send_task(name, shadow=self.NAME, **options)


def services(app) -> Services:
    with _lock:
        svc = getattr(app, "llmq_services", None)
        if svc is None:
            s = app.llmq_settings
            engine = getattr(app, "llmq_engine", None)
            seqs = engine.store if engine is not None else SequenceStore.from_settings(s)
            svc = Services(s, app, seqs, seqs.beside(FileStore, s.file_ttl_s),
                           seqs.beside(BatchStore, s.file_ttl_s),
                           seqs.beside(WebhookStore, s.pending_ttl_s),
                           seqs.beside(ReconcileStore, queue_lists(s.webhook_queue)))
            app.llmq_services = svc
        return svc


def start_loop(svc: Services, name: str, interval_s: float, fn: Callable[[], None]) -> None:
    """Runs fn every interval_s in a daemon thread until the worker stops; an error (Redis
    restarting) is logged and the loop goes on."""
    def loop():
        while not svc.stopping.wait(interval_s):
            try:
                fn()
            except Exception:  # noqa: BLE001 - see above
                log.warning("%s failed; retrying", name, exc_info=True)

    threading.Thread(target=loop, name=name, daemon=True).start()
