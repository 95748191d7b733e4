"""What a key's requests cost the API itself, charged to that key: refused bodies and grammar
compile time, each with a budget per minute (in the key's rate window in Redis, shared by
every API replica).

A refused request was parsed and validated before it could be refused: a 1.4 MB body of stop
ids or logit bias costs tens of milliseconds of an API core every time, and a few clients
sending such bodies back to back keep a core busy that the model needs. Once a key has had
LLMQ_KEY_MAX_REFUSALS of its bodies refused in a minute, its requests with a body are a 429
before the body is read, on a connection that then closes (so the server does not read it
either). Requests without a body (reads, cancels) are never held back: they cost little, and
a client throttled for bad submissions must still be able to read and cancel its work.

Keys only: without keys every request has the same owner, and one client's mistakes would
lock out every other.
"""
from __future__ import annotations

import logging

import redis
from flask import Flask, Response, g, has_request_context, request

from .context import engine, settings
from .errors import APIError

log = logging.getLogger("llmq.api")

# Bad input: what a client could have known not to send. 401, 404, 409 and 429 are not its
# mistakes in the same way (a wrong key is not charged to a key; a retry after a 429 is right).
REFUSED_STATUSES = frozenset({400, 413, 415, 422})


def init_app(app: Flask) -> None:
    """Registered right after authentication: the gate runs before anything reads the body."""
    app.before_request(refuse_spent_key)
    app.after_request(charge_refusal)


def _has_body() -> bool:
    return bool(request.content_length) or "chunked" in request.headers.get(
        "Transfer-Encoding", "").lower()


def refuse_spent_key() -> None:
    s = settings()
    if not (g.get("owner") and s.key_max_refusals and _has_body()):
        return
    refusals, _grammar_ms, left_s = engine().store.api_charges(g.owner)
    if refusals >= s.key_max_refusals:
        # Connection: close makes the HTTP worker (app/http_worker.py) drop the connection
        # after this answer instead of reading the unread body to keep it alive.
        raise APIError(429, f"this key had {refusals} requests refused as invalid in this "
                            f"minute (LLMQ_KEY_MAX_REFUSALS: {s.key_max_refusals}); its requests "
                            f"with a body are refused unread until the minute ends, in "
                            f"{left_s} s. Fix the requests the 400s named.", "rate_limit_error",
                       {"Retry-After": str(left_s), "Connection": "close"},
                       code="too_many_invalid_requests")


def charge_refusal(resp: Response) -> Response:
    if (resp.status_code in REFUSED_STATUSES and g.get("owner")
            and settings().key_max_refusals and _has_body()):
        try:
            engine().store.charge_api(g.owner, refusals=1)
        except redis.RedisError as exc:   # the refusal goes out; this one is not charged
            log.warning("refusal not charged: %s", exc)
    return resp


class GrammarBudget:
    """One key's budget of grammar compile seconds in this minute, as the check pool spends
    it: checked before a compile starts, charged when it ends."""

    def __init__(self, store, owner: str, seconds: float):
        self.store, self.owner, self.seconds = store, owner, seconds

    def check(self) -> None:
        _refusals, grammar_ms, left_s = self.store.api_charges(self.owner)
        if grammar_ms >= self.seconds * 1000:
            raise APIError(429, f"this key's grammars took {grammar_ms / 1000:.1f} s of "
                                f"compiling in this minute (LLMQ_KEY_GRAMMAR_SECONDS: "
                                f"{self.seconds:g}); new grammars are refused for {left_s} s. "
                                "Grammars already checked are still served.",
                           "rate_limit_error", {"Retry-After": str(left_s)},
                           code="grammar_budget_exceeded")

    def charge(self, seconds: float) -> None:
        """Charges a compile's seconds (on the pool's thread, as it ends)."""
        try:
            self.store.charge_api(self.owner, grammar_ms=max(1, round(seconds * 1000)))
        except redis.RedisError as exc:   # the verdict stands; this compile is not charged
            log.warning("grammar compile time not charged: %s", exc)


def grammar_budget() -> GrammarBudget | None:
    """The caller's grammar budget; None without a key, outside a request, or with none."""
    if not has_request_context() or not g.get("owner"):
        return None
    s = settings()
    if not s.key_grammar_s:
        return None
    return GrammarBudget(engine().store, g.owner, s.key_grammar_s)
