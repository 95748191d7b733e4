"""OpenAI's /v1/batches: create, retrieve, list and cancel, in OpenAI's shapes.

Create reads the input file and checks every line as the route it names would check it
(app/openai_api.py); a malformed line becomes an error-file line at once and the others are
stored parsed. A Celery task, `llmq.batch` (worker/batch_runner.py), then drives the batch:
it submits the lines through the same engine as interactive requests, at a lower Celery
priority and a few at a time, and writes the output and error files.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from flask import Blueprint, Flask, current_app, g, jsonify
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from common.batch_store import (BATCH_TASK, DISPATCH_GRACE_S, BatchStore, line_request_id,
                                new_batch_id, validation_errors)
from common.llm_engine import TooLarge
from common.protocol import SequenceRequest

from .context import engine, settings
from .errors import APIError
from .request_body import describe, parse_json_body
from .submit import checked_webhook, owned_params
from .files_api import file_store, jsonl_lines
from .limits import check_limits
from .listing import list_params, page_json
from .model_routing import routed_model
from .openai_api import (ChatCompletionRequest, CompletionRequest, shape_options, to_sequences,
                         validate_request)
from .schemas import WebhookFields

bp = Blueprint("batches", __name__)

ENDPOINTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
_WINDOW = re.compile(r"^(\d{1,7})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400


class BatchCreate(WebhookFields):
    """POST /v1/batches (OpenAI's fields; `webhook` and `webhook_events` are llmq's)."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=256)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: dict[str, Any] | None = None   # accepted; outputs follow LLMQ_FILE_TTL

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if v not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}")
        return v

    @field_validator("completion_window")
    @classmethod
    def _window(cls, v: str) -> str:
        m = _WINDOW.match(v)
        if not m or not 0 < int(m[1]) * _UNIT_S[m[2]] <= MAX_WINDOW_S:
            raise ValueError("completion_window must be a duration like '24h' (s, m, h or d; "
                             "at most 7d)")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v and any(len(k) > 64 or len(x) > 512 for k, x in v.items()):
            raise ValueError("metadata keys are at most 64 characters, values at most 512")
        return v

    @property
    def window_s(self) -> int:
        m = _WINDOW.match(self.completion_window)
        return int(m[1]) * _UNIT_S[m[2]]


def batch_store() -> BatchStore:
    return current_app.extensions["llmq"]["batches"]


def find_batch(batch_id: str) -> dict:
    batch = batch_store().get(batch_id, g.owner)
    if batch is None:
        raise APIError(404, f"No such Batch object: {batch_id}", "not_found_error", param="id")
    return batch


def parse_lines(text: str, endpoint: str) -> tuple[list[str], dict[int, dict[str, Any]]]:
    """Every non-empty line, parsed: (one JSON spec per line, the malformed lines' errors by
    index). A spec is what the driver submits and how it shapes the answer ({"custom_id",
    "input", "params", "timeout", "priority", "shape"}) or, for a malformed line,
    {"custom_id", "error"}; an error is {"custom_id", "code", "message", "param", "line"} (the
    line's number in the file)."""
    model_cls, s = ENDPOINTS[endpoint], settings()
    specs, errors, seen = [], {}, set()
    for number, raw in enumerate(jsonl_lines(text), start=1):
        if not raw.strip():
            continue
        index = len(specs)
        custom_id = None
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict):
                raise APIError(400, "a line must be a JSON object")
            custom_id = obj.get("custom_id")
            # As parse_json_body: a lone surrogate (\ud800) parses but cannot be stored.
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
            spec = _line_spec(obj, endpoint, model_cls, s, seen)
        except (ValueError, APIError, RecursionError) as exc:   # (UnicodeError is a ValueError)
            is_api = isinstance(exc, APIError)
            custom_id = custom_id if isinstance(custom_id, str) and _encodable(custom_id) \
                else None
            errors[index] = {"custom_id": custom_id,
                             "code": (exc.code if is_api else None) or "invalid_request",
                             "message": exc.message if is_api else _not_valid(exc),
                             "param": exc.param if is_api else None, "line": number}
            spec = {"custom_id": custom_id, "error": True}
        specs.append(json.dumps(spec, ensure_ascii=False))
    return specs, errors


def _not_valid(exc: Exception) -> str:
    if isinstance(exc, RecursionError):
        return "not valid JSON: nested too deeply"
    if isinstance(exc, UnicodeError):
        return "not valid JSON: a string holds a lone surrogate (not UTF-8)"
    return f"not valid JSON: {exc}"


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeError:
        return False
    return True


def error_lines(batch_id: str, errors: dict[int, dict[str, Any]]) -> dict[int, str]:
    """The error file's lines of malformed input lines, by index."""
    return {i: json.dumps({"id": line_request_id(batch_id, i), "custom_id": e["custom_id"],
                           "response": None,
                           "error": {"code": e["code"],
                                     "message": f"line {e['line']}: {e['message']}"}},
                          ensure_ascii=False)
            for i, e in errors.items()}


