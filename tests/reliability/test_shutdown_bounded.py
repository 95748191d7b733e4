"""A worker's shutdown (SIGTERM) is bounded whatever Redis or the model does.

- Redis goes away while the worker drains: when the grace ends and the hand-back cannot reach
  Redis, the task threads are released, the messages stay unacknowledged and the worker exits;
  once Redis is back, a peer's reaper takes the records back and every sequence ends
  `succeeded`.
- The engine is stuck mid-step (a hung model process): the hand-back never comes, so the task
  threads are released HANDBACK_TIMEOUT_S after the grace, the model process is stopped and the
  worker exits; a peer finishes every sequence.
"""
from __future__ import annotations

import signal
import subprocess
import time

import pytest

import psutil

from support import wait_until
from worker.engine_core import HANDBACK_TIMEOUT_S

from .factories import assert_all_succeeded_once, model_process, record, running_with_tokens

pytestmark = [pytest.mark.slow, pytest.mark.integration]

GRACE_S = 4.0
MARGIN_S = 10.0        # the bound: exit within the grace + 10 s (+ the hand-back's wait)
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
    assert code == 0, log[-3000:]   # the drain ended it, not the overrun timer (exit 1)

    # Redis returns (its append-only file kept the records, still `running` under w1, and the
    # messages, unacknowledged); a new worker's reaper takes w1's sequences back.
    world.redis_server.start()
    for seq_id in unfinished:
        assert record(r, seq_id)["worker"] == w1.hostname
    world.worker("w2")
    assert_all_succeeded_once(api, r, ids, LONG["max_tokens"])


def test_worker_exits_when_its_engine_is_stuck_mid_step_at_shutdown(world):
    w1 = world.worker("w1", LLMQ_SHUTDOWN_GRACE=str(GRACE_S))
    api, r = world.api(), world.client()
    ids = [j["id"] for j in api.submit_many([f"Epic {i}:" for i in range(3)], **LONG)]
    wait_until(lambda: len(running_with_tokens(r, ids, 1)) == 3, 60, "the sequences to run")
    model = model_process(w1)
    model.suspend()   # a hung GPU: the step in flight never returns

    sent_at = time.monotonic()
    w1.signal(signal.SIGTERM)
    try:
        w1.proc.wait(GRACE_S + HANDBACK_TIMEOUT_S + MARGIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the worker with a stuck engine did not exit:\n"
                    + w1.log_path.read_text()[-3000:])
    assert time.monotonic() - sent_at >= GRACE_S   # it did wait out the grace first
    assert "did not hand back within" in w1.log_path.read_text()
    _gone, alive = psutil.wait_procs([model], timeout=10)
    assert not alive, "the stuck model process outlived its worker"

    # Their messages went back to the queue unacknowledged and their records stayed `running`
    # under w1: a new worker runs every one of them to its end.
    world.worker("w2")
    assert_all_succeeded_once(api, r, ids, LONG["max_tokens"])
