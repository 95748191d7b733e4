"""The Celery app of the worker, and the signals that build and stop its engine.

`celery -A worker.celery_app worker -P threads -c <task threads>` names this module. The threads
pool never forks (CUDA cannot survive a fork); its concurrency is the engine's batch size plus a
quarter (scripts/worker.sh), so with prefetch 1 a worker reserves what its running batch can
take and a few more: with API keys, those let another key's sequence reach the workload
manager's fair share while one key fills the batch.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import threading

from celery import Celery, signals

from common import logs
from common.celery_config import celery_config
from common.protocol import GENERATE_TASK
from common.settings import Settings
from common.test_hooks import HarnessHooks

log = logging.getLogger("llmq.worker")


def create_celery(settings: Settings) -> Celery:
    app = Celery("llmq", include=["worker.tasks", "worker.batch_runner", "worker.webhooks"])
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

        def requeue(seq_id: str, priority: int | None = None) -> None:
            celery.send_task(GENERATE_TASK, args=[seq_id], task_id=seq_id,
                             queue=queue_of(settings, store, seq_id), priority=priority)

        # The test harness's hooks where it installed them (LLMQ_TEST_HOOKS=1), else none.
        engine = EngineCore(name, settings, store, executor, tokenizer, requeue=requeue,
                            hooks=HarnessHooks.from_env())
        engine.start()
    except BaseException:
        executor.stop(timeout_s=2.0)
        raise
    return engine


def queue_of(settings: Settings, store, seq_id: str) -> str:
    """The queue of a sequence sent again: its model's (a reaped or reconciled one may be
    another model's). With one model there is one queue, and nothing to read."""
    models = settings.served_models()
    if len(models) == 1:
        return models[0].queue
    rec = store.get_record(seq_id, text=False) or {}
    return (settings.resolve_model(rec.get("model") or None) or settings.served_model).queue


# A worker serves one model: LLMQ_SERVE_MODEL's (docs/deployment.md).
celery = create_celery(Settings.from_env().for_served_model())


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _json_logs(logger=None, **_kw):
    if logger is not None and os.environ.get("LLMQ_LOG_FORMAT", "json") == "json":
        logs.use_json(logger.handlers, "worker")


def serves_generation(worker, settings: Settings) -> bool:
    """Whether a Celery worker takes generation tasks (its --queues name the generation queue):
    a delivery worker (scripts/delivery.sh, the webhook queue alone) has no engine and no
    model."""
    return worker is None or settings.served_model.queue in worker.app.amqp.queues.consume_from


@signals.worker_init.connect
def _start_engine(sender=None, **_kw):
    app = sender.app if sender is not None else celery
    if not serves_generation(sender, app.llmq_settings):
        log.info("a delivery worker (no engine): queues %s",
                 ", ".join(sender.app.amqp.queues.consume_from))
        return
    name = getattr(sender, "hostname", None) or f"llmq@{socket.gethostname()}-{os.getpid()}"
    log.info("starting engine %s", name)
    try:
        app.llmq_engine = build_engine(app.llmq_settings, name)
    except Exception:  # noqa: BLE001 - a worker without an engine must not take tasks
        log.critical("engine failed to start; exiting", exc_info=True)
        os._exit(3)


@signals.task_received.connect
def _hold_message(request=None, **_kw):
    """A sequence's message is this worker's from the moment it arrives, before its task thread
    starts the sequence: recorded, so that if the worker dies in between a peer sends it again
    (otherwise it would wait in kombu's unacked hash for the whole visibility timeout). Only
    the generate task's: no other task's id names a sequence to send again."""
    engine = celery.llmq_engine
    # request.type is the task's real name (request.name is the shadow: llmq.batch_line)
    if engine is not None and request is not None and request.type == GENERATE_TASK:
        engine.store.hold(engine.name, request.id)


@signals.task_postrun.connect
def _release_message(task_id=None, task=None, **_kw):
    engine = celery.llmq_engine
    if engine is not None and task_id and getattr(task, "name", None) == GENERATE_TASK:
        engine.store.release(engine.name, task_id)


# How long a warm shutdown may run past the grace (the hand-back, the pool's join, the engine's
# and Celery's own stop) before the worker leaves without them: a Redis that hangs instead of
# refusing can hold any of those calls, and nothing else bounds them.
SHUTDOWN_OVERRUN_S = 20.0


@signals.worker_shutting_down.connect
def _drain_engine(sig=None, how=None, **_kw):
    """SIGTERM (warm shutdown): Celery stops taking messages and waits for running tasks; the
    engine lets its batch finish within the grace period, then hands the rest back. The whole
    shutdown is bounded: past the grace + SHUTDOWN_OVERRUN_S the process exits at once."""
    engine = celery.llmq_engine
    if engine is not None and how != "Cold":
        grace_s = celery.llmq_settings.shutdown_grace_s
        threading.Thread(target=engine.drain, args=(grace_s,), name="llmq-drain",
                         daemon=True).start()
        deadline = threading.Timer(grace_s + SHUTDOWN_OVERRUN_S, _exit_now, args=(engine,))
        deadline.daemon = True
        deadline.start()


def _exit_now(engine) -> None:
    """The shutdown overran its bound: unacknowledged messages and `running` records are left
    for kombu and the reaper, as after a crash."""
    log.critical("shutdown still running %.0f s after the grace (redis or the broker not "
                 "answering?); exiting without finishing it", SHUTDOWN_OVERRUN_S)
    if engine.executor.pid:
        try:
            os.kill(engine.executor.pid, signal.SIGKILL)
        except OSError:
            pass
    os._exit(1)   # each log record is flushed as written


@signals.worker_shutdown.connect
def _stop_engine(sender=None, **_kw):
    engine = celery.llmq_engine
    if engine is not None:
        engine.stop()
        celery.llmq_engine = None
        # Celery has nothing left to do after this signal, and the interpreter's own teardown
        # (garbage-collecting torch and the tokenizer) took ~5 s of every stop: run the exit
        # hooks (log flushing, pid files), then leave without it.
        atexit._run_exitfuncs()
        os._exit(getattr(sender, "exitcode", None) or 0)
