"""OpenAI's response objects, built from jobs: choices in the completions and chat shapes,
logprobs in their two shapes, usage and finish reasons. The OpenAI routes (app/openai_api.py)
answer with them and the batch driver (worker/batch_runner.py) writes them into output lines,
so a batch line's body is what the route would have answered.

Logprobs come from the entries the worker keeps per token ({"token_id", "token", "logprob",
"rank", "top_logprobs": [...]}, see worker/logprobs.py). Completions use the legacy shape:
parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a {token: logprob} dict per token:
the k most likely plus the sampled one, as vLLM gives) and `text_offset` (each token's start in
the text). Chat uses `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
Both are built the same way streamed (a piece per chunk) and not, so the numbers agree.
"""
from __future__ import annotations

import time

from . import reasoning as reasoning_text
from .tool_calls import parse_calls


def token_text(entry: dict, as_ids: bool = False) -> str:
    """vLLM's return_tokens_as_token_ids writes "token_id:<id>" instead of the text."""
    return f"token_id:{entry['token_id']}" if as_ids else entry["token"]


class LegacyLogprobs:
    """Builds completions' logprobs objects, keeping the text offset across stream chunks."""

    def __init__(self, as_ids: bool = False):
        self.as_ids = as_ids
        self.offset = 0

    def __call__(self, entries: list[dict]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for e in entries:
            tok = token_text(e, self.as_ids)
            out["tokens"].append(tok)
            out["text_offset"].append(self.offset)
            self.offset += len(e["token"])
            out["token_logprobs"].append(e["logprob"])
            if e["logprob"] is None:   # a prompt's first token: nothing predicts it
                out["top_logprobs"].append(None)
                continue
            top = {token_text(t, self.as_ids): t["logprob"] for t in e["top_logprobs"]}
            top.setdefault(tok, e["logprob"])
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(entries: list[dict], as_ids: bool = False) -> dict:
    def item(e: dict) -> dict:
        tok = token_text(e, as_ids)
        return {"token": tok, "logprob": e["logprob"], "bytes": list(tok.encode("utf-8"))}

    return {"content": [{**item(e), "top_logprobs": [item(t) for t in e["top_logprobs"]]}
                        for e in entries]}


def vllm_prompt_logprobs(entries: list[dict] | None) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: per prompt token None (the first: nothing predicts it) or
    {token id: {"logprob", "rank", "decoded_token"}} for the token itself, then the most
    likely ones (ranked 1, 2, ... as given)."""
    if entries is None:
        return None
    out: list[dict | None] = []
    for e in entries:
        if e["logprob"] is None:
            out.append(None)
            continue
        d = {str(e["token_id"]): {"logprob": e["logprob"], "rank": e["rank"],
                                  "decoded_token": e["token"]}}
        for rank, t in enumerate(e["top_logprobs"], 1):
            d.setdefault(str(t["token_id"]), {"logprob": t["logprob"], "rank": rank,
                                              "decoded_token": t["token"]})
        out.append(d)
    return out


def usage(jobs: list[dict], n: int = 1) -> dict:
    """Usage summed over a request's sequences; a prompt sampled n times counts once."""
    p = sum(j["usage"]["prompt_tokens"] for j in jobs[::n])
    c = sum(j["usage"]["completion_tokens"] for j in jobs)
    cached = sum(j["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                 for j in jobs[::n])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_reason(job: dict) -> str | None:
    """OpenAI's finish reason; a failure or a timeout never gets here (app/errors.py's
    failure_of answers those)."""
    reason = job.get("finish_reason")
    return "abort" if reason in ("cancelled", "timeout") else reason


class ChoiceShaper:
    """Turns one request's sequences into OpenAI choices: text (with the prompt in front for
    echo), logprobs in the route's shape, finish reasons. One per request, also when streamed
    (completions' text offsets run on across chunks). Chat answers may carry tool calls
    (`tools`: common/tool_calls.py's ToolRequest.shape()) and thinking split from the answer
    (`reasoning`); streamed, a tool-calling answer is held to its end (whether text is a call
    is known once it parses), and thinking goes out as `reasoning_content` deltas."""

    def __init__(self, jobs: list[dict], chat: bool, echo: bool = False,
                 wants_logprobs: bool = False, as_ids: bool = False,
                 prompt_logprobs: bool = False, tools: dict | None = None,
                 reasoning: bool = False):
        self.jobs, self.chat, self.echo = jobs, chat, echo
        self.tools, self.reasoning = tools, reasoning
        self._held = ["" for _ in jobs]
        self._splitters = [reasoning_text.ReasoningSplitter() for _ in jobs]
        self.wants_logprobs = wants_logprobs
        self.prompt_logprobs = prompt_logprobs   # vLLM's field: in each choice, or (chat) the body
        self.as_ids = as_ids   # vLLM's return_tokens_as_token_ids
        self.legacy = [LegacyLogprobs(as_ids) for _ in jobs]

    def logprobs(self, i: int, entries: list[dict]) -> dict | None:
        if not self.wants_logprobs:
            return None
        if self.chat:
            return chat_logprobs(entries, self.as_ids)
        return self.legacy[i](entries)

    def echoed(self, i: int, prompt_entries: list[dict] | None) -> tuple[str, list[dict]]:
        """The echo's text and logprobs entries (completions with echo: the prompt first; a
        prompt given as token ids is echoed as its tokens' text)."""
        if not self.echo:
            return "", []
        entries = prompt_entries or []
        text = self.jobs[i].get("prompt") or "".join(e["token"] for e in entries)
        return text, entries if self.wants_logprobs else []

    def choice(self, i: int, text: str, entries: list[dict], finish: str | None,
               delta: bool = False, role: bool = False) -> dict:
        if not self.chat:
            return {"index": i, "text": text, "logprobs": self.logprobs(i, entries),
                    "finish_reason": finish}
        lp = self.logprobs(i, entries) if entries or not delta else None
        if not delta:
            message = self.message(i, text)
            return {"index": i, "message": message, "logprobs": lp,
                    "finish_reason": _call_finish(message, finish)}
        body = {"role": "assistant", "content": ""} if role else (
            {"content": text} if text or not finish else {})
        return {"index": i, "delta": body, "logprobs": lp, "finish_reason": finish}

    def message(self, i: int, text: str) -> dict:
        """A chat answer's message: content, and reasoning_content and tool_calls when the
        request has them."""
        message: dict = {"role": "assistant", "content": text}
        if self.reasoning:
            thought, text = reasoning_text.split(text)
            message["content"] = text
            if thought is not None:
                message["reasoning_content"] = thought
        if self.tools:
            message["content"], calls = parse_calls(text, self.tools, self.jobs[i]["id"])
            if calls:
                message["tool_calls"] = calls
        return message

    def delta_choice(self, i: int, delta: dict, entries: list[dict],
                     finish: str | None = None) -> dict:
        """A streamed chat choice with the given delta."""
        lp = self.logprobs(i, entries) if entries else None
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def deltas(self, i: int, piece: str) -> list[dict]:
        """The chat deltas a streamed piece of text makes (none while it is held)."""
        if self.tools:
            self._held[i] += piece
            return []
        if self.reasoning:
            return _nonempty(*self._splitters[i].feed(piece))
        return [{"content": piece}] if piece else []

    def end_deltas(self, i: int, rest: str, finish: str | None) -> tuple[list[dict], str | None]:
        """The deltas that end a streamed chat choice (what was held, the calls: index, id
        and name first, then the arguments, as OpenAI streams them) and its finish reason."""
        if self.tools:
            message = self.message(i, self._held[i] + rest)
            out = _nonempty(message.get("reasoning_content") or "", message["content"] or "")
            for k, call in enumerate(message.get("tool_calls", [])):
                fn = call["function"]
                out.append({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                            "function": {"name": fn["name"], "arguments": ""}}]})
                out.append({"tool_calls": [{"index": k, "function": {
                    "arguments": fn["arguments"]}}]})
            return out, _call_finish(message, finish)
        if self.reasoning:
            split = self._splitters[i]
            r1, c1 = split.feed(rest)
            r2, c2 = split.flush()
            return _nonempty(r1 + r2, c1 + c2), finish
        return ([{"content": rest}] if rest else []), finish


def _nonempty(reasoning: str, content: str) -> list[dict]:
    delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
    return [delta] if delta else []


def _call_finish(message: dict, finish: str | None) -> str | None:
    """OpenAI's finish reason of an answer that calls tools (a call that ended the grammar)."""
    return "tool_calls" if message.get("tool_calls") and finish == "stop" else finish


def cumulative_logprob(job: dict) -> float:
    """The sum of a sequence's sampled tokens' logprobs (vLLM's cumulative_logprob)."""
    return sum(e["logprob"] for e in job.get("logprobs") or [])


def best_candidates(finals: list[dict], per_prompt: int, n: int) -> list[dict]:
    """best_of: of each prompt's `per_prompt` candidates (input-major order), the n with the
    highest cumulative logprob, best first, as vLLM returns them."""
    chosen = []
    for start in range(0, len(finals), per_prompt):
        group = finals[start:start + per_prompt]
        chosen += sorted(group, key=cumulative_logprob, reverse=True)[:n]
    return chosen


def response_body(finals: list[dict], chat: bool, model: str,
                  shaper: ChoiceShaper | None = None, n: int = 1) -> dict:
    """The completion (or chat completion) object of finished jobs; without a shaper, plain
    choices (no echo, no logprobs)."""
    shaper = shaper or ChoiceShaper(finals, chat)
    choices = []
    for i, f in enumerate(finals):
        echo_text, echo_entries = shaper.echoed(i, f.get("prompt_logprobs"))
        choices.append(shaper.choice(i, echo_text + f["text"],
                                     echo_entries + f.get("logprobs", []), finish_reason(f)))
        if shaper.prompt_logprobs and not chat:
            choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(f.get("prompt_logprobs"))
    body = {"id": finals[0]["id"], "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(finals, n)}
    if shaper.prompt_logprobs and chat:   # one prompt: vLLM puts it beside the choices
        body["prompt_logprobs"] = vllm_prompt_logprobs(finals[0].get("prompt_logprobs"))
    return body
