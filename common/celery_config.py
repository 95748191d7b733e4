"""Celery settings shared by the API (a client that only sends) and the worker."""
from __future__ import annotations

from .webhook_store import WEBHOOK_TASK


def celery_config(settings) -> dict:
    return dict(
        broker_url=settings.redis_url,
        broker_connection_retry_on_startup=True,
        # Above the longest job, or Redis redelivers a running sequence (celery#5935).
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_s,
            # Ten priority levels, 0 first (kombu's default is four coarse steps).
            "priority_steps": list(range(10)),
            "queue_order_strategy": "priority",
        },
        task_default_queue=settings.queue,
        # Webhook deliveries wait on a receiver's network: their own queue, served by the
        # delivery workers' own pool (scripts/delivery.sh), so that a receiver that never
        # answers holds none of the task threads generation runs on.
        task_routes={WEBHOOK_TASK: {"queue": settings.webhook_queue}},
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        task_track_started=True,
        task_send_sent_event=True,
        worker_send_task_events=True,
        worker_prefetch_multiplier=1,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        task_serializer="json",
        accept_content=["json"],
    )
