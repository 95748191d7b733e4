"""A message lost between the broker and the worker: kombu's Redis transport takes a message
in two round trips (BRPOP, then HSET unacked), and a consumer killed between them takes it
with it. The test takes the message out of the queue itself, as that consumer's first round
trip did, while the worker's one task thread is busy (so its own consumer is not waiting on
the queue and cannot take it first): the job must still run, within the documented bound
(1.5 x LLMQ_WORKER_STALE + a beat of its admission), exactly once. Then the lost message
turns up after all (the consumer was only slow) and is skipped, and a dead consumer's
unacknowledged copy of it is cleared once the job has ended."""
from __future__ import annotations

import json
import time

import pytest

from common.keys import Keys
from common.store import queue_lists
from support import wait_until

from .factories import (HEARTBEAT_S, SLACK_S, STALE_S, assert_all_succeeded_once, record,
                        stream_kinds)

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PARAMS = {"max_tokens": 30, "ignore_eos": True, "temperature": 0}
LOST_BOUND_S = 1.5 * STALE_S + HEARTBEAT_S + SLACK_S   # from admission to the start


def test_a_message_popped_and_never_delivered_runs_within_the_bound_exactly_once(world):
    # One task thread (Celery's prefetch is 1 per thread): while it runs a job, the worker's
    # consumer does not ask the broker for the next message.
    world.worker("w1", min_step_s=0.05, LLMQ_TASK_THREADS="1")
    api, r = world.api(), world.client()
    busy = api.submit(prompt="Busy", max_tokens=40, ignore_eos=True, temperature=0)["id"]
    wait_until(lambda: record(r, busy).get("status") == "running", 60, "the busy job to start")
    seq_id = api.submit(prompt="Popped and lost", **PARAMS)["id"]
    popped = r.brpop(queue_lists("llmq"), timeout=10)
    assert popped is not None, "the message was not in the queue"
    queue, raw = popped
    assert json.loads(raw)["headers"]["id"] == seq_id
    # Nowhere now: not queued, not delivered (only the busy job's message is unacked).
    assert r.hlen(Keys.kombu_unacked) == 1 and sum(r.llen(q) for q in queue_lists("llmq")) == 0

    [final] = assert_all_succeeded_once(api, r, [seq_id], PARAMS["max_tokens"],
                                        LOST_BOUND_S + 60).values()
    assert final["started_at"] - final["created_at"] <= LOST_BOUND_S, final
    rec = record(r, seq_id)
    assert rec["attempts"] == "1", rec
    kinds = stream_kinds(r, seq_id)
    assert "reset" not in kinds, kinds
    print(f"lost message ran {final['started_at'] - final['created_at']:.1f} s after admission")

    # The consumer was only slow: its message reaches the queue after all, and is skipped.
    r.lpush(queue, raw)
    wait_until(lambda: not r.llen(queue) and not r.hlen(Keys.kombu_unacked), 60,
               "the late message to be taken and acknowledged")
    assert record(r, seq_id) == rec and stream_kinds(r, seq_id) == kinds

    # A dead consumer's unacknowledged copy (delivered long ago, never acknowledged) goes once
    # its sequence has ended, within a reconciler pass, not after the visibility timeout.
    message = json.loads(raw)
    tag = message["properties"]["delivery_tag"]
    r.hset(Keys.kombu_unacked, tag, json.dumps([message, "", "llmq"]))
    r.zadd(Keys.kombu_unacked_index, {tag: time.time() - 2 * STALE_S})
    wait_until(lambda: not r.hexists(Keys.kombu_unacked, tag), STALE_S + SLACK_S,
               "the leftover unacknowledged message to be dropped")
    assert not r.zscore(Keys.kombu_unacked_index, tag)
