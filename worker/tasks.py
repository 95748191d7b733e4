"""Celery tasks: a thin door into the engine. The task id is the sequence id (seen in Flower)."""
from __future__ import annotations

from celery import shared_task
from celery.exceptions import Reject

from common.protocol import GENERATE_TASK


@shared_task(name=GENERATE_TASK, bind=True)
def generate(self, seq_id: str) -> dict:
    """Runs one sequence in this worker's continuous batch and returns when it has finished."""
    engine = self.app.llmq_engine
    if engine is None:   # (a failed task's message is acknowledged: the sequence would be lost)
        raise Reject("this worker's engine is not running", requeue=True)
    # The message's priority (batch lines: LLMQ_BATCH_PRIORITY) orders the engine's queue too.
    result = engine.run_sequence(seq_id,
                                 priority=(self.request.delivery_info or {}).get("priority"))
    if result.get("stranded"):
        # Neither run nor queued again (released at shutdown without a hand-back, or its new
        # message could not be sent): the message is not acknowledged but rejected back to the
        # queue; if that cannot reach Redis either, kombu redelivers it after the visibility
        # timeout, or a peer's reaper takes the record back.
        raise Reject("not run here and not queued again", requeue=True)
    return result
