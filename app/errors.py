"""The API's one error shape, OpenAI's `{"error": {"message", "type", "param", "code"}}`, and
what a sequence that ended without its result means over HTTP (one mapping for every route)."""
from __future__ import annotations

import json
from typing import Any

from flask import jsonify

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
