"""The one limits check every submitting route runs before anything is queued (/v1/jobs,
/v1/generate, /v1/completions, /v1/chat/completions): a request it refuses is a 400 in the one
error shape, and nothing is written.

Context length, as vLLM: a prompt must leave room for at least one token; an explicit
`max_tokens` (or `max_completion_tokens`) that does not fit beside the prompt is refused; an
unset one (the route's default) is cut to the room left, so the sequence ends with
finish_reason "length" at the end of the context.
"""
from __future__ import annotations

from typing import Any

from .errors import APIError
from .schemas import SamplingFields


def check_limits(settings, req: SamplingFields, inputs: list[dict[str, Any]], *,
                 max_tokens: int | None, default_max_tokens: int, counter=None,
                 context_len: int | None = None, max_tokens_param: str = "max_tokens") -> None:
    """Raises APIError(400) for the first limit the request breaks. `max_tokens` is the
    caller's explicit value (None: the default applies); `counter` (a PromptCounter) and
    `context_len` (the workers' context per sequence) enable the context checks."""
    s = settings
    prompt_param = "messages" if inputs and inputs[0].get("messages") is not None else "prompt"
    if len(inputs) > s.max_prompts:
        raise _refuse(f"at most {s.max_prompts} prompts per request", prompt_param)
    if max_tokens is not None and max_tokens > s.max_tokens_limit:
        raise _refuse(f"'{max_tokens_param}' must be at most {s.max_tokens_limit}",
                      max_tokens_param)
    effective = max_tokens or default_max_tokens
    if req.min_tokens > effective:
        default = "" if max_tokens else ", the default"
        raise _refuse(f"'min_tokens' ({req.min_tokens}) must not exceed '{max_tokens_param}' "
                      f"({effective}{default})", "min_tokens")
    if len(req.stop) > s.max_stop:
        raise _refuse(f"at most {s.max_stop} stop strings", "stop")
    # Stop strings are matched against the text at every token: their number and length bound
    # that work, whatever route they came through.
    if any(len(x) > s.max_stop_chars for x in req.stop):
        raise _refuse(f"stop strings are at most {s.max_stop_chars} characters", "stop")
    for inp in inputs:
        if _num_chars(inp) > s.max_prompt_chars:
            raise _refuse(f"prompt too long (at most {s.max_prompt_chars} characters each)",
                          prompt_param)
    if counter is None or not context_len:
        return
    for i, inp in enumerate(inputs):
        which = f"prompt {i}: " if len(inputs) > 1 else ""
        try:
            n = counter.count(inp)
        except Exception as exc:  # noqa: BLE001 - a template's raise_exception, bad content
            raise _refuse(f"{which}cannot apply the chat template: {exc}" if prompt_param ==
                          "messages" else f"{which}cannot tokenize the prompt: {exc}",
                          prompt_param, "invalid_prompt") from None
        if n == 0:
            raise _refuse(f"{which}the prompt is empty once tokenized", prompt_param,
                          "invalid_prompt")
        if n >= context_len:
            raise _refuse(f"{which}This model's maximum context length is {context_len} "
                          f"tokens. However, your request has {n} input tokens. Please reduce "
                          "the length of the input.", prompt_param, "context_length_exceeded")
        if max_tokens is not None and n + max_tokens > context_len:
            raise _refuse(f"{which}'{max_tokens_param}' is too large: {max_tokens}. This "
                          f"model's maximum context length is {context_len} tokens and your "
                          f"request has {n} input tokens ({max_tokens} > {context_len} - {n})."
                          f" Leave it unset to generate up to {default_max_tokens} tokens, cut "
                          "to the room left in the context.",
                          max_tokens_param, "context_length_exceeded")


def _num_chars(inp: dict[str, Any]) -> int:
    if inp.get("messages") is not None:
        return sum(len(m["content"]) for m in inp["messages"])
    if inp.get("prompt_token_ids") is not None:   # a pre-tokenized prompt: bounded by tokens
        return 0
    return len(inp["prompt"])


def _refuse(message: str, param: str, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param, code=code)
