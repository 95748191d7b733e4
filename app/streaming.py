"""Server-Sent Events: a job's events as SSE, and the per-key cap on open streams (a slot taken
before the route works, held by the response until it ends)."""
from __future__ import annotations

import json
import time

import redis
from flask import Flask, Response, g, stream_with_context

from common.protocol import EVENT_DONE
from common.store import SequenceStore

from .context import engine, settings
from .errors import APIError


def init_app(app: Flask) -> None:
    app.after_request(hand_stream_slot_to_response)
    app.teardown_request(close_waiting_slot)


def format_sse(entry_id: str, kind: str, data: dict) -> str:
    return f"id: {entry_id}\nevent: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse_response(seq_id: str, after: str) -> Response:
    eng, keepalive = engine(), settings().sse_keepalive_s

    def gen():
        yield "retry: 1000\n\n"
        for ev in eng.events(seq_id, after, keepalive_s=keepalive):
            if ev is None:
                yield ": keep-alive\n\n"
                continue
            yield format_sse(*ev)
            if ev[1] == EVENT_DONE:
                return

    return Response(stream_with_context(gen()), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                             "X-Request-Id": seq_id})


class StreamSlot:
    """One of a key's LLMQ_KEY_MAX_STREAMS open streams. Taken before the route does anything
    (a streamed submission is refused before its job exists) and held by the response until it
    ends. Slots are leases in Redis, renewed as the stream runs, so those of an API process
    that died free themselves."""

    def __init__(self, store: SequenceStore, owner: str, token: str, lease_s: float,
                 waiting: bool = False):
        self.store, self.owner, self.token, self.lease_s = store, owner, token, lease_s
        self.waiting = waiting   # a slot of a request that waits for its result, not a stream

    def hold(self, chunks):
        """The response body, passed through; the slot lives until the body is closed (the
        stream ended or its client went away)."""
        renewed = time.monotonic()
        try:
            for chunk in chunks:
                if time.monotonic() - renewed > self.lease_s / 3:   # keep-alives come often
                    renewed = time.monotonic()
                    try:
                        self.store.renew_stream(self.owner, self.token, self.lease_s)
                    except redis.RedisError:
                        pass   # Redis is down: the stream itself says so, or rides it out
                yield chunk
        finally:
            if hasattr(chunks, "close"):
                chunks.close()   # the route's own clean-up (a hang-up cancels its job)
            self.close()

    def close(self) -> None:
        try:
            self.store.close_stream(self.owner, self.token, self.waiting)
        except redis.RedisError:
            pass   # the lease runs out by itself


def take_stream_slot() -> None:
    """Takes a stream slot for the caller's key (429 when it has LLMQ_KEY_MAX_STREAMS open);
    the response holds it. Keys only: without them there are no tenants to keep apart."""
    s = settings()
    if not (g.owner and s.key_max_streams) or "stream_slot" in g:
        return
    lease = 3 * s.sse_keepalive_s + 10   # a stream writes at least every keep-alive
    store = engine().store
    token = store.open_stream(g.owner, s.key_max_streams, lease)
    if token is None:
        raise APIError(429, f"this key has {s.key_max_streams} streams open "
                            "(LLMQ_KEY_MAX_STREAMS); close one first", "rate_limit_error",
                       {"Retry-After": "5"}, code="too_many_streams")
    g.stream_slot = StreamSlot(store, g.owner, token, lease)


def take_waiting_slot() -> None:
    """Takes a slot for a request that waits on this thread for its result (429 when the key
    has LLMQ_KEY_MAX_WAITING such requests): one key's waiting requests cannot hold every API
    thread. The request holds it until it ends (its lease outlasts LLMQ_WAIT_TIMEOUT, after
    which a wait ends, so the slots of an API process that died free themselves). Keys only."""
    s = settings()
    if not (g.owner and s.key_max_waiting) or "waiting_slot" in g:
        return
    lease = s.wait_timeout_s + 30
    store = engine().store
    token = store.open_stream(g.owner, s.key_max_waiting, lease, waiting=True)
    if token is None:
        raise APIError(429, f"this key has {s.key_max_waiting} requests waiting for their "
                            "results (LLMQ_KEY_MAX_WAITING); retry when one ends, or queue "
                            "jobs (POST /v1/jobs) and follow them", "rate_limit_error",
                       {"Retry-After": "5"}, code="too_many_waiting")
    g.waiting_slot = StreamSlot(store, g.owner, token, lease, waiting=True)


def close_waiting_slot(_exc=None) -> None:
    slot = g.pop("waiting_slot", None)
    if slot is not None:
        slot.close()


def hand_stream_slot_to_response(resp: Response) -> Response:
    slot = g.pop("stream_slot", None)
    if slot is None:
        return resp
    if resp.is_streamed and resp.mimetype == "text/event-stream":
        resp.response = slot.hold(resp.response)
        # A HEAD's body is never iterated, so hold()'s own close never runs; this does.
        resp.call_on_close(slot.close)
    else:
        slot.close()   # an error, or an answer that was not a stream after all
    return resp
