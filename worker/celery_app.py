"""The Celery app of the worker, and the signals that build and stop its engine.

`celery -A worker.celery_app worker -P threads -c <max_num_seqs>` names this module. The threads
pool never forks (CUDA cannot survive a fork); its concurrency equals the engine's batch size,
so with prefetch 1 a worker reserves only what its running batch can take.
"""
from __future__ import annotations

import logging
import os
import socket

from celery import Celery, signals

from common import logs
from common.celery_config import celery_config
from common.settings import Settings

log = logging.getLogger("llmq.worker")


def create_celery(settings: Settings) -> Celery:
    app = Celery("llmq", include=["worker.tasks"])
    app.conf.update(celery_config(settings))
    app.llmq_settings = settings
    app.llmq_engine = None
    return app


def build_engine(settings: Settings, name: str):
    """Builds the worker's heavy objects once, in order: weights on disk, tokenizer, store,
    model process (loaded and warmed up), then the engine loop."""
    from common.store import SequenceStore

    from .engine_core import EngineCore
    from .model_executor import ModelExecutor
    from .model_manager import ModelManager

    manager = ModelManager.from_settings(settings)
    manager.resolve()
    tokenizer = manager.load_tokenizer()
    store = SequenceStore.from_settings(settings)
    engine = EngineCore(name, settings, store, ModelExecutor(settings), tokenizer)
    engine.start()
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


@signals.worker_shutdown.connect
def _stop_engine(sender=None, **_kw):
    engine = celery.llmq_engine
    if engine is not None:
        engine.stop()
        celery.llmq_engine = None
