"""The worker's Celery signal hooks (worker/celery_app.py), fired through Celery's own signals
with real task requests, on fakeredis: only the generate task's messages are recorded as held
(`llmq:held:<worker>`), batch lines (the same task under a shadow name) included."""
from __future__ import annotations

from types import SimpleNamespace

import fakeredis
import pytest
from celery import signals
from celery.contrib.testing.mocks import TaskMessage
from celery.worker.request import Request

from common.protocol import GENERATE_TASK
from common.store import SequenceStore, held_key


@pytest.fixture
def worker_app():
    from worker import batch_runner, tasks, webhooks  # noqa: F401 - registers the tasks
    from worker.celery_app import celery

    store = SequenceStore(fakeredis.FakeRedis(decode_responses=True))
    celery.llmq_engine = SimpleNamespace(name="w1@h", store=store)
    try:
        yield celery, store
    finally:
        celery.llmq_engine = None


def receive_and_run(app, name: str, task_id: str, shadow: str | None = None) -> set[str]:
    """The worker receives the task's message, then its task returns: what was held between."""
    request = Request(TaskMessage(name, id=task_id, shadow=shadow), app=app)
    signals.task_received.send(sender=None, request=request)
    held = app.llmq_engine.store.r.smembers(held_key("w1@h"))
    signals.task_postrun.send(sender=app.tasks[name], task_id=task_id, task=app.tasks[name])
    assert not app.llmq_engine.store.r.exists(held_key("w1@h"))
    return held


def test_a_sequences_message_is_held_until_its_task_returns(worker_app):
    app, _ = worker_app
    assert receive_and_run(app, GENERATE_TASK, "seq-1") == {"seq-1"}
    assert receive_and_run(app, GENERATE_TASK, "seq-2", shadow="llmq.batch_line") == {"seq-2"}


@pytest.mark.parametrize("name", ["llmq.batch", "llmq.webhook"])
def test_other_tasks_messages_are_not_held(worker_app, name):
    app, _ = worker_app
    assert receive_and_run(app, name, "not-a-sequence") == set()


def test_the_generate_task_hands_its_messages_priority_to_the_engine():
    """Issue 16: the engine orders its queue by the message's Celery priority (batch lines are
    sent at LLMQ_BATCH_PRIORITY), so the task passes it on."""
    from worker import tasks  # noqa: F401 - registers the task
    from worker.celery_app import celery

    seen = []
    celery.llmq_engine = SimpleNamespace(
        run_sequence=lambda seq_id, priority=None: seen.append((seq_id, priority)) or {})
    try:
        celery.tasks[GENERATE_TASK].apply(args=["line"], priority=9)
        celery.tasks[GENERATE_TASK].apply(args=["chat"])
    finally:
        celery.llmq_engine = None
    assert seen == [("line", 9), ("chat", None)]
