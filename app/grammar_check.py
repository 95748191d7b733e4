"""The API's check that a request's structured output can compile, before anything is queued,
bounded so that no request makes an API thread (or another key) wait on it:

- a JSON schema's counts (minItems, maxLength, ...) above LLMQ_MAX_SCHEMA_COUNT are refused
  before any compile: llguidance unrolls them (an 87-byte schema with maxItems 200,000 takes
  seconds), and no answer within LLMQ_MAX_TOKENS_LIMIT tokens needs that many;
- the compile runs on a small pool, off the request thread (llguidance releases the GIL), and a
  grammar whose compile takes longer than LLMQ_GRAMMAR_TIMEOUT is refused, now and whenever it
  is sent again (one that never got a thread in that time is a 503: the pool was busy);
- each verdict is kept by the spec's hash: batch lines and retries repeat one schema, and a
  spec being compiled is waited on, not compiled twice;
- a compile's seconds are charged to the key that started it (app/key_budget.py): past
  LLMQ_KEY_GRAMMAR_SECONDS in a minute, the key's new grammars are a 429 until it ends.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Any

from flask import has_app_context

from common import structured

from .errors import APIError
from .key_budget import GrammarBudget, grammar_budget

COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
          "minContains", "maxContains")
DEFAULT_MAX_COUNT, DEFAULT_TIMEOUT_S = 4096, 2.0   # common/settings.py's defaults
CACHE_SIZE = 1024
THREADS = 4


def count_over(schema: Any, cap: int, depth: int = 0) -> str | None:
    """The first count of the schema (or of a schema inside it) above `cap`, said as an
    error, or None."""
    if not isinstance(schema, dict) or depth > 64:
        return None
    for key in COUNTS:
        value = schema.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
            return (f"'{key}' is {value:g}; a schema's counts are at most {cap} "
                    "(LLMQ_MAX_SCHEMA_COUNT)")
    return next((e for sub in structured.subschemas(schema)
                 if (e := count_over(sub, cap, depth + 1))), None)


def _timed_validate(spec: dict[str, Any], budget: GrammarBudget | None
                    ) -> tuple[str | None, float]:
    """The compile's verdict and seconds, charged to the budget before anyone sees them (a
    compile past the time limit runs on, and is charged, to its end)."""
    t = time.perf_counter()
    try:
        error = structured.validate(spec)
    finally:
        seconds = time.perf_counter() - t
        if budget is not None:
            budget.charge(seconds)
    return error, seconds


class GrammarCheck:
    """Whether specs' grammars compile: counts capped, compiles timed, verdicts cached."""

    def __init__(self, threads: int = THREADS, cache_size: int = CACHE_SIZE):
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-check")
        self.cache_size = cache_size
        self.verdicts: OrderedDict[str, Future] = OrderedDict()
        self.lock = threading.Lock()

    def error(self, spec: dict[str, Any], max_count: int = DEFAULT_MAX_COUNT,
              timeout_s: float = DEFAULT_TIMEOUT_S,
              budget: GrammarBudget | None = None) -> str | None:
        """Why the spec cannot be served, or None when its grammar compiles in time. A compile
        this spec starts is charged to `budget` (and refused, 429, when it is spent); a kept
        verdict costs nothing."""
        if spec.get("type") == "json_schema" and (over := count_over(spec.get("value"),
                                                                     max_count)):
            return over
        key = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()
        with self.lock:
            verdict = self.verdicts.get(key)
            if verdict is not None:
                self.verdicts.move_to_end(key)
        if verdict is None:
            if budget is not None:
                budget.check()   # a Redis round trip: not under the lock
            with self.lock:
                verdict = self.verdicts.get(key)
                if verdict is None:
                    verdict = self.verdicts[key] = self.pool.submit(_timed_validate, spec,
                                                                    budget)
                    while len(self.verdicts) > self.cache_size:
                        self.verdicts.popitem(last=False)
        slow = (f"the grammar takes longer than {timeout_s:g} s to compile "
                "(LLMQ_GRAMMAR_TIMEOUT)")
        try:
            error, seconds = verdict.result(timeout=timeout_s)
        except FutureTimeout:
            if not (verdict.running() or verdict.done()):
                # Never started: other grammars hold the pool. Not this one's fault, so not a
                # 400; its verdict comes when a thread frees (and is kept for the retry).
                raise APIError(503, "the server's grammar checks are all busy; retry shortly",
                               "service_unavailable", {"Retry-After": "1"},
                               code="grammar_checks_busy") from None
            return slow
        return slow if seconds > timeout_s else error


CHECK = GrammarCheck()


def grammar_error(spec: dict[str, Any]) -> str | None:
    """CHECK's verdict under the serving app's settings (the defaults outside a request, as in
    a unit test of the schemas)."""
    if has_app_context():
        from .context import settings

        s = settings()
        return CHECK.error(spec, s.max_schema_count, s.grammar_timeout_s, grammar_budget())
    return CHECK.error(spec)
