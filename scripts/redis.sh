#!/usr/bin/env bash
# Redis for llmq on 127.0.0.1:$REDIS_PORT, in the foreground (`make redis`; `make run` starts it
# too): append-only file on, a password generated once and kept in $LLMQ_RUN_DIR/redis.password,
# and that folder (run/ by default) private to this user, as everything Redis writes into it.
# Its memory is bounded (LLMQ_REDIS_MAXMEMORY, by default half the host's RAM) with noeviction:
# a full Redis refuses writes (the API answers 503 redis_full) instead of evicting records and
# queued messages, or growing until the host kills it.
# `scripts/redis.sh url` prints the redis:// URL with that password instead, on REDIS_PORT or,
# without it, on the port the last Redis started here listens on (make run moves off a port
# where a Redis without a password answers).
set -euo pipefail
cd "$(dirname "$0")/.."
umask 077
RUN="${LLMQ_RUN_DIR:-run}"
PORT="${REDIS_PORT:-6379}"
mkdir -p "$RUN"
chmod 700 "$RUN"
pwfile="$RUN/redis.password"
# 24 random bytes as hex: safe in a redis:// URL without encoding.
[ -s "$pwfile" ] || od -An -vtx1 -N24 /dev/urandom | tr -d ' \n' >"$pwfile"
pw="$(cat "$pwfile")"
if [ "${1:-}" = url ]; then
  [ -n "${REDIS_PORT:-}" ] || PORT="$(sed -n 's/^port //p' "$RUN/redis.conf" 2>/dev/null || true)"
  echo "redis://:$pw@127.0.0.1:${PORT:-6379}/0"
  exit 0
fi
chmod -R go-rwx "$RUN"   # what an older run left readable (append-only file, logs)
# The password goes in a config file only this user reads, not on the command line (ps shows
# every process's arguments to every user).
maxmemory="${LLMQ_REDIS_MAXMEMORY:-$(awk '/^MemTotal:/ { print int($2 / 2) "kb" }' /proc/meminfo 2>/dev/null || true)}"
printf 'port %s\nbind 127.0.0.1\ndir "%s"\nappendonly yes\nrequirepass %s\nmaxmemory %s\nmaxmemory-policy noeviction\n' \
  "$PORT" "$(cd "$RUN" && pwd)" "$pw" "${maxmemory:-2gb}" >"$RUN/redis.conf"
exec redis-server "$RUN/redis.conf"