def _line_spec(obj: dict, endpoint: str, model_cls, s, seen: set) -> dict:
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise APIError(400, "'custom_id' must be a non-empty string", param="custom_id")
    if custom_id in seen:
        raise APIError(400, f"duplicate custom_id {custom_id!r}", param="custom_id",
                       code="duplicate_custom_id")
    seen.add(custom_id)
    if obj.get("method", "POST") != "POST":
        raise APIError(400, "'method' must be POST", param="method")
    if obj.get("url") != endpoint:
        raise APIError(400, f"'url' must be the batch's endpoint {endpoint}", param="url")
    if not isinstance(obj.get("body"), dict):
        raise APIError(400, "'body' must be a JSON object", param="body")
    req = validate_request(model_cls, obj["body"])
    if req.stream:
        raise APIError(400, "'stream' is not supported in a batch", param="stream")
    inputs, options = to_sequences(req)
    if options.get("n", 1) > 1:
        raise APIError(400, "a batch line takes n = 1 (and best_of 1)", param="n")
    if len(inputs) != 1:
        raise APIError(400, "a batch line takes one prompt", param="prompt")
    default_max_tokens = options.get("default_max_tokens") or s.default_max_tokens
    # The route's limits (not its token count: 50,000 lines are read in one request; the
    # worker refuses a prompt that does not fit its context).
    check_limits(s, req, inputs, max_tokens=options.get("max_tokens") or req.max_tokens,
                 default_max_tokens=default_max_tokens,
                 max_tokens_param=options.get("max_tokens_param", "max_tokens"))
    params = owned_params(req, default_max_tokens, options.get("max_tokens"))
    try:
        engine().check_size([SequenceRequest(seq_id="", params=params, **inputs[0])])
    except TooLarge as exc:   # the driver could never queue it
        raise APIError(400, str(exc), code="request_too_large") from None
    # (each line's own model: a batch may mix them, as OpenAI's Batch API allows per line)
    return {"custom_id": custom_id, "input": inputs[0], "params": params.to_dict(),
            "timeout": req.timeout, "priority": req.priority, "shape": shape_options(req),
            "model": routed_model(req.model).name}


# --- routes -----------------------------------------------------------------------------------
@bp.post("/v1/batches")
def create_batch():
    try:
        req = BatchCreate.model_validate(parse_json_body())
    except ValidationError as exc:
        raise APIError(400, describe(exc)) from None
    hook = checked_webhook(req)
    meta = file_store().get(req.input_file_id, g.owner)
    if meta is None:
        raise APIError(404, f"No such File object: {req.input_file_id}", "not_found_error",
                       param="input_file_id")
    if meta["purpose"] != "batch":
        raise APIError(400, "the input file's purpose must be 'batch'", param="input_file_id")
    batch_id = new_batch_id()
    specs, errors = parse_lines(file_store().content(req.input_file_id, g.owner) or "",
                                req.endpoint)
    if not specs:
        raise APIError(400, "the input file has no requests", param="input_file_id")
    now = time.time()
    fields = {
        "id": batch_id, "owner": g.owner, "status": "validating", "endpoint": req.endpoint,
        "input_file_id": req.input_file_id, "completion_window": req.completion_window,
        "created_at": now, "expires_at": now + req.window_s,
        "model": settings().served_models()[0].name,
        "metadata": json.dumps(req.metadata) if req.metadata is not None else "",
        "webhook": hook[0] if hook else "", "webhook_events": ",".join(hook[1]) if hook else "",
        "errors": validation_errors([{k: e[k] for k in ("code", "message", "param", "line")}
                                     for _, e in sorted(errors.items())]),
    }
    err_lines = error_lines(batch_id, errors)
    size = charged_storage(fields, specs, err_lines)
    batch = batch_store().create(fields, specs, err_lines, stored_bytes=size)
    dispatch(batch_id)
    return jsonify(batch)


def charged_storage(fields: dict, specs: list[str], err_lines: dict[int, str]) -> int:
    """The bytes the batch will keep, checked against its key's storage quota
    (LLMQ_KEY_STORAGE_BYTES, which its jobs' results share): 0 with no quota. A batch keeps
    its parsed lines (several times its file) until it expires, and a file may be batched
    again and again, so each creation is charged."""
    quota = settings().key_storage_bytes
    if not quota:
        return 0
    size = batch_store().stored_size(fields, specs, err_lines)
    if size > quota:   # no wait could make room: a 400, not an endless 429
        raise APIError(400, f"this batch would keep about {size} bytes in Redis, more than a "
                            f"key's storage quota, {quota} (LLMQ_KEY_STORAGE_BYTES); split "
                            "its file", param="input_file_id", code="storage_quota_exceeded")
    store = engine().store
    used = store.storage_used(g.owner)
    if used + size > quota:
        raise APIError(429, f"this key's results and batches keep {used} bytes in Redis and "
                            f"this batch needs about {size} more; its quota is {quota} "
                            "(LLMQ_KEY_STORAGE_BYTES). Retry when older results expire.",
                       "rate_limit_error", {"Retry-After": str(store.storage_frees_in(g.owner))},
                       code="storage_quota_exceeded")
    return size


def dispatch(batch_id: str) -> None:
    """Starts the batch's driver now; if the broker is unreachable, a worker's supervisor
    starts it later (the batch is stored as due), so the batch is never lost."""
    token = uuid.uuid4().hex
    try:
        if batch_store().claim(batch_id, token, DISPATCH_GRACE_S):
            engine().celery.send_task(BATCH_TASK, args=[batch_id, token], task_id=token,
                                      queue=settings().queue, priority=0)
    except Exception:  # noqa: BLE001 - see above
        current_app.logger.warning("batch driver not dispatched now", exc_info=True)


@bp.get("/v1/batches")
def list_batches():
    after, limit = list_params(20, 100)
    return page_json(batch_store().list, g.owner, after, limit)


@bp.get("/v1/batches/<batch_id>")
def retrieve_batch(batch_id: str):
    return jsonify(find_batch(batch_id))


@bp.post("/v1/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str):
    find_batch(batch_id)
    batch_store().request_cancel(batch_id)
    return jsonify(find_batch(batch_id))


def init_app(app: Flask) -> None:
    ext = app.extensions["llmq"]
    ext["batches"] = ext["store"].beside(BatchStore, ext["settings"].file_ttl_s)
    app.register_blueprint(bp)

