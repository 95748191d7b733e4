"""The one way work is queued: every submitting route (jobs, generate, OpenAI's, responses)
checks its limits and webhook, and queues its sequences, owned by the caller, here."""
from __future__ import annotations

from typing import Any, Callable

from flask import current_app, g

from common.protocol import SamplingParams
from common.webhook_guard import WebhookURLError

from . import submit_hooks
from .context import engine, settings
from .errors import APIError
from .limits import check_limits
from .model_routing import ready_model
from .schemas import JobRequest, SamplingFields, ToolFields
from .streaming import take_stream_slot, take_waiting_slot


def inputs_of(req: JobRequest) -> list[dict[str, Any]]:
    if req.prompts is not None:
        return [{"prompt": p} for p in req.prompts]
    if req.messages is not None:
        return [chat_input(req, [m.model_dump() for m in req.messages])]
    return [{"prompt": req.prompt}]


def chat_input(req: ToolFields, messages: list[dict]) -> dict[str, Any]:
    """The sequence input of a request's chat messages (the OpenAI route, a batch line,
    /v1/jobs), rendered for the model's chat template; a 400 when the tools' grammar cannot
    compile."""
    counter = engine().prompt_counter_for(getattr(req, "model", None)).get()
    inp = req.chat_input(messages, counter.template_source if counter else None,
                         settings().template_kwargs())
    if error := req.tools_error():
        raise APIError(400, f"cannot compile the tools' parameters: {error}", param="tools")
    return inp


def owned_params(req: SamplingFields, default_max_tokens: int,
                 max_tokens: int | None = None) -> SamplingParams:
    """The request's sampling parameters as the caller's: every route that queues work (a
    batch line too) builds them here. Cached prefixes are shared only within a key
    (cached_tokens would otherwise tell one key what another sent), so the key is put in front
    of the cache salt; the request's own salt still splits a key's cache further."""
    params = req.sampling_params(default_max_tokens, max_tokens)
    if g.owner and not settings().share_prefix_cache:
        params.cache_salt = g.owner + ("/" + params.cache_salt if params.cache_salt else "")
    return params


def submit(inputs: list[dict[str, Any]], req: SamplingFields,
           default_max_tokens: int | None = None, max_tokens: int | None = None,
           max_tokens_param: str = "max_tokens", n: int = 1,
           on_created: Callable[[list[dict]], None] | None = None,
           model: str | None = None, waits: bool = False) -> list[dict]:
    """Checks the request's limits and webhook, then queues one sequence per input with its
    sampling and queueing fields, owned by the caller (every submitting route, OpenAI's
    included, comes through here). `max_tokens` overrides the field (OpenAI's
    max_completion_tokens); with n > 1, n sequences per input, each with its own seed
    (input-major order). `on_created(jobs)`: the route's own writes beside the records, made
    before any worker can see them. `model` (else the request's): whose queue takes them.
    `waits`: the route waits on this thread for the result (a slot of the key's
    LLMQ_KEY_MAX_WAITING)."""
    s, eng = settings(), engine()
    model = ready_model(model or getattr(req, "model", None)).name
    default_max_tokens = default_max_tokens or s.default_max_tokens
    check_limits(s, req, inputs, max_tokens=max_tokens or req.max_tokens,
                 default_max_tokens=default_max_tokens,
                 counter=eng.prompt_counter_for(model).get(),
                 context_len=eng.context_length(model), max_tokens_param=max_tokens_param)
    hook = checked_webhook(req)
    params = owned_params(req, default_max_tokens, max_tokens)
    if n > 1:
        inputs = [{**inp, "params": p} for inp in inputs for p in params.copies(n)]
    if getattr(req, "stream", False):
        take_stream_slot()
    elif waits:
        take_waiting_slot()
    # Indexed and hooked before the messages go: a failure there is a 503 with nothing queued
    # (after them, the 503 came for jobs that ran anyway, and a retry ran them twice).
    ext, owner = current_app.extensions["llmq"], g.owner

    def before_queue(jobs):
        submit_hooks.index_and_hook(ext, owner, jobs, hook)
        if on_created is not None:
            on_created(jobs)

    return eng.submit(inputs, params, owner, req.timeout, req.priority,
                      before_queue=before_queue,
                      unqueue=lambda ids: submit_hooks.unindex_and_unhook(ext, owner, ids, hook),
                      model=model)


def checked_webhook(req) -> tuple[str, list[str]] | None:
    """The request's webhook (url, events), or None; a 400 when it is not allowed."""
    try:
        return submit_hooks.checked_webhook(req, settings())
    except WebhookURLError as exc:
        raise APIError(400, str(exc), param="webhook") from None
