"""Server-Sent Events: a job's events as SSE, and the per-key caps on open streams and waiting
requests (a slot taken before the route works, held by the response until it ends)."""
from __future__ import annotations

import json

import redis
from flask import Flask, Response, current_app, g, stream_with_context

from common.protocol import EVENT_DONE

from .context import engine, settings
from .errors import APIError
from .slot_keeper import SlotKeeper


def init_app(app: Flask) -> None:
    app.extensions["llmq"]["slot_keeper"] = SlotKeeper(app.extensions["llmq"]["store"])
    app.after_request(hand_slots_to_response)
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
    """One of a key's LLMQ_KEY_MAX_STREAMS open streams (or, `waiting`, LLMQ_KEY_MAX_WAITING
    waiting requests). Taken before the route does anything (a streamed submission is refused
    before its job exists) and held by the response until the server closes it, after its last
    write. Slots are leases in Redis that the process's SlotKeeper renews while they are held,
    so a slot lasts exactly as long as its thread: one stuck in a write keeps it, and those of
    an API process that died free themselves within SLOT_LEASE_S."""

    def __init__(self, keeper: SlotKeeper, owner: str, token: str, waiting: bool = False):
        self.keeper, self.owner, self.token = keeper, owner, token
        self.waiting = waiting   # a slot of a request that waits for its result, not a stream
        self.closed = False
        keeper.hold(owner, waiting, token)

    def hold(self, chunks):
        """The response body, passed through; the slot lives until the body is closed (the
        stream ended, its client went away, or a write passed LLMQ_WRITE_TIMEOUT)."""
        try:
            yield from chunks
        finally:
            if hasattr(chunks, "close"):
                chunks.close()   # the route's own clean-up (a hang-up cancels its job)
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.keeper.let_go(self.owner, self.waiting, self.token)
        try:
            self.keeper.store.close_stream(self.owner, self.token, self.waiting)
        except redis.RedisError:
            pass   # the lease runs out by itself, no longer renewed


def _take_slot(cap: int, waiting: bool) -> StreamSlot | None:
    keeper: SlotKeeper = current_app.extensions["llmq"]["slot_keeper"]
    token = keeper.store.open_stream(g.owner, cap, keeper.lease_s, waiting=waiting)
    return None if token is None else StreamSlot(keeper, g.owner, token, waiting)


def take_stream_slot() -> None:
    """Takes a stream slot for the caller's key (429 when it has LLMQ_KEY_MAX_STREAMS open);
    the response holds it. Keys only: without them there are no tenants to keep apart."""
    cap = settings().key_max_streams
    if not (g.owner and cap) or "stream_slot" in g:
        return
    slot = _take_slot(cap, waiting=False)
    if slot is None:
        raise APIError(429, f"this key has {cap} streams open (LLMQ_KEY_MAX_STREAMS); close "
                            "one first", "rate_limit_error", {"Retry-After": "5"},
                       code="too_many_streams")
    g.stream_slot = slot


def take_waiting_slot() -> None:
    """Takes a slot for a request that waits on this thread for its result (429 when the key
    has LLMQ_KEY_MAX_WAITING such requests): one key's waiting requests cannot hold every API
    thread. The response holds it until its answer is written. Keys only."""
    cap = settings().key_max_waiting
    if not (g.owner and cap) or "waiting_slot" in g:
        return
    slot = _take_slot(cap, waiting=True)
    if slot is None:
        raise APIError(429, f"this key has {cap} requests waiting for their results "
                            "(LLMQ_KEY_MAX_WAITING); retry when one ends, or queue jobs "
                            "(POST /v1/jobs) and follow them", "rate_limit_error",
                       {"Retry-After": "5"}, code="too_many_waiting")
    g.waiting_slot = slot


def close_waiting_slot(_exc=None) -> None:
    """A waiting slot no response took (the request failed before it had one)."""
    slot = g.pop("waiting_slot", None)
    if slot is not None:
        slot.close()


def hand_slots_to_response(resp: Response) -> Response:
    """The response holds the request's slots until the server closes it, after its last
    write: a thread writing a long answer to a client that reads slowly still counts."""
    waiting = g.pop("waiting_slot", None)
    if waiting is not None:
        resp.call_on_close(waiting.close)
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
