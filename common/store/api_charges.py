"""What a key's requests cost the API itself in a minute (its refused bodies, the grammar
compile time it caused), charged in the key's rate window beside its sequences and tokens."""
from __future__ import annotations

import time

from .base import StorePart, rate_key

# The window's fields beside reserve.lua's (seqs, tokens).
REFUSALS, GRAMMAR_MS = "refusals", "grammar_ms"
WINDOW_S = 60


class ApiCharges(StorePart):
    """Charges and reads a key's per-minute API work, shared by every API replica."""

    def charge_api(self, owner: str, refusals: int = 0, grammar_ms: int = 0) -> None:
        key = rate_key(owner, int(time.time() // WINDOW_S))
        pipe = self.r.pipeline(transaction=False)
        if refusals:
            pipe.hincrby(key, REFUSALS, refusals)
        if grammar_ms:
            pipe.hincrby(key, GRAMMAR_MS, grammar_ms)
        pipe.expire(key, 2 * WINDOW_S)
        pipe.execute()

    def api_charges(self, owner: str) -> tuple[int, int, int]:
        """(refusals, grammar compile milliseconds) charged to the key in this minute, and the
        seconds until the minute ends."""
        t = time.time()
        window = int(t // WINDOW_S)
        refusals, grammar_ms = self.r.hmget(rate_key(owner, window), REFUSALS, GRAMMAR_MS)
        return (int(refusals or 0), int(grammar_ms or 0),
                max(1, int((window + 1) * WINDOW_S - t) + 1))
