"""OpenAI's Responses API: POST /v1/responses (background, streamed or waited for), GET (with
stream=true and starting_after: the stored event stream, resumed), cancel, delete and
input_items.

A response is a sequence like any other (queued through submit.submit: limits, rate
limits, fair share, priorities; visible at /v1/jobs/seq-<hex>), rendered with the chat
template from its messages. What the sequence's record does not hold (the input items,
instructions, the conversation so far, the request's echo fields) is its request document
(common/response_store.py), which a `previous_response_id` reads to continue a conversation.
Shapes: common/response_objects.py; stream events: app/response_events.py.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Iterator, Literal

from flask import Blueprint, Flask, Response, current_app, g, jsonify, request, \
    stream_with_context
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from common.protocol import EVENT_DONE
from common.response_objects import response_object, seq_id_of, status_of
from common.response_store import ResponseStore
from common.store import is_seq_id

from . import queue_info
from .context import engine, settings
from .request_body import parse_json_body
from .streaming import take_stream_slot
from .submit import submit
from .client_connection import client_gone
from .errors import APIError, failure_of
from .model_routing import routed_model
from .response_events import ResponseEventLog
from .schemas import SamplingFields, WebhookFields
from .waiting import WaitTimedOut, wait_or_cancel

bp = Blueprint("responses", __name__)
log = logging.getLogger("llmq.api")

# Accepted and ignored: they change nothing llmq makes (logged when set).
_IGNORED = {"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
            "parallel_tool_calls", "max_tool_calls", "truncation", "stream_options"}
# Refused unless given their neutral value: llmq does not implement them, so a request that
# relies on one gets a 400 naming it rather than a silently different answer.
_REFUSED = {"tools": (None, []), "tool_choice": (None, "none", "auto"), "reasoning": (None,),
            "include": (None, []), "conversation": (None,), "prompt": (None,),
            "top_logprobs": (None, 0), "context_management": (None,)}
CANCEL_WAIT_S = 5.0   # how long cancel and delete wait for a running sequence to end


def _error(message: str, param: str | None = None, code: str | None = None,
           status: int = 400) -> APIError:
    return APIError(status, message, "invalid_request_error", param=param, code=code)


class TextFormat(BaseModel):
    """text.format: text, json_object, or json_schema (OpenAI's flat shape)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any] | None:
        """Our response_format (app/schemas.ResponseFormat), which compiles the grammar."""
        if self.type == "json_schema":
            if self.schema_ is None:
                raise _error("text.format of type json_schema needs a schema",
                             param="text.format.schema")
            return {"type": "json_schema", "json_schema": {
                "name": self.name, "schema": self.schema_, "strict": self.strict}}
        return {"type": "json_object"} if self.type == "json_object" else None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None   # accepted; no effect


class Submitted(SamplingFields, WebhookFields):
    """What a response queues: its sampling fields and its webhook (OpenAI-shaped events at
    its end: response.completed, .incomplete, .failed or .cancelled)."""


class ResponseCreate(BaseModel):
    """POST /v1/responses: OpenAI's fields, and llmq's sampling extras (seed, top_k, min_p,
    repetition_penalty, stop, priority) and `webhook`."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool | None = None
    stream: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    user: str | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    priority: int | None = None
    webhook: str | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v and any(len(k) > 64 or len(x) > 512 for k, x in v.items()):   # OpenAI's bounds
            raise ValueError("metadata keys are at most 64 characters, values at most 512")
        return v

    def sampling(self, batch_priority: int) -> Submitted:
        """Our sampling fields (their ranges and the grammar checked there); flex is the
        batch priority."""
        fields: dict[str, Any] = {k: getattr(self, k) for k in (
            "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "stop",
            "priority", "webhook") if getattr(self, k) is not None}
        if self.service_tier == "flex" and self.priority is None:
            fields["priority"] = batch_priority
        fmt = self.text.format if self.text else None
        if fmt is not None and (spec := fmt.response_format()) is not None:
            fields["response_format"] = spec
        try:
            return Submitted.model_validate(fields)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = [str(x) for x in err["loc"]]
            param = "text.format" if loc and loc[0] == "response_format" else ".".join(loc)
            raise _error(f"{param}: {err['msg'].removeprefix('Value error, ')}",
                         param=param) from None


def _parse(body: dict) -> ResponseCreate:
    fields = set(ResponseCreate.model_fields)
    unknown = sorted(set(body) - fields - set(_REFUSED) - _IGNORED)
    if unknown:
        raise _error(f"unsupported parameter(s): {', '.join(unknown)}", param=unknown[0],
                     code="unsupported_parameter")
    for name in sorted(set(body) & set(_REFUSED)):
        if body[name] not in _REFUSED[name]:
            what = ("function tools are not supported yet" if name in ("tools", "tool_choice")
                    else "not supported by this server")
            raise _error(f"'{name}': {what}", param=name, code="unsupported_parameter")
    if ignored := sorted(n for n in set(body) & _IGNORED if body[n] is not None):
        log.info("responses: accepted and ignored: %s", ", ".join(ignored))
    try:
        req = ResponseCreate.model_validate({k: v for k, v in body.items() if k in fields})
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise _error(f"{param}: {err['msg'].removeprefix('Value error, ')}" if param
                     else err["msg"], param=param) from None
    routed_model(req.model)
    if req.background and req.store is False:
        raise _error("background responses must be stored (store: true)", param="store")
    return req


# --- input ------------------------------------------------------------------------------------
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as message items ({"type": "message", "role", "content": [parts]}); a 400
    for anything but messages with text parts."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": given}]}]
    if not given:
        raise _error("'input' must not be empty", param="input")
    items = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind != "message":
            raise _error(f"input[{i}]: items of type {kind!r} are not supported (only messages "
                         "with text)", param=f"input[{i}].type", code="unsupported_parameter")
        role, content = item.get("role"), item.get("content")
        if role not in _ROLES:
            raise _error(f"input[{i}].role must be one of {', '.join(_ROLES)}",
                         param=f"input[{i}].role")
        if isinstance(content, str):
            parts = [{"type": "output_text" if role == "assistant" else "input_text",
                      "text": content}]
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS \
                        or not isinstance(part.get("text"), str):
                    raise _error(f"input[{i}].content: only text parts are supported "
                                 "(input_text, output_text)", param=f"input[{i}].content",
                                 code="unsupported_parameter")
                parts.append({"type": part["type"], "text": part["text"]})
        else:
            raise _error(f"input[{i}].content must be a string or a list of text parts",
                         param=f"input[{i}].content")
        items.append({"type": "message", "role": role, "content": parts})
    return items


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Message items as the chat template takes them."""
    return [{"role": _ROLES[it["role"]], "content": "".join(p["text"] for p in it["content"])}
            for it in items]


# --- finding ----------------------------------------------------------------------------------
def store() -> ResponseStore:
    return current_app.extensions["llmq"]["responses"]


def find_response(resp_id: str, param: str | None = None) -> tuple[dict, dict]:
    """(job, request document) of one of the caller's stored responses, or a 404."""
    seq_id = seq_id_of(resp_id)
    job = engine().get(seq_id, g.owner) if is_seq_id(seq_id) else None
    doc = store().load(seq_id) if job is not None else None
    if job is None or doc is None or not doc.get("store", True):
        raise APIError(404, f"Response with id '{resp_id}' not found.", "invalid_request_error",
                       param=param, code="response_not_found" if param else None)
    return job, doc


def conversation_of(prev_id: str) -> list[dict[str, str]]:
    """The messages a previous response leaves: its conversation, then its output."""
    job, doc = find_response(prev_id, param="previous_response_id")
    status = status_of(job)[0]
    if status in ("queued", "in_progress"):
        raise _error(f"previous response {prev_id} has not finished (status {status})",
                     param="previous_response_id", code="previous_response_not_finished")
    return doc["conversation"] + [{"role": "assistant", "content": job.get("text") or ""}]


# --- routes -----------------------------------------------------------------------------------
@bp.post("/v1/responses")
def create_response():
    req = _parse(parse_json_body())
    items = input_messages(req.input)
    history: list[dict[str, str]] = []
    if req.previous_response_id is not None:
        history = conversation_of(req.previous_response_id)
    conversation = history + chat_messages(items)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    sampling = req.sampling(settings().batch_priority)
    if req.stream:
        take_stream_slot()
    doc = {"model": routed_model(req.model).name, "instructions": req.instructions,
           "conversation": conversation, "max_output_tokens": req.max_output_tokens,
           "temperature": req.temperature, "top_p": req.top_p,
           "text": req.text.model_dump(by_alias=True, exclude_none=True) if req.text else None,
           "metadata": req.metadata, "store": req.store is not False,
           "background": bool(req.background),
           "previous_response_id": req.previous_response_id,
           "service_tier": req.service_tier or "default", "user": req.user}

    def save(jobs: list[dict]) -> None:
        # Before its message goes: a worker (and the webhook dispatcher, which shapes the
        # events of a sequence with a request document as OpenAI's) never sees it without.
        hexid = jobs[0]["id"].removeprefix("seq-")
        doc["input"] = [{"id": f"msg_{hexid}_in{i}", **it, "status": "completed"}
                        for i, it in enumerate(items)]
        store().save(jobs[0]["id"], doc)

    job = submit([{"messages": system + conversation}], sampling,
                 max_tokens=req.max_output_tokens, max_tokens_param="max_output_tokens",
                 on_created=save, model=req.model, waits=not req.background)[0]
    seq_id = job["id"]
    headers = {"X-Request-Id": seq_id}
    if req.stream:
        return _sse(job, doc, -1, cancel_on_close=not req.background)
    if req.background:
        return jsonify(_annotated(job, doc)), 200, headers
    try:
        job = wait_or_cancel([seq_id], cancel_on_timeout=False)[0]
    except WaitTimedOut:   # still running after LLMQ_WAIT_TIMEOUT: the id lets the caller poll
        job = engine().get(seq_id, g.owner) or job
    if (err := failure_of(job)) is not None and err.status == 400:
        err.headers = headers
        raise err   # the prompt itself was refused by the worker
    return jsonify(_annotated(job, doc)), 200, headers


def _annotated(job: dict, doc: dict) -> dict:
    return queue_info.annotate(response_object(job, doc), job)


@bp.get("/v1/responses/<resp_id>")
def retrieve_response(resp_id: str):
    job, doc = find_response(resp_id)
    if request.args.get("stream", "false").lower() not in ("true", "1"):
        return jsonify(_annotated(job, doc))
    raw = request.args.get("starting_after", request.headers.get("Last-Event-ID", "-1"))
    try:
        after = int(raw)
    except ValueError:
        raise _error("'starting_after' must be an integer (a sequence_number)",
                     param="starting_after") from None
    take_stream_slot()
    return _sse(job, doc, after, cancel_on_close=False)


@bp.post("/v1/responses/<resp_id>/cancel")
def cancel_response(resp_id: str):
    job, doc = find_response(resp_id)
    return jsonify(_annotated(_cancelled(job), doc))


def _cancelled(job: dict) -> dict:
    """Cancels the response's sequence and waits (briefly) for it to end: a running one ends
    at its engine's next step."""
    eng, seq_id = engine(), job["id"]
    if status_of(job)[0] not in ("queued", "in_progress"):
        return job
    eng.cancel(seq_id, g.owner)
    deadline = time.monotonic() + CANCEL_WAIT_S
    for ev in eng.events(seq_id, keepalive_s=0.5):
        if ev is not None and ev[1] == EVENT_DONE:
            return ev[2]
        if time.monotonic() > deadline:
            break
    return eng.get(seq_id, g.owner) or job


@bp.delete("/v1/responses/<resp_id>")
def delete_response(resp_id: str):
    job, _doc = find_response(resp_id)
    seq_id = job["id"]
    _cancelled(job)
    freed = store().delete(seq_id)
    if freed is not None:
        current_app.extensions["llmq"]["jobs_index"].remove(g.owner, seq_id)
        engine().store.unstore(g.owner, seq_id, freed)
    return jsonify({"id": resp_id, "object": "response.deleted", "deleted": True})


@bp.get("/v1/responses/<resp_id>/input_items")
def list_input_items(resp_id: str):
    _job, doc = find_response(resp_id)
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _error("'order' must be asc or desc", param="order")
    try:
        limit = int(request.args.get("limit", 20))
    except ValueError:
        raise _error("'limit' must be an integer", param="limit") from None
    if not 1 <= limit <= 100:
        raise _error("'limit' must be between 1 and 100", param="limit")
    items = doc["input"] if order == "asc" else doc["input"][::-1]
    if after := request.args.get("after"):
        ids = [it["id"] for it in items]
        if after not in ids:
            raise _error(f"no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return jsonify({"object": "list", "data": page,
                    "first_id": page[0]["id"] if page else None,
                    "last_id": page[-1]["id"] if page else None,
                    "has_more": len(items) > limit})


