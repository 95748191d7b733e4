"""The OpenAI completions and chat stream: a request's sequences' events assembled into
`data:` chunks (role, text and tool-call deltas, logprobs, the finish, usage), across a
re-run, a Redis outage and a client that goes away. The route module (app/openai_api.py)
only routes."""
from __future__ import annotations

import functools
import json
import logging
import time
from typing import Iterator

import redis
from flask import g

from common import reasoning
from common.openai_responses import ChoiceShaper, finish_reason, usage
from common.protocol import EVENT_DONE, EVENT_RESET, EVENT_TOKEN

from .client_connection import client_gone
from .context import engine, settings
from .errors import APIError, failure_of
from .sent_text import SentText
from .waiting import cancel_all

log = logging.getLogger("llmq.api")

# How long an OpenAI stream waits out a Redis it cannot read before it ends with an error chunk.
REDIS_OUTAGE_S = 30.0


def count_tokens(model: str | None, text: str) -> int:
    """Tokens of a text as `model`'s tokenizer makes them (0 without a tokenizer here)."""
    counter = engine().prompt_counter_for(model).get()
    return len(counter.tokenizer.encode(text, add_special_tokens=False).ids) if counter else 0


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


def stream_chunks(req, jobs: list[dict], shaper: ChoiceShaper, model: str) -> Iterator[str]:
    """The request's sequences (`req`: a completions or chat request) as one chunk stream,
    answered as `model`; with n > 1 (or several prompts) the choices' chunks interleave as
    their tokens arrive, each carrying its choice index."""
    eng, owner, chat = engine(), g.owner, shaper.chat
    created = int(time.time())
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
                    # before its first token, still writes, so proxies keep the connection.
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
                    if shaper.wants_logprobs:   # (the done event leaves them out)
                        data = eng.done_job(seq_id, data)
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
                                               functools.partial(count_tokens, req.model))
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
