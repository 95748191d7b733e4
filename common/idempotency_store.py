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

# ('new', token) after claiming, ('pending', '') while another holds the claim,
# ('mismatch', '') for another request's fingerprint, ('done', answer) once answered.
# KEYS: the key's hash. ARGV: fingerprint, token, claim TTL.
_CLAIM = """
local cur = redis.call('HMGET', KEYS[1], 'fp', 'answer')
if not cur[1] then
  redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'token', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return {'new', ARGV[2]}
end
if cur[1] ~= ARGV[1] then return {'mismatch', ''} end
if not cur[2] then return {'pending', ''} end
return {'done', cur[2]}
"""

# The claim's holder answers (ARGV[2] set: keep it for ARGV[3] seconds) or lets go (ARGV[2]
# empty). A claim that lapsed and was taken again is not its any more. KEYS: the key's hash.
# ARGV: token, answer, TTL.
_SETTLE = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
if ARGV[2] == '' then return redis.call('DEL', KEYS[1]) end
redis.call('HSET', KEYS[1], 'answer', ARGV[2])
redis.call('HDEL', KEYS[1], 'token')
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""


def digest(text: str | bytes) -> str:
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


class IdempotencyStore:
    """Claims, answers and replays Idempotency-Keys."""

    def __init__(self, client: redis.Redis):
        self.r = client
        self._claim = client.register_script(_CLAIM)
        self._settle = client.register_script(_SETTLE)

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
