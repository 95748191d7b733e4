"""Redis goes away while a worker drains (SIGTERM, then Redis stops): the worker's shutdown is
still bounded. When the grace ends and the hand-back cannot reach Redis, the task threads are
released, the messages stay unacknowledged and the worker exits; once Redis is back, a peer's
reaper takes the records back and every sequence ends `succeeded`.
"""
from __future__ import annotations

import signal
import subprocess
import time

import pytest

from support import wait_until

from .factories import assert_all_succeeded_once, record, running_with_tokens

pytestmark = [pytest.mark.slow, pytest.mark.integration]

GRACE_S = 4.0
MARGIN_S = 10.0        # the bound: exit within the grace + 10 s
LONG = {"max_tokens": 480, "ignore_eos": True, "temperature": 0}


def test_worker_exits_within_the_grace_when_redis_stops_during_its_drain(aof_world):
    world = aof_world
    w1 = world.worker("w1", LLMQ_SHUTDOWN_GRACE=str(GRACE_S))
    api, r = world.api(), world.client()
    ids = [j["id"] for j in api.submit_many([f"Saga {i}:" for i in range(3)], **LONG)]
    wait_until(lambda: len(running_with_tokens(r, ids, 1)) == 3, 60, "the sequences to run")

    sent_at = time.monotonic()
    w1.signal(signal.SIGTERM)
    wait_until(lambda: "draining: up to" in w1.log_path.read_text(), 30, "the drain to start")
    unfinished = running_with_tokens(r, ids, 1)
    world.redis_server.stop()
    assert unfinished, "every sequence finished before Redis stopped; nothing was in flight"

    try:
        code = w1.proc.wait(max(1.0, GRACE_S + MARGIN_S - (time.monotonic() - sent_at)))
    except subprocess.TimeoutExpired:
        pytest.fail("the worker did not exit within the grace + 10 s once Redis was gone:\n"
                    + w1.log_path.read_text()[-3000:])
    log = w1.log_path.read_text()
    assert "could not hand back" in log and "unacknowledged" in log, log[-3000:]
    assert code is not None

    # Redis returns (its append-only file kept the records, still `running` under w1, and the
    # messages, unacknowledged); a new worker's reaper takes w1's sequences back.
    world.redis_server.start()
    for seq_id in unfinished:
        assert record(r, seq_id)["worker"] == w1.hostname
    world.worker("w2")
    assert_all_succeeded_once(api, r, ids, LONG["max_tokens"])
