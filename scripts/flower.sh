#!/usr/bin/env bash
# Flower on 127.0.0.1:$FLOWER_PORT (`make flower`; `make run` starts it too), behind a login:
# it shows every tenant's tasks. User llmq, a password generated once and kept in
# $LLMQ_RUN_DIR/flower.password beside Redis's, given to Flower in its environment
# (FLOWER_BASIC_AUTH), not on its command line (ps shows those to every user). A
# FLOWER_BASIC_AUTH already set (user:password pairs) is used as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
umask 077
RUN="${LLMQ_RUN_DIR:-run}"
mkdir -p "$RUN"
chmod 700 "$RUN"
pwfile="$RUN/flower.password"
[ -s "$pwfile" ] || od -An -vtx1 -N18 /dev/urandom | tr -d ' \n' >"$pwfile"
export FLOWER_BASIC_AUTH="${FLOWER_BASIC_AUTH:-llmq:$(cat "$pwfile")}"
exec .venv/bin/celery -A worker.celery_app flower --address=127.0.0.1 \
  --port="${FLOWER_PORT:-5555}"
