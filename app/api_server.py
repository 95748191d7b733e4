"""The API server: HTTP routes for jobs, generation and streams, and JSON errors."""
from __future__ import annotations

import hashlib
import hmac
import json
import re
from typing import Any

import redis
from flask import Blueprint, Flask, Response, current_app, g, jsonify, request, stream_with_context
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

from common.protocol import EVENT_DONE

from .llm_engine import Overloaded
from .schemas import JobRequest, SamplingFields

bp = Blueprint("api", __name__)

_STREAM_ID = re.compile(r"^\d+-\d+$")
_OPEN_PATHS = {"/healthz", "/readyz", "/"}   # and /static/: the playground page


class APIError(Exception):
    """An error the client caused or must handle; rendered as {"error": {...}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 headers: dict | None = None, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers or {}
        self.param, self.code = param, code


def error_response(status: int, message: str, type_: str, headers: dict | None = None,
                   param: str | None = None, code: str | None = None):
    """The one error shape, OpenAI's: {"error": {"message", "type", "param", "code"}}."""
    resp = jsonify({"error": {"message": message, "type": type_, "param": param, "code": code}})
    resp.status_code = status
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


def engine():
    return current_app.extensions["llmq"]["engine"]


def settings():
    return current_app.extensions["llmq"]["settings"]


# --- auth -------------------------------------------------------------------------------------
@bp.before_app_request
def _authenticate():
    g.owner = ""
    keys = settings().api_keys
    if not keys or request.path in _OPEN_PATHS or request.path.startswith("/static/"):
        return None
    header = request.headers.get("Authorization", "")
    given = header[7:].strip() if header.lower().startswith("bearer ") else ""
    # Compare against every key in constant time, so timing tells nothing about which matched.
    matched = [hmac.compare_digest(given.encode(), k.encode()) for k in keys]
    if not given or not any(matched):
        raise APIError(401, "missing or invalid API key", "authentication_error",
                       {"WWW-Authenticate": "Bearer"})
    g.owner = hashlib.sha256(given.encode()).hexdigest()[:32]
    return None


# --- parsing ----------------------------------------------------------------------------------
def parse_json_body() -> dict:
    """The request body as a JSON object, or a 400 that says why not."""
    raw = request.get_data(cache=False)
    try:
        body = json.loads(raw or b"null")
        # Lone surrogates (\ud800) parse but cannot be stored or tokenized.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeError, RecursionError):
        raise APIError(400, "request body is not valid JSON (UTF-8)") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def parse_job_request() -> JobRequest:
    body = parse_json_body()
    try:
        req = JobRequest.model_validate(body)
    except ValidationError as exc:
        raise APIError(400, _describe(exc)) from None
    s = settings()
    if req.max_tokens is not None and req.max_tokens > s.max_tokens_limit:
        raise APIError(400, f"'max_tokens' must be at most {s.max_tokens_limit}")
    if req.prompts is not None and len(req.prompts) > s.max_prompts:
        raise APIError(400, f"at most {s.max_prompts} prompts per request")
    texts = [req.prompt or ""] + (req.prompts or []) + [m.content for m in req.messages or []]
    if sum(len(t) for t in texts) > s.max_prompt_chars * max(1, len(req.prompts or [])):
        raise APIError(400, f"prompt too long (at most {s.max_prompt_chars} characters each)")
    if len(req.stop) > s.max_stop:
        raise APIError(400, f"at most {s.max_stop} stop strings")
    if req.min_tokens > (req.max_tokens or s.default_max_tokens):
        raise APIError(400, "'min_tokens' must not exceed 'max_tokens'")
    return req


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def inputs_of(req: JobRequest) -> list[dict[str, Any]]:
    if req.prompts is not None:
        return [{"prompt": p} for p in req.prompts]
    if req.messages is not None:
        return [{"messages": [m.model_dump() for m in req.messages]}]
    return [{"prompt": req.prompt}]


def submit(inputs: list[dict[str, Any]], req: SamplingFields,
           default_max_tokens: int | None = None, max_tokens: int | None = None,
           n: int = 1) -> list[dict]:
    """Queues one sequence per input with the request's sampling and queueing fields, owned by
    the caller (every submitting route, OpenAI's included, comes through here); with n > 1,
    n sequences per input, each with its own seed (input-major order)."""
    params = req.sampling_params(default_max_tokens or settings().default_max_tokens, max_tokens)
    if n > 1:
        inputs = [{**inp, "params": p} for inp in inputs for p in params.copies(n)]
    return engine().submit(inputs, params, g.owner, req.timeout, req.priority)


