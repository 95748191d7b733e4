#!/usr/bin/env bash
# `make run`: Redis (unless REDIS_URL points elsewhere), WORKERS workers, the API and Flower.
# Ctrl-C stops them all.
set -uo pipefail
cd "$(dirname "$0")/.."
LLMQ_HOST="${LLMQ_HOST:-127.0.0.1}"; LLMQ_PORT="${LLMQ_PORT:-8000}"; FLOWER_PORT="${FLOWER_PORT:-5555}"
# On a GPU host, one worker per GPU, each pinned to its own (WORKERS defaults to the GPU count).
ngpu=0
command -v nvidia-smi >/dev/null 2>&1 && ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
WORKERS="${WORKERS:-$(( ngpu > 0 ? ngpu : 1 ))}"
pids=()
cleanup() {
  echo; echo "stopping llmq..."
  kill "${pids[@]}" 2>/dev/null
  wait "${pids[@]}" 2>/dev/null
  exit 0
}
trap cleanup INT TERM

mkdir -p run
if [ -z "${REDIS_URL:-}" ] && [ -z "${LLMQ_REDIS_URL:-}" ]; then
  export LLMQ_REDIS_URL="redis://127.0.0.1:${REDIS_PORT:-6379}/0"
  if redis-cli -p "${REDIS_PORT:-6379}" ping >/dev/null 2>&1; then
    echo "redis:  already running on 127.0.0.1:${REDIS_PORT:-6379}"
  else
    redis-server --port "${REDIS_PORT:-6379}" --bind 127.0.0.1 --appendonly yes --dir "$PWD/run" \
      >run/redis.log 2>&1 &
    pids+=($!)
    for _ in $(seq 50); do redis-cli -p "${REDIS_PORT:-6379}" ping >/dev/null 2>&1 && break; sleep 0.1; done
    echo "redis:  127.0.0.1:${REDIS_PORT:-6379} (log run/redis.log)"
  fi
fi
export LLMQ_REDIS_URL="${LLMQ_REDIS_URL:-$REDIS_URL}"

for i in $(seq 0 $(( WORKERS - 1 ))); do
  if [ "$ngpu" -gt 0 ]; then dev="gpu$(( i % ngpu ))"; gpu=$(( i % ngpu )); else dev="cpu$i"; gpu=""; fi
  LLMQ_WORKER_INDEX=$i LLMQ_GPU=$gpu LLMQ_WORKER_DEVICE_NAME=$dev bash scripts/worker.sh \
    >"run/worker$i.log" 2>&1 &
  pids+=($!)
  echo "worker: llmq-$dev (log run/worker$i.log)"
done
.venv/bin/gunicorn --bind "$LLMQ_HOST:$LLMQ_PORT" --worker-class app.http_worker.ThreadWorker --workers 2 --threads 256 \
  --timeout 0 --graceful-timeout 30 app.wsgi:application >run/api.log 2>&1 &
pids+=($!)
.venv/bin/celery -A worker.celery_app flower --address=127.0.0.1 --port="$FLOWER_PORT" \
  >run/flower.log 2>&1 &
pids+=($!)
echo "api:    http://$LLMQ_HOST:$LLMQ_PORT (log run/api.log)"
echo "flower: http://127.0.0.1:$FLOWER_PORT (log run/flower.log)"
echo -n "waiting for a worker to load the model"
for _ in $(seq 600); do
  curl -sf "http://$LLMQ_HOST:$LLMQ_PORT/readyz" >/dev/null 2>&1 && { echo " - ready."; break; }
  echo -n "."; sleep 1
done
echo "try: curl -s http://$LLMQ_HOST:$LLMQ_PORT/v1/generate -d '{\"messages\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}]}'"
echo "Ctrl-C stops everything."
wait
