"""The GPU worker: Celery app and tasks, engine loop, workload manager, model executor/worker/manager."""
