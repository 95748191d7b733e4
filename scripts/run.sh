#!/usr/bin/env bash
# `make run`: Redis (unless REDIS_URL points elsewhere), WORKERS workers, a delivery worker
# (webhook deliveries: their own queue and pool, scripts/delivery.sh), the API and Flower (behind
# a login: user llmq, a password generated once and kept in run/flower.password).
#
# Ctrl-C stops them in an order that loses nothing: the API first (no new work), then the
# workers (each lets its batch finish for LLMQ_SHUTDOWN_GRACE seconds and hands the rest back
# to the queue), then Flower, and Redis last, so the hand-back reaches it and its append-only
# file keeps the queue for the next `make run`. A second Ctrl-C stops everything at once.
#
# Each part runs in a session of its own, so a terminal's Ctrl-C (SIGINT to the foreground
# process group) reaches only this script, which then stops them one by one.
set -uo pipefail
cd "$(dirname "$0")/.."
umask 077   # logs, the Redis password and its files: this user's only
RUN="${LLMQ_RUN_DIR:-run}"
LLMQ_HOST="${LLMQ_HOST:-127.0.0.1}"; LLMQ_PORT="${LLMQ_PORT:-8000}"; FLOWER_PORT="${FLOWER_PORT:-5555}"
REDIS_PORT="${REDIS_PORT:-6379}"
GRACE="${LLMQ_SHUTDOWN_GRACE:-30}"
case "$GRACE" in   # whole seconds, rounded up (gunicorn takes an integer)
  *.*) grace_s=$(( ${GRACE%.*} + 1 )) ;;
  *) grace_s=$GRACE ;;
esac
# On a GPU host, one worker per GPU, each pinned to its own (WORKERS defaults to the GPU count).
ngpu=0
command -v nvidia-smi >/dev/null 2>&1 && ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
WORKERS="${WORKERS:-$(( ngpu > 0 ? ngpu : 1 ))}"

redis=(); workers=(); deliveries=(); api=(); flower=()
stopping=0

alive() {
  local p
  for p in "$@"; do kill -0 "$p" 2>/dev/null && return 0; done
  return 1
}

# wait_gone SECONDS PID...: true once all have exited, false if some outlive SECONDS.
wait_gone() {
  local deadline=$(( SECONDS + $1 )); shift
  while alive "$@"; do
    [ "$SECONDS" -ge "$deadline" ] && return 1
    sleep 0.2
  done
}

# Each part leads its own process group (setsid): this kills it with its children (the model
# process of a worker, gunicorn's workers).
kill_hard() {
  local p
  for p in "$@"; do kill -KILL -- "-$p" 2>/dev/null; done
}

# stop_part NAME SECONDS PID...: SIGTERM, then SIGKILL whatever is still there after SECONDS.
stop_part() {
  local name=$1 limit=$2; shift 2
  [ $# -gt 0 ] || return 0
  echo "stopping $name..."
  kill -TERM "$@" 2>/dev/null
  wait_gone "$limit" "$@" || { echo "$name still running after $limit s: killed"; kill_hard "$@"; }
}

api_open() {
  local host=$LLMQ_HOST
  case "$host" in 0.0.0.0) host=127.0.0.1 ;; ::) host=::1 ;; esac
  (exec 3<>"/dev/tcp/$host/$LLMQ_PORT") 2>/dev/null
}