# --- streaming --------------------------------------------------------------------------------
def _sse(job: dict, doc: dict, after: int, cancel_on_close: bool) -> Response:
    """The response's events numbered after `after`, replayed from its stored stream and then
    live, to its terminal event. `cancel_on_close`: a client that leaves cancels it (a
    response streamed without background belongs to its connection, as in OpenAI's)."""
    eng, owner, keepalive = engine(), g.owner, settings().sse_keepalive_s
    seq_id = job["id"]

    def gen() -> Iterator[str]:
        events = ResponseEventLog(job, doc)
        over = False
        try:
            yield from _lines(events.start(), after)
            waited = time.monotonic()
            for ev in eng.events(seq_id, keepalive_s=min(keepalive, 0.5)):
                if ev is None:
                    if client_gone():
                        return
                    if time.monotonic() - waited >= keepalive:
                        waited = time.monotonic()
                        yield ": keep-alive\n\n"
                    continue
                waited = time.monotonic()
                yield from _lines(events.feed(ev[1], ev[2]), after)
                if events.over:
                    over = True
                    return
        finally:
            if cancel_on_close and not over:
                try:
                    eng.cancel(seq_id, owner)
                except Exception:  # noqa: BLE001 - Redis down: the stream's end says so
                    log.warning("could not cancel a response whose client left", exc_info=True)

    return Response(stream_with_context(gen()), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                             "X-Request-Id": seq_id})


def _lines(events: list[dict], after: int) -> Iterator[str]:
    for ev in events:
        if ev["sequence_number"] > after:
            yield (f"id: {ev['sequence_number']}\nevent: {ev['type']}\n"
                   f"data: {json.dumps(ev, ensure_ascii=False)}\n\n")


def init_app(app: Flask) -> None:
    ext = app.extensions["llmq"]
    ext["responses"] = ext["store"].beside(ResponseStore, ext["settings"].pending_ttl_s)
    app.register_blueprint(bp)

