#!/usr/bin/env bash
# Starts one Celery worker. GPU hosts: LLMQ_GPU=<index> pins it with CUDA_VISIBLE_DEVICES.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${LLMQ_GPU:-}" ]; then
  export CUDA_VISIBLE_DEVICES="$LLMQ_GPU"
  dev="${LLMQ_WORKER_DEVICE_NAME:-gpu${LLMQ_GPU}}"
else
  dev="${LLMQ_WORKER_DEVICE_NAME:-cpu${LLMQ_WORKER_INDEX:-0}}"
fi
# The batch's default is the device's (common/settings.py's _CUDA_DEFAULTS on a GPU): a
# worker pinned to a GPU, or one whose LLMQ_DEVICE names CUDA, batches 256.
case "${LLMQ_GPU:+gpu}:${LLMQ_DEVICE:-auto}" in
  gpu:auto|*:cuda*) seqs="${LLMQ_MAX_NUM_SEQS:-256}" ;;
  *) seqs="${LLMQ_MAX_NUM_SEQS:-64}" ;;
esac
# One task thread per batch slot, plus a quarter more: with API keys, another key's sequence
# reaches the scheduler (and its fair share) while one key fills the batch (docs/security.md).
threads="${LLMQ_TASK_THREADS:-$(( seqs + (seqs + 3) / 4 ))}"
# Several models (LLMQ_MODELS): this worker consumes its own model's queue (LLMQ_SERVE_MODEL's).
queue="${LLMQ_QUEUE:-llmq}"
if [ -n "${LLMQ_MODELS:-}" ]; then
  queue="$(.venv/bin/python -c 'from common.settings import Settings
print(Settings.from_env().served_model.queue)')"
fi
exec .venv/bin/celery -A worker.celery_app worker --pool threads --concurrency "$threads" \
  --queues "$queue" --prefetch-multiplier 1 --task-events \
  --hostname "llmq-${dev}@%h" --loglevel "${LLMQ_LOG_LEVEL:-INFO}"
