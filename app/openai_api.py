"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Each request becomes sequences like any other (same ids, visible at /v1/jobs/<id> and in
Flower). A client that disconnects from a streaming or waiting request cancels its sequences.
"""
from __future__ import annotations

import json
import time
from typing import Any, Iterator, Literal

from flask import Blueprint, Response, g, jsonify, stream_with_context
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.protocol import EVENT_DONE, EVENT_RESET, EVENT_TOKEN

from .api_server import engine, parse_json_body, settings, submit
from .errors import APIError, failure_of
from .schemas import SamplingFields
from .waiting import Abandoned, cancel_all, follow, wait_or_cancel

bp = Blueprint("openai", __name__)

# Parameters OpenAI clients send that would change the output and that llmq does not implement:
# refused by name rather than silently ignored. A value equal to "off" is accepted.
_UNSUPPORTED_OFF = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
                    "best_of": (None, 1), "logit_bias": (None, {}), "suffix": (None, ""),
                    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
                    "response_format": (None, {"type": "text"}), "n": (None, 1),
                    "use_beam_search": (None, False)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(SamplingFields):
    """Fields shared by completions and chat completions: llmq's sampling fields (OpenAI's
    names plus vLLM's extras) and OpenAI's own."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = None
    # accepted only with their neutral values (see _UNSUPPORTED_OFF)
    n: int | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    logit_bias: Any = None
    suffix: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    response_format: Any = None
    use_beam_search: Any = None


class CompletionRequest(_Common):
    prompt: str | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def _error(message: str, param: str | None = None, code: str | None = None,
           status: int = 400) -> APIError:
    return APIError(status, message, "invalid_request_error", param=param, code=code)


def _parse(model_cls):
    return validate_request(model_cls, parse_json_body())


def validate_request(model_cls, body: dict):
    """A request body checked as the route checks it (batch lines are checked with it too)."""
    unknown = sorted(set(body) - set(model_cls.model_fields))
    if unknown:
        raise _error(f"unsupported parameter(s): {', '.join(unknown)}", param=unknown[0],
                     code="unsupported_parameter")
    try:
        req = model_cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise _error(f"{param}: {err['msg'].removeprefix('Value error, ')}" if param
                     else err["msg"], param=param) from None
    for name, neutral in _UNSUPPORTED_OFF.items():
        if getattr(req, name, None) not in neutral:
            raise _error(f"'{name}' is not supported by this server"
                         + (" (only n=1)" if name == "n" else ""), param=name,
                         code="unsupported_parameter")
    served = served_model_names()
    if req.model is not None and req.model not in served:
        raise APIError(404, f"The model `{req.model}` does not exist.", "invalid_request_error",
                       param="model", code="model_not_found")
    if req.request_id is not None:
        # vLLM runs the request under the caller's id; llmq's ids are its own (one key must
        # never name, or collide with, another's sequences), so it is refused, not ignored.
        raise _error("'request_id' is not supported: llmq assigns each request its id (the "
                     "response's `id` and its X-Request-Id header)", param="request_id",
                     code="unsupported_parameter")
    return req   # lengths, counts and the context are submit()'s check_limits


def served_model_names() -> list[str]:
    name = settings().model
    return [model_id(), name]


def model_id() -> str:
    """The public model name: the default's real name, else the configured id or folder name."""
    name = settings().model
    if name == "smollm2":
        return "SmolLM2-135M-Instruct"
    return name.rstrip("/").split("/")[-1] if name.startswith("/") else name


def _text_content(content) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise _error("only text content parts are supported", param="messages")
        parts.append(part.get("text", ""))
    return "".join(parts)


