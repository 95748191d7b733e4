"""The API's one error shape, OpenAI's `{"error": {"message", "type", "param", "code"}}`, what a
sequence that ended without its result means over HTTP (one mapping for every route), and the
app's error handlers."""
from __future__ import annotations

import json
from typing import Any

import redis
from flask import Flask, current_app, jsonify
from werkzeug.exceptions import HTTPException

from common.llm_engine import Overloaded, TooLarge
from common.protocol import INPUT_ERROR_CODES


class APIError(Exception):
    """An error the client caused or must handle; rendered as {"error": {...}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 headers: dict | None = None, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers or {}
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def sse_chunk(self) -> str:
        """The error as the last `data:` chunk of an OpenAI stream (vLLM's way: the status line
        went out with the first chunk, so the error travels in the body)."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


def error_response(status: int, message: str, type_: str, headers: dict | None = None,
                   param: str | None = None, code: str | None = None, **extra):
    """The one error shape; `extra` adds fields beside "error" (the failed job)."""
    resp = jsonify({**APIError(status, message, type_, param=param, code=code).body(), **extra})
    resp.status_code = status
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


def failure_of(job: dict[str, Any]) -> APIError | None:
    """How a finished job that did not produce its result answers a caller who waited for it;
    None when it did (stop, length) or was cancelled (OpenAI's "abort", not an error).

    - a prompt the worker refused (longer than the context, empty once tokenized): 400;
    - a failure while running (model process crashed past its restarts, an input that broke
      the model process): 500 `server_error`;
    - the request's own `timeout` passed: 504 `timeout_error`.
    """
    reason = job.get("finish_reason")
    error = job.get("error") or {}
    message = error.get("message") or "the sequence failed"
    if reason == "error":
        if error.get("code") in INPUT_ERROR_CODES:
            return APIError(400, message, "invalid_request_error", code=error["code"])
        return APIError(500, f"the sequence failed while running: {message}", "server_error",
                        code="sequence_failed")
    if reason == "timeout":
        return APIError(504, "the request's timeout passed before the sequence finished "
                        f"({job['usage']['completion_tokens']} tokens generated)",
                        "timeout_error", code="timeout")
    return None


# Redis full: it runs with maxmemory and noeviction (scripts/redis.sh, docker-compose.yml), so
# past its bound it refuses writes, until results expire or are deleted: minutes, not seconds.
REDIS_FULL_RETRY_S = 30


def is_redis_full(exc: BaseException) -> bool:
    """A write Redis refused at its maxmemory ("OOM command not allowed ..."; inside a
    transaction, the same words after the command's name; kombu passes it on as it is)."""
    return (isinstance(exc, redis.exceptions.OutOfMemoryError)
            or "used memory > 'maxmemory'" in str(exc))


def init_app(app: Flask) -> None:
    """Every failure as the one error shape: a client's (APIError, HTTP's), overload (429),
    Redis away or full (503), and anything else (500, logged)."""
    @app.errorhandler(APIError)
    def _api_error(exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.headers, exc.param, exc.code)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error"}.get(exc.code, "invalid_request_error")
        return error_response(exc.code or 400, exc.description or exc.name, kind)

    @app.errorhandler(TooLarge)
    def _too_large(exc: TooLarge):
        return error_response(400, str(exc), "invalid_request_error", code="request_too_large")

    @app.errorhandler(Overloaded)
    def _overloaded(exc: Overloaded):
        return error_response(429, str(exc), "rate_limit_error",
                              {"Retry-After": str(exc.retry_after_s)}, code=exc.code)

    @app.errorhandler(redis.RedisError)
    def _redis_down(exc):
        if is_redis_full(exc):
            current_app.logger.error("redis is full (maxmemory): %s", exc)
            return error_response(503, "the server's storage is full (Redis reached its "
                                  "maxmemory); nothing was queued; retry later",
                                  "service_unavailable", {"Retry-After": str(REDIS_FULL_RETRY_S)},
                                  code="redis_full")
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