def find_job(seq_id: str) -> dict:
    job = engine().get(seq_id, g.owner)
    if job is None:
        raise APIError(404, f"no job with id {seq_id!r}", "not_found_error")
    return job


# --- routes -----------------------------------------------------------------------------------
@bp.post("/v1/jobs")
def create_jobs():
    req = parse_job_request()
    jobs = submit(inputs_of(req), req)
    if req.prompts is not None:
        return jsonify({"object": "list", "jobs": jobs}), 202
    return jsonify(jobs[0]), 202, {"Location": f"/v1/jobs/{jobs[0]['id']}"}


@bp.get("/v1/jobs/<seq_id>")
def get_job(seq_id: str):
    return jsonify(find_job(seq_id))


@bp.delete("/v1/jobs/<seq_id>")
def cancel_job(seq_id: str):
    find_job(seq_id)
    return jsonify(engine().cancel(seq_id, g.owner))


@bp.get("/v1/jobs/<seq_id>/stream")
def stream_job(seq_id: str):
    find_job(seq_id)
    last = request.headers.get("Last-Event-ID") or request.args.get("last_event_id") or "0-0"
    if not _STREAM_ID.match(last):
        raise APIError(400, "Last-Event-ID must be a stream id like 1700000000000-0")
    return sse_response(seq_id, last)


@bp.post("/v1/generate")
def generate():
    req = parse_job_request()
    if req.stream and req.prompts is not None:
        raise APIError(400, "'stream' works with one prompt; use /v1/jobs for a batch")
    jobs = submit(inputs_of(req), req)
    if req.stream:
        return sse_response(jobs[0]["id"], "0-0")
    results = [engine().wait(j["id"]) or engine().get(j["id"], g.owner) for j in jobs]
    if req.prompts is not None:
        return jsonify({"object": "list", "results": results})
    return jsonify(results[0])


@bp.get("/healthz")
def healthz():
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz():
    s = settings()
    try:
        engine().store.r.ping()
        workers = engine().store.live_workers(s.worker_stale_s)
    except redis.RedisError as exc:
        return jsonify({"status": "unavailable", "reason": f"redis: {exc}"}), 503
    loaded = [w for w in workers if w.get("model_loaded") == "1"]
    if not loaded:
        return jsonify({"status": "unavailable", "reason": "no worker with the model loaded",
                        "workers": workers}), 503
    return jsonify({"status": "ready", "workers": loaded})


# --- SSE --------------------------------------------------------------------------------------
def format_sse(entry_id: str, kind: str, data: dict) -> str:
    return f"id: {entry_id}\nevent: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse_response(seq_id: str, after: str) -> Response:
    eng, keepalive = engine(), settings().sse_keepalive_s

    def gen():
        yield "retry: 1000\n\n"
        for ev in eng.events(seq_id, after, keepalive_s=keepalive):
            if ev is None:
                yield ": keep-alive\n\n"
                continue
            yield format_sse(*ev)
            if ev[1] == EVENT_DONE:
                return

    return Response(stream_with_context(gen()), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                             "X-Request-Id": seq_id})


# --- errors -----------------------------------------------------------------------------------
def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.headers, exc.param, exc.code)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error"}.get(exc.code, "invalid_request_error")
        return error_response(exc.code or 400, exc.description or exc.name, kind)

    @app.errorhandler(Overloaded)
    def _overloaded(exc: Overloaded):
        return error_response(429, str(exc), "rate_limit_error",
                              {"Retry-After": str(exc.retry_after_s)})

    @app.errorhandler(redis.RedisError)
    def _redis_down(exc):
        current_app.logger.warning("redis unavailable: %s", exc)
        return error_response(503, "the queue is unavailable; retry shortly",
                              "service_unavailable", {"Retry-After": "2"})

    @app.errorhandler(Exception)
    def _unexpected(exc):
        # Celery's kombu wraps broker outages in its own errors.
        if type(exc).__module__.startswith(("kombu", "redis")) or isinstance(exc, ConnectionError):
            return _redis_down(exc)
        current_app.logger.exception("unhandled error")
        return error_response(500, "internal error", "server_error")
