#!/usr/bin/env bash
# Starts one delivery worker: webhook deliveries on their own queue (LLMQ_QUEUE.webhooks) and
# their own small pool, no engine and no model (worker/celery_app.py: serves_generation). A
# receiver that is slow or never answers holds one of these threads, never a generation one;
# the caps per host and per key (LLMQ_WEBHOOK_MAX_PER_HOST, LLMQ_WEBHOOK_MAX_PER_KEY) bound
# how many of them one receiver holds.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/celery -A worker.celery_app worker --pool threads \
  --concurrency "${LLMQ_WEBHOOK_THREADS:-16}" --queues "${LLMQ_QUEUE:-llmq}.webhooks" \
  --prefetch-multiplier 1 --task-events \
  --hostname "llmq-delivery${LLMQ_WORKER_INDEX:-0}@%h" --loglevel "${LLMQ_LOG_LEVEL:-INFO}"