def _usage(jobs: list[dict]) -> dict:
    p = sum(j["usage"]["prompt_tokens"] for j in jobs)
    c = sum(j["usage"]["completion_tokens"] for j in jobs)
    cached = sum(j["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for j in jobs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finish_reason(job: dict) -> str | None:
    """OpenAI's finish reason; a failure or a timeout never gets here (see failure_of)."""
    reason = job.get("finish_reason")
    return "abort" if reason == "cancelled" else reason


# --- routes -----------------------------------------------------------------------------------
@bp.get("/v1/models")
def list_models():
    return jsonify({"object": "list", "data": [
        {"id": model_id(), "object": "model", "created": 0, "owned_by": "llmq",
         "root": settings().model}]})


@bp.post("/v1/completions")
def completions():
    req = _parse(CompletionRequest)
    inputs, options = to_sequences(req)
    return _respond(req, submit(inputs, req, **options), chat=False)


@bp.post("/v1/chat/completions")
def chat_completions():
    req = _parse(ChatCompletionRequest)
    inputs, options = to_sequences(req)
    return _respond(req, submit(inputs, req, **options), chat=True)


def to_sequences(req: _Common) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The sequences a request becomes, and submit()'s max_tokens options for them (routes and
    batch lines alike)."""
    if isinstance(req, ChatCompletionRequest):
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": _text_content(m.content)} for m in req.messages]
        return [{"messages": messages}], {
            "max_tokens": req.max_completion_tokens,
            "max_tokens_param": "max_completion_tokens" if req.max_completion_tokens
            else "max_tokens"}
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if not prompts or any(not p for p in prompts):
        raise _error("prompt must be a non-empty string or list of strings", param="prompt")
    if req.stream and len(prompts) > 1:
        raise _error("streaming takes a single prompt", param="prompt")
    return [{"prompt": p} for p in prompts], {"default_max_tokens": 16}


def _respond(req: _Common, jobs: list[dict], chat: bool):
    headers = {"X-Request-Id": jobs[0]["id"]}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        gen = _stream_chunks(jobs[0], chat, include_usage)
        return Response(stream_with_context(gen), mimetype="text/event-stream",
                        headers={**headers, "Cache-Control": "no-cache"})
    try:
        # A sequence that failed fails the request (its status and error, see failure_of).
        finals = wait_or_cancel([j["id"] for j in jobs], fail_fast=True)
    except APIError as err:
        err.headers = {**headers, **err.headers}
        raise
    return jsonify(response_body(finals, chat, model_id())), 200, headers


def response_body(finals: list[dict], chat: bool, model: str) -> dict:
    """The completion (or chat completion) object of finished jobs (batch output lines too)."""
    if chat:
        choices = [{"index": 0, "message": {"role": "assistant", "content": finals[0]["text"]},
                    "logprobs": None, "finish_reason": _finish_reason(finals[0])}]
    else:
        choices = [{"index": i, "text": f["text"], "logprobs": None,
                    "finish_reason": _finish_reason(f)} for i, f in enumerate(finals)]
    return {"id": finals[0]["id"], "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": _usage(finals)}


class SentText:
    """What an OpenAI stream has sent, kept true across a `reset` (the worker running the
    sequence was lost and another runs it again from the start). Text sent cannot be taken
    back, so the re-run's text is held until it passes what the client has: a re-run that
    repeats it (greedy decoding, or a `seed`) continues the stream seamlessly; one that
    differs ends it with an error."""

    def __init__(self):
        self.sent = ""
        self.rerun: str | None = None   # the re-run's text while it is behind `sent`
        self.was_reset = False

    def reset(self) -> None:
        self.rerun, self.was_reset = "", True

    def piece(self, text: str) -> str:
        """What to send for a token event's text ("" while a re-run is catching up)."""
        if self.rerun is None:
            self.sent += text
            return text
        self.rerun += text
        return self._catch_up(self.rerun)

    def rest(self, final_text: str) -> str:
        """At the end: what the client still lacks (only a re-run can leave anything)."""
        return self._catch_up(final_text) if self.was_reset else ""

    def _catch_up(self, text: str) -> str:
        n = min(len(text), len(self.sent))
        if text[:n] != self.sent[:n]:
            raise APIError(500, "the worker running this request was lost and the re-run "
                           "produced different text from what was already streamed; retry the "
                           "request (with temperature 0 or a seed, a re-run repeats itself)",
                           "server_error", code="stream_diverged")
        if len(text) <= len(self.sent):
            return ""
        out, self.sent, self.rerun = text[len(self.sent):], text, None
        return out


def _stream_chunks(job: dict, chat: bool, include_usage: bool) -> Iterator[str]:
    eng, seq_id, owner = engine(), job["id"], g.owner
    created, model = int(time.time()), model_id()
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else (
                {"content": delta_text} if delta_text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta_text or "", "logprobs": None,
                      "finish_reason": finish}
        return _data({"id": seq_id, "object": obj, "created": created, "model": model,
                      "choices": [choice]})

    finished, text = False, SentText()
    try:
        if chat:
            yield chunk(None, None, role=True)
        for _id, kind, data in follow(seq_id):
            if kind == EVENT_RESET:
                text.reset()
            elif kind == EVENT_TOKEN and (piece := text.piece(data["text"])):
                yield chunk(piece, None)
            elif kind == EVENT_DONE:
                if err := failure_of(data):
                    finished = True
                    raise err
                if rest := text.rest(data["text"]):
                    yield chunk(rest, None)
                finished = True
                yield chunk(None if chat else "", _finish_reason(data))
                if include_usage:
                    yield _data({"id": seq_id, "object": obj, "created": created, "model": model,
                                 "choices": [], "usage": _usage([data])})
                yield "data: [DONE]\n\n"
                return
    except Abandoned:
        return   # nobody is reading (finally cancels)
    except APIError as err:
        # The status line went out with the first chunk: the error is the last chunk, as vLLM
        # sends it (the openai client raises APIError from it).
        yield err.sse_chunk()
        yield "data: [DONE]\n\n"
    finally:
        if not finished:   # the client went away, the server is stopping, or the text broke
            cancel_all(eng, [seq_id], owner)


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
