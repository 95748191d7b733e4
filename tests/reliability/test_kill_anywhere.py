"""Kill anywhere, lose nothing: whatever moment a worker dies at, every job it had taken reaches
a live worker within LLMQ_WORKER_STALE (plus a beat and a margin), runs to its full length and
finishes once. The moments a running set cannot cover are stopped exactly (LLMQ_TEST_STALL_AT,
a test-only setting: the worker parks there and the test SIGKILLs it); a sweep then kills a
worker at random moments under a steady trickle of jobs.
"""
from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from common.keys import Keys
from common.store import held_key, running_key
from support import wait_until

from .factories import (HEARTBEAT_S, SLACK_S, STALE_S, assert_all_succeeded_once, kill_hard,
                        record, running_with_tokens)

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PARAMS = {"max_tokens": 30, "ignore_eos": True, "temperature": 0}
BOUND_S = STALE_S + HEARTBEAT_S + SLACK_S   # from the kill to the job's start on a live worker


def _stalled(worker, moment: str) -> bool:
    return f"stalling at {moment}" in worker.log_path.read_text()


def test_worker_killed_after_taking_a_message_before_starting_it(world):
    w1 = world.worker("w1", LLMQ_TEST_STALL_AT="received")
    api, r = world.api(), world.client()
    seq_id = api.submit(prompt="Taken, never started", **PARAMS)["id"]
    wait_until(lambda: _stalled(w1, "received"), 60, "w1 to take the message")
    # The broker gave w1 the message (unacknowledged now); the record was never started.
    assert record(r, seq_id)["status"] == "queued" and r.hlen("unacked") == 1
    assert r.sismember(held_key(w1.hostname), seq_id)
    w2 = world.worker("w2")
    killed_at = time.time()
    kill_hard(w1)

    [final] = assert_all_succeeded_once(api, r, [seq_id], PARAMS["max_tokens"],
                                        BOUND_S + 60).values()
    rec = record(r, seq_id)
    assert rec["worker"] == w2.hostname and rec["attempts"] == "1", rec
    assert final["started_at"] - killed_at <= BOUND_S, final["started_at"] - killed_at
    assert not r.exists(held_key(w1.hostname))


def test_worker_killed_during_its_hand_back_at_shutdown(world):
    # The peer is up first but serves a queue of its own, so w1 takes all three; a reaper
    # sends what it takes back to its own queue, so w2 runs them afterwards.
    w2 = world.worker("w2", LLMQ_QUEUE="peer")
    # Steps of >= 50 ms: 60 tokens are still running when the (zero) grace ends.
    w1 = world.worker("w1", min_step_s=0.05, LLMQ_SHUTDOWN_GRACE="0",
                      LLMQ_TEST_STALL_AT="handback")
    api, r = world.api(), world.client()
    ids = [j["id"] for j in api.submit_many([f"Handed {i}:" for i in range(3)], max_tokens=60,
                                            ignore_eos=True, temperature=0)]
    readers = {i: api.stream(i) for i in ids}
    wait_until(lambda: len(running_with_tokens(r, ids, 5)) == 3, 60, "all three running")
    w1.signal(signal.SIGTERM)
    wait_until(lambda: _stalled(w1, "handback"), 60, "w1 to begin its hand-back")
    # The records went back to queued, and not one new message was sent yet: each waits in
    # the running set (as in the held set) until its message is sent.
    assert [record(r, i)["status"] for i in ids] == ["queued"] * 3
    assert r.smembers(running_key(w1.hostname)) == set(ids)
    killed_at = time.time()
    kill_hard(w1)

    finals = assert_all_succeeded_once(api, r, ids, 60, BOUND_S + 60)
    for seq_id in ids:
        rec = record(r, seq_id)
        assert rec["worker"] == w2.hostname and rec["attempts"] == "2", rec
        assert finals[seq_id]["started_at"] - killed_at <= BOUND_S
        stream = readers[seq_id].result()
        assert stream.kinds.count("reset") == 1, stream.kinds
        assert stream.texts_after_last_reset() == finals[seq_id]["text"]


def test_kill_sweep_under_a_steady_trickle(world):
    """A live peer (w2) and a worker (w1) SIGKILLed at random moments of a steady trickle of
    jobs, started again under its name each time: every job ends succeeded once, in full."""
    seed = int(os.environ.get("LLMQ_SWEEP_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    print(f"kill sweep seed {seed} (LLMQ_SWEEP_SEED={seed} repeats it)")
    # Steps of >= 20 ms: a job lasts >= 0.6 s, so a kill finds jobs at every stage. The peer
    # takes at most 4 at a time, so the worker that is killed has most of the trickle.
    w2 = world.worker("w2", wait=False, min_step_s=0.02, LLMQ_MAX_NUM_SEQS="4")
    w1 = world.worker("w1", wait=False, min_step_s=0.02)
    w2.wait_ready()
    w1.wait_ready()
    api, r = world.api(), world.client()
    ids, readers, kills = [], {}, []

    def trickle(duration_s: float) -> None:
        # The pauses are the workload's random pace, not a synchronisation.
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            seq_id = api.submit(prompt=f"Trickle {len(ids)}:", **PARAMS)["id"]
            ids.append(seq_id)
            readers[seq_id] = api.stream(seq_id, timeout_s=600)
            time.sleep(rng.uniform(0.05, 0.3))

    for _ in range(int(os.environ.get("LLMQ_SWEEP_KILLS") or 4)):
        trickle(rng.uniform(0.2, 3.0))
        kills.append(time.time())
        kill_hard(w1)                                 # at a random moment of the trickle
        trickle(1.0)                                  # arrivals while w1 is dead
        w1 = world.worker("w1", min_step_s=0.02)      # its supervisor starts it again

    finals = assert_all_succeeded_once(api, r, ids, PARAMS["max_tokens"], BOUND_S + 120)
    for seq_id in ids:
        stream = readers[seq_id].result()
        assert stream.texts_after_last_reset() == finals[seq_id]["text"], seq_id
        assert stream.done == finals[seq_id]
    # Each job started (for the last time) within the bound of its creation or of the last
    # kill before that start, whichever came later.
    waits = {i: finals[i]["started_at"] - max([finals[i]["created_at"]] + [
        k for k in kills if k < finals[i]["started_at"]]) for i in ids}
    print(f"{len(ids)} jobs, {len(kills)} kills, longest recovery {max(waits.values()):.1f} s")
    assert max(waits.values()) <= BOUND_S, waits

    # The killed consumers' unacknowledged messages do not outlive their jobs (kombu would
    # redeliver them after LLMQ_VISIBILITY_TIMEOUT): each goes within a reconciler pass of
    # LLMQ_WORKER_STALE after its delivery.
    def leftovers() -> list[str]:
        return [tag for tag, m in r.hgetall(Keys.kombu_unacked).items()
                if json.loads(m)[0]["headers"]["id"] in ids]
    print(f"{len(leftovers())} unacknowledged messages of ended jobs at the end")
    wait_until(lambda: not leftovers(), 1.5 * STALE_S + SLACK_S, "unacked to be cleared")
