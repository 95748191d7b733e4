"""The Celery app of the worker, and the signals that build and stop its engine.

`celery -A worker.celery_app worker -P threads -c <max_num_seqs>` names this module. The threads
pool never forks (CUDA cannot survive a fork); its concurrency equals the engine's batch size,
so with prefetch 1 a worker reserves only what its running batch can take.
"""
from __future__ import annotations

import logging
import os
import socket
import threading

from celery import Celery, signals

from common import logs
from common.celery_config import celery_config
from common.protocol import GENERATE_TASK
from common.settings import Settings

log = logging.getLogger("llmq.worker")


def create_celery(settings: Settings) -> Celery:
    app = Celery("llmq", include=["worker.tasks"])
    app.conf.update(celery_config(settings))
    app.llmq_settings = settings
    app.llmq_engine = None
    return app


def build_engine(settings: Settings, name: str):
    """Builds the worker's heavy objects once, in order: weights on disk, the model process
    (launched: it loads while this process loads the tokenizer), tokenizer, store, then the
    engine loop, which starts once the model process is loaded and warmed up."""
    from common.store import SequenceStore

    from .engine_core import EngineCore
    from .model_executor import ModelExecutor
    from .model_manager import ModelManager

    manager = ModelManager.from_settings(settings)
    manager.resolve()
    executor = ModelExecutor(settings)
    executor.launch()
    try:
        tokenizer = manager.load_tokenizer()
        store = SequenceStore.from_settings(settings)

        def requeue(seq_id: str) -> None:
            celery.send_task(GENERATE_TASK, args=[seq_id], task_id=seq_id, queue=settings.queue)

        engine = EngineCore(name, settings, store, executor, tokenizer, requeue=requeue)
        engine.start()
    except BaseException:
        executor.stop(timeout_s=2.0)
        raise
    return engine


celery = create_celery(Settings.from_env())


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _json_logs(logger=None, **_kw):
    if logger is not None and os.environ.get("LLMQ_LOG_FORMAT", "json") == "json":
        logs.use_json(logger.handlers, "worker")


@signals.worker_init.connect
def _start_engine(sender=None, **_kw):
    app = sender.app if sender is not None else celery
    name = getattr(sender, "hostname", None) or f"llmq@{socket.gethostname()}-{os.getpid()}"
    log.info("starting engine %s", name)
    try:
        app.llmq_engine = build_engine(app.llmq_settings, name)
    except Exception:  # noqa: BLE001 - a worker without an engine must not take tasks
        log.critical("engine failed to start; exiting", exc_info=True)
        os._exit(3)


@signals.task_received.connect
def _hold_message(request=None, **_kw):
    """A message is this worker's from the moment it arrives, before its task thread starts the
    sequence: recorded, so that if the worker dies in between a peer sends it again (otherwise
    it would wait in kombu's unacked hash for the whole visibility timeout)."""
    engine = celery.llmq_engine
    if engine is not None and request is not None:
        engine.store.hold(engine.name, request.id)


@signals.task_postrun.connect
def _release_message(task_id=None, **_kw):
    engine = celery.llmq_engine
    if engine is not None and task_id:
        engine.store.release(engine.name, task_id)


@signals.worker_shutting_down.connect
def _drain_engine(sig=None, how=None, **_kw):
    """SIGTERM (warm shutdown): Celery stops taking messages and waits for running tasks; the
    engine lets its batch finish within the grace period, then hands the rest back."""
    engine = celery.llmq_engine
    if engine is not None and how != "Cold":
        threading.Thread(target=engine.drain, args=(celery.llmq_settings.shutdown_grace_s,),
                         name="llmq-drain", daemon=True).start()


@signals.worker_shutdown.connect
def _stop_engine(sender=None, **_kw):
    engine = celery.llmq_engine
    if engine is not None:
        engine.stop()
        celery.llmq_engine = None
