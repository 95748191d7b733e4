"""A sequence's event stream and channel: token, reset and done events, written and read."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterable

import redis

from ..keys import Keys
from ..protocol import EVENT_RESET, EVENT_TOKEN, decode_event, encode_event, encode_pubsub
from .base import CANCELLED_KEY, StorePart, channel, events_key, record_key, text_key


@dataclass(slots=True)
class TokenDelta:
    """One sequence's progress in one engine step, as the worker publishes it."""

    seq_id: str
    text: str            # the new piece of text (may be empty), appended to the running text
    completion_tokens: int
    attempt: int | None = None   # the start that produced it; set, the write is fenced on it
    logprobs: list | None = None   # the token's logprobs entry, for sequences that asked
    prompt_logprobs: list | None = None   # with the first token: the prompt's (echo)


# A finished record's logprobs field whose entries live in its token events only: they are
# kept once (a 20-alternative entry is ~1.5 KB a token), and the record's readers gather them
# from the events (gather_logprobs).
IN_EVENTS = "@events"
LOGPROBS_FIELDS = ("logprobs", "prompt_logprobs")


def gather_logprobs(entries: Iterable[tuple[str, dict[str, Any]]]) -> dict[str, list]:
    """A sequence's logprobs as its token events carry them, from its stream's (kind, data)
    entries in order: the last run's (after its last reset) entries, one per token, and the
    prompt's, carried by the first token event."""
    out: dict[str, list] = {}
    for kind, data in entries:
        if kind == EVENT_RESET:
            out = {}
        elif kind == EVENT_TOKEN:
            if "prompt_logprobs" in data:
                out["prompt_logprobs"] = data["prompt_logprobs"]
            if "logprobs" in data:
                out.setdefault("logprobs", []).extend(data["logprobs"])
    return out


def reset_data(attempt: int, reason: str) -> dict[str, Any]:
    """A reset event's data, on the stream and pub/sub alike: the number of the run that comes
    next (2 for the first re-run) and why the text so far is dropped ("worker lost", "handed
    back"). lua/reclaim.lua writes the same two fields."""
    return {"attempt": attempt, "reason": reason}


def append_event(pipe, seq_id: str, kind: str, data: dict[str, Any], maxlen: int,
                 ttl_s: int) -> None:
    """One event on a sequence's stream (kept `ttl_s`) and channel, queued on `pipe` (or sent,
    given a client)."""
    pipe.xadd(events_key(seq_id), encode_event(kind, data), maxlen=maxlen, approximate=True)
    pipe.expire(events_key(seq_id), ttl_s)
    pipe.publish(channel(seq_id), encode_pubsub(kind, data))


@functools.lru_cache(maxsize=4096)
def _delta_keys(seq_id: str) -> tuple[str, str, str, str]:
    """A running sequence's record, events, channel and running text keys, named once, not
    once per token."""
    return record_key(seq_id), events_key(seq_id), channel(seq_id), text_key(seq_id)


def _token_data(d: TokenDelta) -> dict[str, Any]:
    """A token event's data: its text, and its logprobs entry when the sequence asked."""
    data: dict[str, Any] = {"text": d.text}
    if d.logprobs is not None:
        data["logprobs"] = d.logprobs
    if d.prompt_logprobs is not None:
        data["prompt_logprobs"] = d.prompt_logprobs
    return data


class EventStore(StorePart):
    """Writes an engine step's tokens to the sequences' streams, and reads the streams."""

    SCRIPTS = {"_publish": "publish"}

    def _append(self, pipe, seq_id: str, kind: str, data: dict[str, Any]) -> None:
        append_event(pipe, seq_id, kind, data, self.stream_maxlen, self.pending_ttl_s)

    def publish_deltas(self, deltas: Iterable[TokenDelta]) -> list[int]:
        """One engine step's tokens for all its sequences, in one round trip: a token event per
        new token, as vLLM streams a chunk per token, even when its text is empty (a special
        token, or a character completed by the next one). Deltas that carry
        their attempt are fenced on it (see lua/publish.lua); returns the positions (0-based)
        of those refused because their record is no longer running that attempt."""
        return self.publish_step(deltas)[0]

    def publish_step(self, deltas: Iterable[TokenDelta], watched: list[str] | None = None
                     ) -> tuple[list[int], set[str]]:
        """publish_deltas and cancelled_among(watched) in one round trip: what the engine
        writes each step, and its look for cancels (a second round trip a step costs the
        engine CPU per token on cores llama.cpp's threads share).
        Returns (refused positions, cancelled ids)."""
        deltas, watched = list(deltas), list(watched or [])
        if not deltas and not watched:
            return [], set()
        pipe = self.r.pipeline(transaction=False)
        fenced = any(d.attempt is not None for d in deltas)
        if fenced:
            keys: list[str] = []
            args: list[Any] = [self.stream_maxlen, self.pending_ttl_s]
            for d in deltas:
                data = _token_data(d)
                keys += _delta_keys(d.seq_id)
                args += ["" if d.attempt is None else int(d.attempt),
                         encode_event(EVENT_TOKEN, data)["data"],
                         encode_pubsub(EVENT_TOKEN, data), d.text, d.completion_tokens]
            # EVALSHA itself, not the Script object: in a pipeline that would first ask
            # SCRIPT EXISTS, a round trip of its own, every time.
            pipe.evalsha(self._publish.sha, len(keys), *keys, *args)
        else:
            for d in deltas:
                self._append(pipe, d.seq_id, EVENT_TOKEN, _token_data(d))
                if d.text:
                    pipe.append(text_key(d.seq_id), d.text)
                    pipe.expire(text_key(d.seq_id), self.pending_ttl_s)
                pipe.hset(record_key(d.seq_id), "completion_tokens", d.completion_tokens)
        if watched:
            pipe.smismember(CANCELLED_KEY, watched)
        replies = pipe.execute(raise_on_error=False)
        if fenced and isinstance(replies[0], redis.exceptions.NoScriptError):
            # Redis restarted (or never saw the script): the Script object loads it and runs
            # it; the cancel look in the pipeline ran all the same.
            replies[0] = self._publish(keys=keys, args=args)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        refused = [int(p) - 1 for p in replies[0]] if fenced else []
        flags = replies[-1] if watched else []
        return refused, {s for s, f in zip(watched, flags) if f}

    def read_events(self, seq_id: str, after: str = "0-0", block_ms: int | None = None,
                    count: int = 512) -> list[tuple[str, str, dict[str, Any]]]:
        """Stream entries after `after`: [(entry_id, kind, data)]."""
        res = self.r.xread({events_key(seq_id): after}, count=count, block=block_ms)
        out = []
        for _key, entries in res or []:
            for entry_id, fields in entries:
                kind, data = decode_event(fields)
                out.append((entry_id, kind, data))
        return out

    def read_events_many(self, positions: dict[str, str], block_ms: int | None = None,
                         count: int = 512) -> list[tuple[str, str, str, dict[str, Any]]]:
        """read_events over several sequences at once (one XREAD): [(seq_id, entry_id, kind,
        data)], each sequence's entries in order."""
        res = self.r.xread({events_key(s): after for s, after in positions.items()},
                           count=count, block=block_ms)
        out = []
        for key, entries in res or []:
            seq_id = key.removeprefix(Keys.record("")).removesuffix(":events")
            for entry_id, fields in entries:
                kind, data = decode_event(fields)
                out.append((seq_id, entry_id, kind, data))
        return out
