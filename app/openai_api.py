"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Each request becomes sequences like any other (same ids, visible at /v1/jobs/<id> and in
Flower). A client that disconnects from a streaming or waiting request cancels its sequences.
"""
from __future__ import annotations

import functools
import logging
from typing import Annotated, Any

from flask import Blueprint, Response, jsonify, stream_with_context
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common import reasoning
from common.openai_responses import ChoiceShaper, best_candidates, response_body, usage
from common.protocol import SamplingParams

from .context import engine, settings
from .request_body import parse_json_body
from .submit import chat_input, submit
from .errors import APIError
from .model_routing import listed_models, model_object, routed_model
from .schemas import MAX_LOGPROBS, Message, SamplingFields, ToolFields
from .openai_stream import count_tokens, stream_chunks
from .waiting import wait_or_cancel

bp = Blueprint("openai", __name__)
log = logging.getLogger("llmq.api")

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
        gen = stream_chunks(req, jobs, ChoiceShaper(jobs, chat, **shape_options(req)),
                            jobs[0]["model"])
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
        reasoning.add_reasoning_tokens(body["usage"], [f["text"] for f in finals],
                                       functools.partial(count_tokens, req.model))
    return jsonify(body), 200, headers
