"""The Celery worker process: its task threads (celery_app, tasks, batch_runner, webhooks), the
engine thread (engine_core, input/output processors, workload_manager) and the executors that
reach the model process, whose code is worker/model/."""
