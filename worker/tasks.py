"""Celery tasks: a thin door into the engine. The task id is the sequence id (seen in Flower)."""
from __future__ import annotations

from celery import shared_task

from common.protocol import GENERATE_TASK


@shared_task(name=GENERATE_TASK, bind=True)
def generate(self, seq_id: str) -> dict:
    """Runs one sequence in this worker's continuous batch and returns when it has finished."""
    engine = self.app.llmq_engine
    if engine is None:
        raise RuntimeError("this worker's engine is not running")
    return engine.run_sequence(seq_id)
