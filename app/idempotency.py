"""Idempotency-Key on the creating routes (POST /v1/jobs, /v1/generate, /v1/responses,
/v1/batches, /v1/files), with Stripe's semantics (the IETF httpapi draft): within
LLMQ_RESULT_TTL, a request with a key its API key used before gets the first request's answer
again (status, body, Location) and does no new work; with another body (or route) it is a 422;
while the first is still being answered, a 409 with Retry-After.

Checked before the route runs, after authentication (keys are scoped per API key): the key is
claimed atomically in Redis (common/idempotency_store.py) and the route's 2xx answer stored
under it; any other answer lets it go, so that a retry after a 429 or 503 runs. A streamed
answer is not stored (the key only guards its admission).
"""
from __future__ import annotations

import json
import logging

import redis
from flask import Blueprint, Flask, Response, current_app, g, request

from common.idempotency_store import IdempotencyStore, digest

from .errors import APIError

bp = Blueprint("idempotency", __name__)
log = logging.getLogger("llmq.api")

HEADER = "Idempotency-Key"
ROUTES = {"/v1/jobs", "/v1/generate", "/v1/responses", "/v1/batches", "/v1/files"}
MAX_KEY_CHARS = 255
KEPT_HEADERS = ("Location", "X-Request-Id")


def fingerprint() -> str:
    """The request as a hash: route and body (JSON compared as data, so key order and spacing
    do not matter; a multipart upload by its fields and files' contents, as its boundary
    differs on every send)."""
    if request.mimetype == "multipart/form-data":
        parts = sorted(request.form.items(multi=True))
        files = sorted((name, f.filename or "", digest(f.stream.read()))
                       for name, f in request.files.items(multi=True))
        for _name, f in request.files.items(multi=True):
            f.stream.seek(0)
        body = json.dumps([parts, files])
    else:
        raw = request.get_data(cache=True)
        try:
            body = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":"))
        except (ValueError, RecursionError):
            body = raw.decode("utf-8", "replace")
    return digest(f"{request.method} {request.path}\n{body}")


def _store() -> IdempotencyStore:
    return current_app.extensions["llmq"]["idempotency"]


@bp.before_app_request
def _claim():
    key = request.headers.get(HEADER)
    if key is None or request.method != "POST" or request.path not in ROUTES:
        return None
    if not key.strip() or len(key) > MAX_KEY_CHARS:
        raise APIError(400, f"{HEADER} must be 1 to {MAX_KEY_CHARS} characters", param=HEADER)
    s = current_app.extensions["llmq"]["settings"]
    state, value = _store().claim(g.owner, key, fingerprint(), int(s.wait_timeout_s) + 60)
    if state == "new":
        g.idempotency = (key, value)
        return None
    if state == "pending":
        raise APIError(409, f"a request with this {HEADER} is still being answered; retry "
                       "shortly", "invalid_request_error", {"Retry-After": "1"},
                       param=HEADER, code="idempotency_key_in_use")
    if state == "mismatch":
        raise APIError(422, f"this {HEADER} was used for another request (a different body "
                       "or route); use a new key", param=HEADER, code="idempotency_key_reused")
    resp = Response(value["body"], status=value["status"], mimetype="application/json")
    for name, v in value["headers"].items():
        resp.headers[name] = v
    resp.headers["Idempotent-Replayed"] = "true"
    return resp


@bp.after_app_request
def _settle(resp: Response) -> Response:
    claimed = g.pop("idempotency", None)
    if claimed is None:
        return resp
    key, token = claimed
    try:
        if 200 <= resp.status_code < 300 and not resp.is_streamed:
            s = current_app.extensions["llmq"]["settings"]
            _store().answer(g.owner, key, token, {
                "status": resp.status_code, "body": resp.get_data(as_text=True),
                "headers": {h: resp.headers[h] for h in KEPT_HEADERS if h in resp.headers}},
                s.result_ttl_s)
        else:
            _store().release(g.owner, key, token)
    except redis.RedisError as exc:   # the answer goes out; the claim lapses by its TTL
        log.warning("idempotency key not settled: %s", exc)
    return resp


@bp.teardown_app_request
def _let_go(_exc):
    """A request that ended without an answer (its after-request handlers did not run)."""
    claimed = g.pop("idempotency", None)
    if claimed is not None:
        try:
            _store().release(g.owner, *claimed)
        except redis.RedisError:
            pass


def init_app(app: Flask) -> None:
    """Registered after the API's blueprint, so that authentication (the owner) comes first."""
    ext = app.extensions["llmq"]
    ext["idempotency"] = ext["store"].beside(IdempotencyStore)
    app.register_blueprint(bp)
