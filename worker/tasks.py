"""Celery tasks: a thin door into the engine. The task id is the sequence id (seen in Flower)."""
from __future__ import annotations

from celery import shared_task
from celery.exceptions import Reject

from common.protocol import GENERATE_TASK


@shared_task(name=GENERATE_TASK, bind=True)
def generate(self, seq_id: str) -> dict:
    """Runs one sequence in this worker's continuous batch and returns when it has finished."""
    engine = self.app.llmq_engine
    if engine is None:
        raise RuntimeError("this worker's engine is not running")
    # The message's priority (batch lines: LLMQ_BATCH_PRIORITY) orders the engine's queue too.
    result = engine.run_sequence(seq_id,
                                 priority=(self.request.delivery_info or {}).get("priority"))
    if result.get("stranded"):
        # Released at shutdown without a hand-back (Redis away): the message is not
        # acknowledged, so kombu redelivers it, or a peer's reaper takes the record back.
        raise Reject("not handed back at shutdown", requeue=True)
    return result
