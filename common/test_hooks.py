"""Test-only knobs for the suite's workers: a slow engine, a stall at a chosen moment, an
injected sampling failure (docs/testing.md). A product process holds NO_HOOKS: the variables
are read only where the test harness installed the hooks (LLMQ_TEST_HOOKS=1, which
tests/conftest.py sets for every process a test starts)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping

STALL_MOMENTS = ("", "received", "handback")


@dataclass(frozen=True, slots=True)
class HarnessHooks:
    """What the test harness asks of a worker; the defaults do nothing."""

    # The engine waits this long in every step, alongside the model's compute (a floor on the
    # step time), so the suite can run with a slow engine on a fast machine; and runs one
    # decode pass a step (no multi-step), so that N tokens take at least N such steps.
    step_delay_s: float = 0.0
    # The engine parks its thread at this moment (received | handback) for a test to kill it.
    stall_at: str = ""
    # A sequence with this seed fails in the model process's sampling (no input does since
    # token ids are checked at admission; the tests of a failure while running need one).
    fail_seed: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "HarnessHooks":
        """The hooks the harness installed: LLMQ_TEST_STEP_DELAY, LLMQ_TEST_STALL_AT and
        LLMQ_TEST_FAIL_SEED, read only under LLMQ_TEST_HOOKS=1 (else NO_HOOKS)."""
        if env.get("LLMQ_TEST_HOOKS") != "1":
            return NO_HOOKS
        delay = float(env.get("LLMQ_TEST_STEP_DELAY") or 0)
        if not math.isfinite(delay) or delay < 0:
            raise ValueError(f"LLMQ_TEST_STEP_DELAY={delay!r} must be a number >= 0")
        stall_at = env.get("LLMQ_TEST_STALL_AT", "")
        if stall_at not in STALL_MOMENTS:
            raise ValueError(f"LLMQ_TEST_STALL_AT={stall_at!r} must be one of {STALL_MOMENTS}")
        seed = int(env.get("LLMQ_TEST_FAIL_SEED") or -1)
        return cls(step_delay_s=delay, stall_at=stall_at, fail_seed=seed if seed >= 0 else None)


NO_HOOKS = HarnessHooks()
