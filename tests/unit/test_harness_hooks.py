"""The test hooks (common/test_hooks.py): read from LLMQ_TEST_* only where the harness
installed them, a no-op in a product process."""
from __future__ import annotations

import dataclasses

import pytest

from common.settings import Settings
from common.test_hooks import NO_HOOKS, HarnessHooks

KNOBS = {"LLMQ_TEST_STEP_DELAY": "0.25", "LLMQ_TEST_STALL_AT": "handback",
         "LLMQ_TEST_FAIL_SEED": "7"}


def test_without_the_harness_the_variables_are_ignored():
    assert HarnessHooks.from_env(KNOBS) is NO_HOOKS
    assert NO_HOOKS == HarnessHooks(step_delay_s=0.0, stall_at="", fail_seed=None)


def test_the_harness_installs_them():
    hooks = HarnessHooks.from_env({**KNOBS, "LLMQ_TEST_HOOKS": "1"})
    assert hooks == HarnessHooks(step_delay_s=0.25, stall_at="handback", fail_seed=7)
    assert HarnessHooks.from_env({"LLMQ_TEST_HOOKS": "1"}) == NO_HOOKS


@pytest.mark.parametrize("var, value", [("LLMQ_TEST_STEP_DELAY", "-1"),
                                        ("LLMQ_TEST_STEP_DELAY", "nan"),
                                        ("LLMQ_TEST_STALL_AT", "nowhere"),
                                        ("LLMQ_TEST_FAIL_SEED", "x")])
def test_a_bad_value_is_refused(var, value):
    with pytest.raises(ValueError):
        HarnessHooks.from_env({"LLMQ_TEST_HOOKS": "1", var: value})


def test_settings_hold_no_test_knob():
    assert not [f.name for f in dataclasses.fields(Settings) if f.name.startswith("test_")]
    assert not [v for f in dataclasses.fields(Settings) for v in f.metadata["env"]
                if v.startswith("LLMQ_TEST_")]
