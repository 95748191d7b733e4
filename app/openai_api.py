"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Each request becomes sequences like any other (same ids, visible at /v1/jobs/<id> and in
Flower). A client that disconnects from a streaming or waiting request cancels its sequences.
"""
from __future__ import annotations

import functools
import json
import logging
import time
from typing import Annotated, Any, Iterator, Literal

import redis
from flask import Blueprint, Response, g, jsonify, stream_with_context
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common import reasoning
from common.openai_responses import (ChoiceShaper, best_candidates, finish_reason,
                                     response_body, usage)
from common.protocol import EVENT_DONE, EVENT_RESET, EVENT_TOKEN, SamplingParams

from .context import engine, settings
from .request_body import parse_json_body
from .submit import chat_input, submit
from .client_connection import client_gone
from .errors import APIError, failure_of
from .model_routing import listed_models, model_object, routed_model
from .schemas import MAX_LOGPROBS, Message, SamplingFields, ToolFields
from .waiting import cancel_all, wait_or_cancel

bp = Blueprint("openai", __name__)
log = logging.getLogger("llmq.api")

# How long an OpenAI stream waits out a Redis it cannot read before it ends with an error chunk.
REDIS_OUTAGE_S = 30.0

# Fields of vLLM's (and OpenAI's) request bodies beyond the ones the models below take.
# Refused: they would change the output and llmq does not implement them, so a value other
# than these neutral ones is a 400 naming the field, never silently dropped.
_REFUSED = {"echo": (None, False), "suffix": (None, ""), "use_beam_search": (None, False),
            "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
            "function_call": (None, "none"), "include_stop_str_in_output": (None, False),
            "skip_special_tokens": (None, True), "allowed_token_ids": (None,),
            "bad_words": (None, []), "logits_processors": (None, []), "prompt_embeds": (None,),
            "truncate_prompt_tokens": (None,), "add_generation_prompt": (None, True),
            "continue_final_message": (None, False), "chat_template": (None,),
            "documents": (None,), "return_token_ids": (None, False), "best_of": (None, 1),
            "guided_decoding_backend": (None,)}
# Accepted and ignored (a warning in the log): they do not change the text llmq makes.
# (A name that is also a field of the request's model is that field: chat's tools,
# tool_choice, parallel_tool_calls and chat_template_kwargs.)
_IGNORED = {"user", "service_tier", "store", "metadata", "parallel_tool_calls",
            "reasoning_effort", "include_reasoning", "length_penalty",
            "spaces_between_special_tokens", "add_special_tokens", "chat_template_kwargs",
            "mm_processor_kwargs", "kv_transfer_params", "vllm_xargs", "guided_whitespace_pattern",
            "prompt_cache_key", "safety_identifier", "verbosity", "prediction"}
# vLLM's older names for structured_outputs' members.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM: usage in every chunk (with include_usage)
    include_obfuscation: bool = True   # OpenAI's padding field on chunks: none is sent here


class _Common(SamplingFields):
    """Fields shared by completions and chat completions: llmq's sampling fields (OpenAI's
    names plus vLLM's extras) and OpenAI's own."""

    NULL_IS_DEFAULT = SamplingFields.NULL_IS_DEFAULT | {"n", "stream",
                                                         "return_tokens_as_token_ids"}

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    request_id: str | None = None
    n: int = Field(1, ge=1, le=64)
    return_tokens_as_token_ids: bool = False   # vLLM: logprobs tokens as "token_id:<id>"

    def problem(self) -> tuple[str, str] | None:
        """(param, message) for fields that are valid alone but not together."""
        if self.stream and self.prompt_logprobs is not None:   # as vLLM refuses it
            return "prompt_logprobs", "prompt_logprobs are not available when stream is true"
        if self.stream_options is not None and not self.stream:   # as OpenAI and vLLM refuse it
            return "stream_options", "stream_options are only allowed when stream is true"
        return None

    @property
    def num_candidates(self) -> int:
        """Sequences per prompt (completions' best_of may ask for more than n)."""
        return self.n


TokenIds = list[Annotated[int, Field(ge=0, le=2**31 - 1)]]


class CompletionRequest(_Common):
    NULL_IS_DEFAULT = _Common.NULL_IS_DEFAULT | {"echo"}

    # text, texts, token ids, or lists of token ids (what harnesses send pre-tokenized)
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(None, ge=0)   # 0 with echo: score the prompt only
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=64)   # candidates per prompt; the n best return

    def problem(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens: 0 needs echo (it returns the prompt and its logprobs)"
        if self.best_of is not None and self.best_of < self.n:
            return "best_of", f"best_of ({self.best_of}) must be at least n ({self.n})"
        if self.stream and self.ranks_candidates:
            return "best_of", "best_of > n cannot be streamed (the best are known at the end)"
        return super().problem()

    @property
    def num_candidates(self) -> int:
        """best_of candidates are generated per prompt, the n best returned."""
        return self.best_of or self.n

    @property
    def ranks_candidates(self) -> bool:
        return self.num_candidates > self.n

    def sampling_params(self, default_max_tokens: int, max_tokens: int | None = None
                        ) -> SamplingParams:
        params = super().sampling_params(default_max_tokens, max_tokens)
        if self.ranks_candidates and params.logprobs is None:
            params.logprobs = 0   # the sampled tokens' logprobs rank the candidates
        return params

    def num_prompt_logprobs(self) -> int | None:
        """Echo scores the prompt's tokens too (what evaluation harnesses send); its entries
        also carry the prompt's text back for a prompt given as token ids."""
        if self.echo:
            return max(self.logprobs or 0, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def inputs(self) -> list[dict[str, Any]]:
        """One sequence input per prompt: {"prompt": text} or {"prompt_token_ids": ids}."""
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if p and all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": p}]
        return [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": x} for x in p]


class ChatMessage(Message):
    """A chat message as OpenAI's clients send it: content parts too, and fields of their
    own (a message's `name`) accepted."""

    model_config = ConfigDict(extra="allow")
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(ToolFields, _Common):
    NULL_IS_DEFAULT = _Common.NULL_IS_DEFAULT | ToolFields.NULL_IS_DEFAULT

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None   # chat: a flag; top_logprobs says how many alternatives
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def problem(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs: needs logprobs true"
        return self.tools_problem() or super().problem()

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _error(message: str, param: str | None = None, code: str | None = None,
           status: int = 400) -> APIError:
    return APIError(status, message, "invalid_request_error", param=param, code=code)


def _parse(model_cls):
    return validate_request(model_cls, parse_json_body())


def validate_request(model_cls, body: dict):
    """A request body checked as the route checks it (batch lines are checked with it too)."""
    fields = set(model_cls.model_fields)
    unknown = sorted(set(body) - fields - set(_REFUSED) - _IGNORED - set(_GUIDED))
    if unknown:
        raise _error(f"unsupported parameter(s): {', '.join(unknown)}", param=unknown[0],
                     code="unsupported_parameter")
    for name in sorted(set(body) & set(_REFUSED) - fields):
        if body[name] not in _REFUSED[name]:
            raise _error(f"'{name}' is not supported by this server", param=name,
                         code="unsupported_parameter")
    ignored = sorted(n for n in set(body) & _IGNORED - fields if body[n] is not None)
    if ignored:
        log.warning("accepted and ignored: %s", ", ".join(ignored))
    guided = {_GUIDED[n]: body[n] for n in _GUIDED if body.get(n) is not None}
    body = {k: v for k, v in body.items() if k in fields}
    if guided and "structured_outputs" not in body:
        body["structured_outputs"] = guided
    try:
        req = model_cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise _error(f"{param}: {err['msg'].removeprefix('Value error, ')}" if param
                     else err["msg"].removeprefix("Value error, "), param=param) from None
    problem = req.problem()
    if problem:
        raise _error(problem[1], param=problem[0])
    routed_model(req.model)
    if req.request_id is not None:
        # vLLM runs the request under the caller's id; llmq's ids are its own (one key must
        # never name, or collide with, another's sequences), so it is refused, not ignored.
        raise _error("'request_id' is not supported: llmq assigns each request its id (the "
                     "response's `id` and its X-Request-Id header)", param="request_id",
                     code="unsupported_parameter")
    return req   # lengths, counts and the context are submit()'s check_limits


def _text_content(content) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise _error("only text content parts are supported", param="messages")
        if not isinstance(part.get("text"), str):   # (a number or null was a 500)
            raise _error("a text content part needs a string 'text'", param="messages")
        parts.append(part["text"])
    return "".join(parts)


# --- routes -----------------------------------------------------------------------------------
@bp.get("/v1/models")
def list_models():
    """The models a live worker serves (with one model: that model)."""
    if len(settings().served_models()) > 1:
        engine().live_workers(fresh=True)   # (a listing is rare: the registry as it is now)
    return jsonify({"object": "list", "data": [model_object(m) for m in listed_models()]})


@bp.get("/v1/models/<path:name>")
def retrieve_model(name: str):
    """client.models.retrieve(name): the model object for any name a request may give."""
    return jsonify(model_object(routed_model(name)))


@bp.post("/v1/completions")
def completions():
    req = _parse(CompletionRequest)
    inputs, options = to_sequences(req)
    return _respond(req, submit(inputs, req, **options, waits=True), chat=False)


@bp.post("/v1/chat/completions")
def chat_completions():
    req = _parse(ChatCompletionRequest)
    inputs, options = to_sequences(req)
    return _respond(req, submit(inputs, req, **options, waits=True), chat=True)


def to_sequences(req: _Common) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The sequences a request becomes, and submit()'s options for them (routes and batch
    lines alike)."""
    if isinstance(req, ChatCompletionRequest):
        if req.n > settings().max_prompts:   # n sequences, as completions counts them
            raise _error(f"at most {settings().max_prompts} sequences (n)", param="n")
        messages = [{**m.model_dump(include={"role", "tool_calls", "tool_call_id"}),
                     "content": _text_content(m.content) if m.content is not None else None}
                     for m in req.messages]
        return [chat_input(req, messages)], {
            "max_tokens": req.max_completion_tokens, "n": req.n,
            "max_tokens_param": "max_completion_tokens" if req.max_completion_tokens
            else "max_tokens"}
    inputs = req.inputs()
    if not inputs or any(not next(iter(i.values())) for i in inputs):
        raise _error("prompt must be a non-empty string or list of token ids, or a list of "
                     "those", param="prompt")
    if len(inputs) * req.num_candidates > settings().max_prompts:
        raise _error(f"at most {settings().max_prompts} sequences (prompts x best_of or n)",
                     param="prompt")
    return inputs, {"default_max_tokens": 16, "n": req.num_candidates}


def shape_options(req: _Common) -> dict[str, Any]:
    """How a request's choices are shaped: ChoiceShaper's options (a batch line keeps them);
    chat's depend on the model's template (its thinking markers, its call format)."""
    shape = {"echo": bool(getattr(req, "echo", False)),
             "wants_logprobs": req.num_logprobs() is not None,
             "as_ids": req.return_tokens_as_token_ids,
             "prompt_logprobs": req.prompt_logprobs is not None}
    if isinstance(req, ChatCompletionRequest):
        counter = engine().prompt_counter_for(req.model).get()
        shape["reasoning"] = reasoning.template_reasons(counter and counter.template_source)
        shape["tools"] = req._tools.shape() if req._tools is not None else None
    return shape


def _respond(req: _Common, jobs: list[dict], chat: bool):
    headers = {"X-Request-Id": jobs[0]["id"]}
    if req.stream:
        gen = _stream_chunks(req, jobs, ChoiceShaper(jobs, chat, **shape_options(req)))
        return Response(stream_with_context(gen), mimetype="text/event-stream",
                        headers={**headers, "Cache-Control": "no-cache",
                                 "X-Accel-Buffering": "no"})
    try:
        # A sequence that failed fails the request (its status and error, see failure_of).
        finals = wait_or_cancel([j["id"] for j in jobs], fail_fast=True)
    except APIError as err:
        err.headers = {**headers, **err.headers}
        raise
    k = req.num_candidates
    chosen = best_candidates(finals, k, req.n) if k > req.n else finals
    body = response_body(chosen, chat, jobs[0]["model"],
                         ChoiceShaper(chosen, chat, **shape_options(req)), req.n)
    body["usage"] = usage(finals, k)   # with best_of, every candidate's tokens were spent
    if chat and shape_options(req).get("reasoning"):
        count = functools.partial(_count, req.model)
        reasoning.add_reasoning_tokens(body["usage"], [f["text"] for f in finals], count)
    return jsonify(body), 200, headers


def _count(model: str | None, text: str) -> int:
    """Tokens of a text as the model's tokenizer makes them (0 without a tokenizer here)."""
    counter = engine().prompt_counter_for(model).get()
    return len(counter.tokenizer.encode(text, add_special_tokens=False).ids) if counter else 0


class SentText:
    """What an OpenAI stream has sent, kept true across a `reset` (the worker running the
    sequence was lost and another runs it again from the start). Text sent cannot be taken
    back, so the re-run's text is held until it passes what the client has: a re-run that
    repeats it (greedy decoding, or a `seed`) continues the stream seamlessly; one that
    differs ends it with an error. A token costs its own length, not the stream's: what was
    sent is kept in pieces, and a re-run is matched against it piece by piece."""

    def __init__(self):
        self._sent: list[str] = []
        self.rerun_at: int | None = None   # how much of `sent` the re-run has repeated so far
        self.was_reset = False

    @property
    def sent(self) -> str:
        if len(self._sent) > 1:   # joined when read (a reset, the end), not at each token
            self._sent[:] = ["".join(self._sent)]
        return self._sent[0] if self._sent else ""

    def reset(self) -> None:
        self.rerun_at, self.was_reset = 0, True

    def piece(self, text: str) -> str:
        """What to send for a token event's text ("" while a re-run is catching up)."""
        if self.rerun_at is None:
            self._sent.append(text)
            return text
        sent, at = self.sent, self.rerun_at
        self._check(text, sent, at)
        if at + len(text) <= len(sent):
            self.rerun_at = at + len(text)
            return ""
        return self._send(text[len(sent) - at:])

    def rest(self, final_text: str) -> str:
        """At the end: what the client still lacks. A re-run's text past what was sent, or the
        tail the worker held back (the start of a possible stop string, half a character)
        when the sequence ended otherwise: cancelled, timed out, failed."""
        sent = self.sent
        if self.was_reset:
            self._check(final_text, sent, 0)
        elif not final_text.startswith(sent):
            return ""
        return self._send(final_text[len(sent):]) if len(final_text) > len(sent) else ""

    def _send(self, text: str) -> str:
        self._sent.append(text)
        self.rerun_at = None
        return text

    @staticmethod
    def _check(text: str, sent: str, at: int) -> None:
        """A re-run's `text`, starting at `at` in what was sent, must repeat what it overlaps."""
        n = min(len(text), len(sent) - at)
        if text[:n] != sent[at:at + n]:
            raise APIError(500, "the worker running this request was lost and the re-run "
                           "produced different text from what was already streamed; retry the "
                           "request (with temperature 0 or a seed, a re-run repeats itself)",
                           "server_error", code="stream_diverged")


class _Choice:
    """Where one sequence's stream stands."""

    def __init__(self, seq_id: str):
        self.seq_id = seq_id
        self.after = "0-0"
        self.started = False          # its first chunk (role or echo) went out
        self.num_tokens = 0           # token events seen
        self.num_entries = 0          # logprobs entries sent
        self.prompt_tokens = 0
        self.done = False
        self.final: dict | None = None   # its done event's job
        self.text = SentText()           # what went out, kept true across a `reset`


def _stream_chunks(req: _Common, jobs: list[dict], shaper: ChoiceShaper) -> Iterator[str]:
    """The request's sequences as one chunk stream; with n > 1 (or several prompts) the
    choices' chunks interleave as their tokens arrive, each carrying its choice index."""
    eng, owner, chat = engine(), g.owner, shaper.chat
    created, model = int(time.time()), jobs[0]["model"]
    obj = "chat.completion.chunk" if chat else "text_completion"
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and opts.continuous_usage_stats   # vLLM asks for both
    choices = [_Choice(j["id"]) for j in jobs]
    by_id = {c.seq_id: i for i, c in enumerate(choices)}

    def chunk(i: int, text: str, entries: list[dict], finish: str | None = None,
              role: bool = False, delta: dict | None = None) -> str:
        choice = (shaper.delta_choice(i, delta, entries, finish) if delta is not None
                  else shaper.choice(i, text, entries, finish, delta=True, role=role))
        body = {"id": jobs[0]["id"], "object": obj, "created": created, "model": model,
                "choices": [choice]}
        if continuous:
            c = choices[i]
            body["usage"] = {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.num_tokens,
                             "total_tokens": c.prompt_tokens + c.num_tokens}
        return _data(body)

    def start(i: int, prompt_entries: list[dict] | None) -> Iterator[str]:
        """A choice's first chunk: the role (chat), or the echoed prompt (completions)."""
        c = choices[i]
        c.started = True
        if continuous:
            job = eng.get(c.seq_id, owner)
            c.prompt_tokens = job["usage"]["prompt_tokens"] if job else 0
        if chat:
            yield chunk(i, "", [], role=True)
        elif shaper.echo:
            text, entries = shaper.echoed(i, prompt_entries)
            yield chunk(i, text, entries)

    sub = eng.streams.subscribe({c.seq_id: c.after for c in choices})
    keepalive_s, wrote, redis_down_since = settings().sse_keepalive_s, time.monotonic(), None
    try:
        if chat and not continuous:   # the role goes out at once (continuous: with usage)
            for i in range(len(choices)):
                yield from start(i, None)
        while not all(c.done for c in choices):
            try:
                events = sub.read(1.0)
                if not events and any(eng.store.get_record(c.seq_id) is None
                                      for c in choices if not c.done):
                    return   # expired underneath us
                redis_down_since = None   # (Redis answered)
            except redis.RedisError:
                # The hub's reader reconnects and the streams keep every event: wait it out
                # (keep-alives go on), up to a bound.
                redis_down_since = redis_down_since or time.monotonic()
                if time.monotonic() - redis_down_since > REDIS_OUTAGE_S:
                    raise
                events = []
            if not events:
                if time.monotonic() - wrote >= keepalive_s:
                    # A comment line (clients skip it): a queued stream, or a completion
                    # before its first token, still writes, so its slot lease is renewed and
                    # proxies keep the connection.
                    wrote = time.monotonic()
                    yield ": keep-alive\n\n"
                if client_gone():
                    return
                continue
            wrote = time.monotonic()
            for seq_id, entry_id, kind, data in events:
                i = by_id[seq_id]
                c = choices[i]
                c.after = entry_id
                if kind == EVENT_RESET:   # a lost worker's sequence runs again from its prompt
                    c.text.reset()
                    c.num_tokens = 0      # the re-run's tokens are counted from its first
                elif kind == EVENT_TOKEN:
                    if not c.started:
                        yield from start(i, data.get("prompt_logprobs"))
                    piece = c.text.piece(data["text"])
                    # A re-run's tokens up to the entries already sent repeat them: only the
                    # entries past those go out (by position, not by text: the token that
                    # crosses what was sent brings text and its entry both).
                    entries = (data.get("logprobs") or [])[max(0, c.num_entries - c.num_tokens):]
                    c.num_tokens += 1
                    c.num_entries += len(entries)
                    if chat:
                        deltas = shaper.deltas(i, piece)
                        if not deltas and entries and shaper.wants_logprobs:
                            deltas = [{}]
                        for k, d in enumerate(deltas):
                            yield chunk(i, "", entries if k == 0 else [], delta=d)
                    elif piece or (entries and shaper.wants_logprobs):
                        yield chunk(i, piece, entries)
                elif kind == EVENT_DONE:
                    if err := failure_of(data):
                        c.done = True
                        raise err
                    if not c.started:
                        yield from start(i, data.get("prompt_logprobs"))
                    rest = c.text.rest(data["text"])
                    finish = finish_reason(data)
                    if chat:
                        deltas, finish = shaper.end_deltas(i, rest, finish)
                        for d in deltas:
                            yield chunk(i, "", [], delta=d)
                    elif rest:
                        yield chunk(i, rest, [])
                    c.num_tokens = data["usage"]["completion_tokens"]
                    rest_lp = data.get("logprobs", [])[c.num_entries:]   # the last token's
                    yield chunk(i, "", rest_lp, finish)
                    c.done = True
                    c.final = data
                    sub.drop(seq_id)
        if include_usage:
            total = usage([c.final for c in choices], req.n)
            if shaper.reasoning:
                reasoning.add_reasoning_tokens(total, [c.final["text"] for c in choices],
                                               functools.partial(_count, req.model))
            yield _data({"id": jobs[0]["id"], "object": obj, "created": created, "model": model,
                         "choices": [], "usage": total})
        yield "data: [DONE]\n\n"
    except APIError as err:
        # The status line went out with the first chunk: the error is the last chunk, as vLLM
        # sends it (the openai client raises APIError from it).
        yield err.sse_chunk()
        yield "data: [DONE]\n\n"
    except redis.RedisError as exc:   # Redis gone past REDIS_OUTAGE_S: ended, not cut off
        log.warning("stream ended: redis unavailable: %s", exc)
        yield APIError(503, "the service lost its connection to Redis; retry the request",
                       "server_error", code="service_unavailable").sse_chunk()
        yield "data: [DONE]\n\n"
    finally:
        # The client went away, the server is stopping, or a sequence failed or diverged:
        # stop the request's other sequences.
        sub.close()
        cancel_all(eng, [c.seq_id for c in choices if not c.done], owner)


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
