"""SIGTERM (a deploy, a scale-down): the worker stops taking work, lets its batch run for
LLMQ_SHUTDOWN_GRACE seconds, hands back what is still unfinished and exits; another worker
finishes what was handed back, from scratch, with a reset event for its readers.
"""
from __future__ import annotations

import signal
import subprocess
import time

import pytest

from common.store import WORKERS_KEY, SequenceStore, running_key
from support import wait_until

from .factories import (SLACK_S, assert_all_succeeded_once, record, running_with_tokens,
                        stream_kinds)

pytestmark = [pytest.mark.slow, pytest.mark.integration]

GRACE_S = 3.0
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
# Each of w1's steps lasts at least this long, so the long ones need >= 10 s (over 3 graces) on
# any machine, however fast: they are still running when the grace ends.
MIN_STEP_S = 0.025


def _reset_at(r, seq_id: str) -> float:
    """When the sequence's last reset event was written (its stream id is Redis's clock, ms)."""
    [(event_id, fields)] = r.xrevrange(f"llmq:seq:{seq_id}:events", count=1)
    assert fields["event"] == "reset", fields
    return int(event_id.split("-")[0]) / 1000


def test_sigterm_finishes_short_work_hands_back_long_work_and_exits_in_time(world):
    w1 = world.worker("w1", min_step_s=MIN_STEP_S, LLMQ_SHUTDOWN_GRACE=str(GRACE_S))
    api, r = world.api(), world.client()
    store = SequenceStore(r)
    longs = [j["id"] for j in api.submit_many([f"Epic {i}:" for i in range(3)], **LONG)]
    readers = {i: api.stream(i) for i in longs}
    wait_until(lambda: len(running_with_tokens(r, longs, 5)) == 3, 60, "the long ones to run")
    short = api.submit(prompt="Quick one", max_tokens=12, ignore_eos=True, temperature=0)["id"]
    wait_until(lambda: running_with_tokens(r, [short], 1), 30, "the short one to run")

    sent_at = time.monotonic()
    w1.proc.send_signal(signal.SIGTERM)
    try:
        code = w1.proc.wait(GRACE_S + 3 * SLACK_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the worker did not exit after SIGTERM")
    took = time.monotonic() - sent_at
    assert code == 0, code
    # The batch had its whole grace (the long ones outlast it), then the worker left promptly.
    assert GRACE_S <= took <= GRACE_S + SLACK_S, took

    # The short sequence finished normally, within the grace: before the hand-back.
    done = api.job(short)
    assert done["status"] == "succeeded" and done["usage"]["completion_tokens"] == 12, done
    assert all(done["finished_at"] <= _reset_at(r, seq_id) for seq_id in longs), done

    # The long ones were handed back: queued again, from scratch, their messages in the broker,
    # a reset event last in their streams; the worker left the registry clean.
    for seq_id in longs:
        job = api.job(seq_id)
        assert job["status"] == "queued" and job["text"] == "", job
        assert job["usage"]["completion_tokens"] == 0
        assert stream_kinds(r, seq_id)[-1] == "reset"
    assert store.queue_depth("llmq") == 3
    assert not r.exists(running_key(w1.hostname))
    assert r.zscore(WORKERS_KEY, w1.hostname) is None

    w2 = world.worker("w2")
    finals = assert_all_succeeded_once(api, r, longs, LONG["max_tokens"])
    for seq_id in longs:
        stream = readers[seq_id].result()
        assert stream.kinds.count("reset") == 1, stream.kinds
        assert stream.texts_after_last_reset() == finals[seq_id]["text"]
        assert record(r, seq_id)["worker"] == w2.hostname
        assert record(r, seq_id)["attempts"] == "2"
