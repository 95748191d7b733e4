"""Health and readiness: /health (vLLM's), /healthz (the process), /readyz (a worker has the
model loaded)."""
from __future__ import annotations

from typing import Any

import redis
from flask import Blueprint, Response, current_app, jsonify

from common.store import SequenceStore

from .auth import authenticated
from .context import settings

bp = Blueprint("health", __name__)


# Open to anyone, so they say only ready or not: no counters (a request's size could be read off
# them), worker names, hosts or error text. An authenticated caller also gets the workers. Their
# Redis round trips give up after LLMQ_HEALTH_TIMEOUT, so a hung Redis is a fast 503.
@bp.get("/health")
def health():
    """vLLM's route (its benchmark client polls it): 200 with an empty body when ready."""
    ready, _workers = _readiness()
    return Response(status=200 if ready else 503)


@bp.get("/healthz")
def healthz():
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz():
    ready, workers = _readiness()
    body: dict[str, Any] = {"status": "ready" if ready else "unavailable"}
    if authenticated():   # why, and who: only for a metrics key (or with no keys configured)
        if workers is None:
            body["reason"] = "redis unavailable"
        elif not ready:
            body["reason"] = "no worker with the model loaded"
        if workers is not None:
            body["workers"] = workers
    return jsonify(body), 200 if ready else 503


def _readiness() -> tuple[bool, list[dict] | None]:
    """(ready, the workers with the model loaded; None when Redis did not answer)."""
    ext = current_app.extensions["llmq"]
    try:
        workers = ext["health_store"].live_workers(settings().worker_stale_s)
    except redis.RedisError as exc:
        current_app.logger.warning("readiness: redis unavailable: %s", exc)
        return False, None
    loaded = [w for w in workers if w.get("model_loaded") == "1"]
    return bool(loaded), loaded


def health_store(s, client=None) -> SequenceStore:
    """A store whose Redis client gives up after LLMQ_HEALTH_TIMEOUT (the main one waits out
    long stream reads)."""
    client = client or redis.Redis.from_url(
        s.redis_url, decode_responses=True, socket_timeout=s.health_timeout_s,
        socket_connect_timeout=s.health_timeout_s, retry_on_timeout=False, max_connections=64)
    return SequenceStore(client)
