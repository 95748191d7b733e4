"""Idempotency-Key (Stripe's semantics, the IETF httpapi draft): a request's first answer,
kept per API key, so that a retry of the same request gets it again instead of running twice.

Keys:
  llmq:owner:<owner>:idem:<digest>   hash  fp (the request's fingerprint), token (the claim
                                           of the request being answered), answer (JSON)

A first request claims the key atomically (a pending marker: its fingerprint and a random
token) before it does anything; its 2xx answer replaces the marker for LLMQ_RESULT_TTL, any
other answer lets the claim go, so that a retry runs. A claim of a request that died with its
API process lapses after its own TTL.
"""
from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

import redis

from .keys import Keys
from .store.lua_scripts import register


def digest(text: str | bytes) -> str:
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


class IdempotencyStore:
    """Claims, answers and replays Idempotency-Keys."""

    def __init__(self, client: redis.Redis):
        self.r = client
        self._claim = register(client, "idempotency_claim")
        self._settle = register(client, "idempotency_settle")

    def claim(self, owner: str, key: str, fingerprint: str, claim_ttl_s: int
              ) -> tuple[str, Any]:
        """("new", token): this request holds the key and runs; ("pending", None): another
        request with it is still being answered; ("mismatch", None): the key was used for
        another request; ("done", answer): the first request's answer."""
        state, value = self._claim(keys=[Keys.idempotency(owner, digest(key))],
                                   args=[fingerprint, secrets.token_hex(16),
                                         max(1, int(claim_ttl_s))])
        if state == "done":
            return state, json.loads(value)
        return state, value if state == "new" else None

    def answer(self, owner: str, key: str, token: str, answer: dict[str, Any],
               ttl_s: int) -> bool:
        return bool(self._settle(keys=[Keys.idempotency(owner, digest(key))],
                                 args=[token, json.dumps(answer, ensure_ascii=False),
                                       max(1, int(ttl_s))]))

    def release(self, owner: str, key: str, token: str) -> None:
        self._settle(keys=[Keys.idempotency(owner, digest(key))], args=[token, "", 1])
