"""Waiting on sequences for an HTTP client that may hang up: the one wait-or-cancel that every
route holding a connection open for a result uses (/v1/completions, /v1/chat/completions,
/v1/generate). A request belongs to its connection: when the client goes, so does its work."""
from __future__ import annotations

import time
from typing import Iterator

import redis
from flask import current_app, g

from common.protocol import EVENT_DONE

from .client_connection import client_gone
from .errors import APIError, failure_of

CHECK_S = 0.5   # how often a waiting request looks for a hang-up and its deadline


class Abandoned(APIError):
    """Nobody waits any more: the client hung up (499, nginx's "client closed request")."""


class WaitTimedOut(Abandoned):
    """LLMQ_WAIT_TIMEOUT passed before the sequences finished (504)."""


def follow(seq_id: str, deadline: float | None = None) -> Iterator[tuple[str, str, dict]]:
    """The sequence's events until its done event. Raises Abandoned once the client has hung
    up or the (monotonic) deadline has passed, checked every half second whether or not tokens
    are flowing: a generating sequence never leaves the event stream idle."""
    engine = current_app.extensions["llmq"]["engine"]
    next_check = time.monotonic() + CHECK_S
    for ev in engine.events(seq_id, keepalive_s=CHECK_S):
        now = time.monotonic()
        if ev is None or now >= next_check:
            next_check = now + CHECK_S
            if client_gone():
                raise Abandoned(499, "the client closed the connection", "client_closed")
            if deadline is not None and now > deadline:
                raise WaitTimedOut(504, "LLMQ_WAIT_TIMEOUT passed before the sequence "
                                   "finished", "timeout_error", code="timeout")
        if ev is not None:
            yield ev


def wait_or_cancel(seq_ids: list[str], fail_fast: bool = False,
                   cancel_on_timeout: bool = True) -> list[dict]:
    """Waits for every sequence and returns their final jobs, in order. If the client hangs
    up, LLMQ_WAIT_TIMEOUT passes (WaitTimedOut; unless cancel_on_timeout is off: the caller
    hands the ids out) or anything else ends the wait, every sequence not yet finished is
    cancelled (all of a multi-prompt request, not just the one waited on). With fail_fast,
    the first sequence that failed (see failure_of) ends the wait with its error."""
    ext = current_app.extensions["llmq"]
    engine, owner = ext["engine"], g.owner
    deadline = time.monotonic() + ext["settings"].wait_timeout_s
    finals: list[dict] = []
    try:
        for seq_id in seq_ids:
            finals.append(_final(engine, seq_id, owner, deadline))
            if fail_fast and (err := failure_of(finals[-1])):
                raise err
    except WaitTimedOut:
        if cancel_on_timeout:
            cancel_all(engine, seq_ids[len(finals):], owner)
        raise
    except BaseException:
        cancel_all(engine, seq_ids[len(finals):], owner)
        raise
    return finals


def cancel_all(engine, seq_ids: list[str], owner: str) -> None:
    """Cancels each (those already finished are left as they are)."""
    for seq_id in seq_ids:
        try:
            engine.cancel(seq_id, owner)
        except redis.RedisError:   # Redis is down: the caller's error says so already
            return


def _final(engine, seq_id: str, owner: str, deadline: float) -> dict:
    for _id, kind, data in follow(seq_id, deadline):
        if kind == EVENT_DONE:
            return data
    job = engine.get(seq_id, owner)   # the stream ended without a done event
    if job is None:
        raise APIError(404, "the sequence expired", "not_found_error")
    return job
