"""Faults of the model-worker process while its Celery worker lives: killed, or stuck.

Both faults leave the worker able to serve again, so the two tests share one world (one
redis-server, one worker, one API) built for this module: a worker start costs ~10 s of CPU.
"""
from __future__ import annotations

import time

import psutil
import pytest

from support import wait_until

from .factories import (HEARTBEAT_S, SLACK_S, STALE_S, World, assert_all_succeeded_once, model_process,
                        running_with_tokens, worker_info)

pytestmark = [pytest.mark.slow, pytest.mark.integration]

MAX_STEP_S = 1.0    # LLMQ_MAX_STEP of the worker
MIN_STEP_S = 0.05   # 60 tokens last >= 3 s, 300 tokens >= 15 s


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_model_dir):
    w = World(tmp_path_factory.mktemp("model-process"), tiny_model_dir)
    try:
        w.start_redis()
        # A step in flight for over 1 s counts as stuck (LLMQ_MAX_STEP; tiny-model steps take
        # milliseconds), so a stopped model process silences the heartbeat at once. Each step
        # lasts at least MIN_STEP_S, so the work is still running when the test breaks the
        # model process, on any machine.
        worker = w.worker("w1", min_step_s=MIN_STEP_S, LLMQ_MAX_STEP=str(MAX_STEP_S))
        # The API judges readiness with the workers' own staleness.
        yield w, worker, w.api(worker_stale_s=STALE_S)
    finally:
        w.close()


def _model_starts(r, worker) -> int:
    return int(worker_info(r, worker.hostname).get("model_starts") or 0)


def test_model_process_killed_mid_batch_is_restarted_and_the_batch_finishes(live):
    world, worker, api = live
    r = world.client()
    before = _model_starts(r, worker)
    assert before >= 1
    old = model_process(worker)
    ids = [j["id"] for j in api.submit_many([f"Tale {i}:" for i in range(4)], max_tokens=60,
                                            ignore_eos=True, temperature=0)]
    readers = {i: api.stream(i) for i in ids}
    wait_until(lambda: len(running_with_tokens(r, ids, 5)) == len(ids), 60,
               "the batch to be generating")

    old.kill()                                    # SIGKILL the model process only
    psutil.wait_procs([old], timeout=10)
    assert worker.proc.poll() is None             # the Celery worker lives on

    finals = assert_all_succeeded_once(api, r, ids, 60)
    for seq_id in ids:
        stream = readers[seq_id].result()
        # The engine kept the tokens it had and re-ran the batch from them: no restart from
        # scratch, so readers see no reset, and the deltas still add up to the final text.
        assert "reset" not in stream.kinds, stream.kinds
        assert stream.texts_after_last_reset() == finals[seq_id]["text"]
        assert stream.done == finals[seq_id]
        assert r.hget(f"llmq:seq:{seq_id}", "attempts") == "1"

    wait_until(lambda: _model_starts(r, worker) == before + 1, 30,
               "the heartbeat to report the restarted model")
    new = model_process(worker)
    assert new.pid != old.pid and worker.proc.poll() is None
    # ... and it keeps serving new requests.
    job = api.submit(prompt="After the crash", max_tokens=8, ignore_eos=True)
    done = api.wait_job(job["id"], 60)
    assert done["status"] == "succeeded" and done["usage"]["completion_tokens"] == 8


def test_stuck_model_process_turns_readyz_503_until_it_moves_again(live):
    world, worker, api = live
    r = world.client()
    wait_until(lambda: api.request("GET", "/readyz").status_code == 200, 30, "ready")
    job = api.submit(prompt="A long story", max_tokens=300, ignore_eos=True, temperature=0)
    wait_until(lambda: running_with_tokens(r, [job["id"]], 5), 60, "generation to start")

    model = model_process(worker)
    model.suspend()                               # SIGSTOP: the step never returns
    stopped_at = time.monotonic()
    try:
        # (a requests.Response is falsy for any error status: wrap it for wait_until)
        [resp] = wait_until(lambda: [x for x in [api.request("GET", "/readyz")]
                                     if x.status_code == 503],
                            MAX_STEP_S + STALE_S + 3 * SLACK_S, "/readyz 503")
        waited = time.monotonic() - stopped_at
        body = resp.json()
        assert body["status"] == "unavailable" and "no worker" in body["reason"], body
        # Not before the heartbeat is LLMQ_WORKER_STALE old (its last beat came at most one
        # beat before the freeze), and not much later: the beats stop once the step has been
        # in flight for LLMQ_MAX_STEP, the last one then goes stale after LLMQ_WORKER_STALE.
        assert STALE_S - HEARTBEAT_S <= waited <= MAX_STEP_S + STALE_S + SLACK_S, waited
        assert r.hget(f"llmq:seq:{job['id']}", "status") == "running"
    finally:
        model.resume()                            # SIGCONT
    wait_until(lambda: api.request("GET", "/readyz").status_code == 200, 15,
               "/readyz to turn 200 again")
    assert api.request("GET", "/readyz").json()["workers"][0]["name"] == worker.hostname

    final = api.wait_job(job["id"], 90)
    assert final["status"] == "succeeded" and final["usage"]["completion_tokens"] == 300
    kinds = [f["event"] for _i, f in r.xrange(f"llmq:seq:{job['id']}:events")]
    assert kinds.count("done") == 1 and "reset" not in kinds, kinds