stop_in_order() {
  echo; echo "stopping llmq; Ctrl-C again stops everything at once"
  # The API closes its port at once (no new work) and finishes what it has in hand, streams
  # included, for up to the grace, alongside the workers' drain.
  if [ ${#api[@]} -gt 0 ]; then
    echo "stopping the API..."
    kill -TERM "${api[@]}" 2>/dev/null
    for _ in $(seq 30); do api_open || break; sleep 0.1; done
  fi
  # A worker exits by itself within the grace plus its hand-back (at the latest 20 s past the
  # grace, when Redis does not answer); the rest of the margin is for a loaded host.
  stop_part "the workers (up to $grace_s s to finish their batch)" $(( grace_s + 30 )) "${workers[@]}"
  stop_part "the delivery worker" 30 "${deliveries[@]}"
  wait_gone 5 "${api[@]}" || { echo "the API still running: killed"; kill_hard "${api[@]}"; }
  stop_part "Flower" 10 "${flower[@]}"
  stop_part "Redis" 30 "${redis[@]}"   # it writes its append-only file out first
  echo "stopped."
}

stop_at_once() {
  echo; echo "stopping everything at once..."
  exec 2>/dev/null   # no "Killed" line from bash for each part
  kill_hard "${api[@]}" "${workers[@]}" "${deliveries[@]}" "${flower[@]}"
  # Redis leaves in a moment on SIGTERM, with its append-only file written out.
  if [ ${#redis[@]} -gt 0 ]; then
    kill -TERM "${redis[@]}" 2>/dev/null
    wait_gone 5 "${redis[@]}" || kill_hard "${redis[@]}"
  fi
  exit 130
}

on_signal() {
  [ "$stopping" = 1 ] && stop_at_once
  stopping=1
}
trap on_signal INT TERM HUP

mkdir -p "$RUN"
chmod 700 "$RUN"
# start_redis PORT: starts llmq's Redis there; true once it answers with the password, false
# (its log kept in $RUN/redis.log) when it exits first, as it does when the port is taken by a
# socket that does not listen (an outbound connection's local port, say).
start_redis() {
  local pid
  LLMQ_RUN_DIR="$RUN" REDIS_PORT="$1" setsid bash scripts/redis.sh >"$RUN/redis.log" 2>&1 &
  pid=$!
  # No time limit while it runs: a large append-only file takes a while to load.
  until [ "$(REDISCLI_AUTH="$pw" redis-cli -p "$1" ping 2>/dev/null)" = PONG ]; do
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid" 2>/dev/null
      return 1
    fi
    [ "$stopping" = 1 ] && break
    sleep 0.1
  done
  redis+=("$pid")
}

if [ -z "${REDIS_URL:-}" ] && [ -z "${LLMQ_REDIS_URL:-}" ]; then
  LLMQ_RUN_DIR="$RUN" bash scripts/redis.sh url >/dev/null   # (makes the password once)
  pw="$(cat "$RUN/redis.password")"
  ports=("$REDIS_PORT")
  if [ "$(redis-cli -p "$REDIS_PORT" ping 2>/dev/null)" = PONG ]; then
    # A Redis without a password (Debian's redis-server service starts one on 6379 when it is
    # installed): any local user could read and write every job there. llmq runs its own, with
    # its password, on the next port that is free (or already has it).
    ports=()
    for p in $(seq $(( REDIS_PORT + 1 )) $(( REDIS_PORT + 20 ))); do
      if [ "$(REDISCLI_AUTH="$pw" redis-cli -p "$p" ping 2>/dev/null)" = PONG ] \
         || ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
        ports+=("$p")
      fi
    done
    echo "redis:  127.0.0.1:$REDIS_PORT answers WITHOUT a password: not used; llmq's runs on the next free port"
  fi
  started=0
  for p in "${ports[@]}"; do
    if [ "$(REDISCLI_AUTH="$pw" redis-cli -p "$p" ping 2>/dev/null)" = PONG ]; then
      echo "redis:  already running on 127.0.0.1:$p (not started here)"
    elif redis-cli -p "$p" ping >/dev/null 2>&1; then
      echo "redis:  port $p has a Redis with another password; set REDIS_PORT or REDIS_URL" >&2
      exit 1
    elif start_redis "$p"; then
      echo "redis:  127.0.0.1:$p (password in $RUN/redis.password, log $RUN/redis.log)"
    elif [ ${#ports[@]} -gt 1 ] && grep -q "Address already in use" "$RUN/redis.log"; then
      continue   # a port chosen here: the next one
    else
      echo "redis:  did not start on 127.0.0.1:$p; the end of $RUN/redis.log:" >&2
      tail -n 5 "$RUN/redis.log" | sed 's/^/    /' >&2
      exit 1
    fi
    started=1 REDIS_PORT=$p
    break
  done
  if [ "$started" = 0 ]; then
    echo "redis:  no free port near $REDIS_PORT for a Redis with a password; set REDIS_PORT" >&2
    exit 1
  fi
  export LLMQ_REDIS_URL="$(LLMQ_RUN_DIR="$RUN" REDIS_PORT="$REDIS_PORT" bash scripts/redis.sh url)"
fi
export LLMQ_REDIS_URL="${LLMQ_REDIS_URL:-$REDIS_URL}"

# Several models (LLMQ_MODELS): one worker per model, each on its own GPU while there are
# GPUs enough (else they share them in turn), each consuming its model's queue.
served=("")
if [ -n "${LLMQ_MODELS:-}" ]; then
  names="$(.venv/bin/python -c 'from common.settings import Settings
print("\n".join(m.name for m in Settings.from_env().served_models()))')" \
    || { echo "LLMQ_MODELS: see the error above" >&2; exit 1; }
  mapfile -t served <<<"$names"
  WORKERS=${#served[@]}
fi
for i in $(seq 0 $(( WORKERS - 1 ))); do
  if [ "$ngpu" -gt 0 ]; then dev="gpu$(( i % ngpu ))"; gpu=$(( i % ngpu )); else dev="cpu$i"; gpu=""; fi
  model="${served[$i]:-}"
  [ -n "$model" ] && dev="$dev-$(printf '%s' "$model" | tr -c 'A-Za-z0-9_-' '_')"
  LLMQ_SERVE_MODEL=$model LLMQ_WORKER_INDEX=$i LLMQ_GPU=$gpu LLMQ_WORKER_DEVICE_NAME=$dev \
    setsid bash scripts/worker.sh >"$RUN/worker$i.log" 2>&1 &
  workers+=($!)
  echo "worker: llmq-$dev${model:+ serving $model} (log $RUN/worker$i.log)"
done
setsid bash scripts/delivery.sh >"$RUN/delivery.log" 2>&1 &
deliveries+=($!)
echo "delivery worker: webhooks (log $RUN/delivery.log)"
# The API's graceful timeout is the workers' grace: its streams can follow the drain to its end.
setsid .venv/bin/gunicorn --bind "$LLMQ_HOST:$LLMQ_PORT" --worker-class app.http_worker.ThreadWorker --workers 2 \
  --threads 256 --timeout 0 --graceful-timeout "$grace_s" app.wsgi:application \
  >"$RUN/api.log" 2>&1 &
api+=($!)
LLMQ_RUN_DIR="$RUN" FLOWER_PORT="$FLOWER_PORT" setsid bash scripts/flower.sh >"$RUN/flower.log" 2>&1 &
flower+=($!)
echo "api:    http://$LLMQ_HOST:$LLMQ_PORT (log $RUN/api.log)"
echo "flower: http://127.0.0.1:$FLOWER_PORT (user llmq, password in $RUN/flower.password, log $RUN/flower.log)"
# died NAME LOG PID...: true (and says why, with the log's end) when every PID has exited.
died() {
  local name=$1 log=$2; shift 2
  alive "$@" && return 1
  echo; echo "$name exited before the service was ready; the end of $log:"
  tail -n 15 "$log" | sed 's/^/  /'
}
ready=0
if [ "$stopping" = 0 ]; then
  echo -n "waiting for a worker to load the model"
  for _ in $(seq 600); do
    [ "$stopping" = 1 ] && break
    curl -sf -m 3 "http://$LLMQ_HOST:$LLMQ_PORT/readyz" >/dev/null 2>&1 && { echo " - ready."; ready=1; break; }
    # A part that cannot start (a port in use, a model that does not load) is said at once,
    # not after ten minutes of dots.
    if died "the API" "$RUN/api.log" "${api[@]}" \
       || died "the worker" "$RUN/worker0.log" "${workers[@]}"; then
      stop_in_order
      exit 1
    fi
    echo -n "."; sleep 1
  done
fi
if [ "$stopping" = 0 ] && [ "$ready" = 0 ]; then
  echo; echo "not ready after 600 s: see the logs in $RUN/ (it keeps running; Ctrl-C stops it)"
elif [ "$stopping" = 0 ]; then
  echo "try: curl -s http://$LLMQ_HOST:$LLMQ_PORT/v1/generate -d '{\"messages\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}]}'"
  echo "Ctrl-C stops everything (the workers get up to ${grace_s} s to finish their batch)."
fi
all=("${redis[@]}" "${workers[@]}" "${deliveries[@]}" "${api[@]}" "${flower[@]}")
until [ "$stopping" = 1 ]; do
  wait   # returns when a signal comes, or once every part has exited
  alive "${all[@]}" || break
done
stop_in_order
