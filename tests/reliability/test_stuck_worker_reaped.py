"""A worker whose engine is stuck (its model process frozen) while another worker lives: the
live one takes its sequences over after LLMQ_WORKER_STALE; when the stuck one moves again, its
late tokens and results must not land in records that are no longer its own.
"""
from __future__ import annotations

import pytest

from support import wait_until

from .factories import (assert_all_succeeded_once, model_process, record,
                        running_with_tokens, stream_kinds)

pytestmark = [pytest.mark.slow, pytest.mark.integration]

N = 6
MAX_TOKENS = 200
MIN_STEP_S = 0.05      # 200 tokens last >= 10 s on any machine


def test_stuck_worker_is_reaped_and_its_late_work_is_dropped(world):
    # A step in flight for over 1 s counts as stuck (tiny-model steps take milliseconds). Each
    # step lasts at least MIN_STEP_S: w1's sequences are still running when its model freezes.
    w1 = world.worker("w1", wait=False, min_step_s=MIN_STEP_S, LLMQ_MAX_STEP="1")
    w2 = world.worker("w2", wait=False, min_step_s=MIN_STEP_S, LLMQ_MAX_STEP="1")
    w1.wait_ready()
    w2.wait_ready()
    api, r = world.api(), world.client()
    ids = [j["id"] for j in api.submit_many([f"Saga {i}:" for i in range(N)],
                                            max_tokens=MAX_TOKENS, ignore_eos=True,
                                            temperature=0)]
    readers = {i: api.stream(i) for i in ids}
    wait_until(lambda: len(running_with_tokens(r, ids, 5)) == N, 90, "all sequences running")
    lost = [i for i in ids if record(r, i)["worker"] == w1.hostname]
    assert lost and len(lost) < N, "the test needs w1 and w2 each to run some"

    model = model_process(w1)
    model.suspend()                               # w1's engine hangs mid-step
    try:
        # w2 notices the silence, takes w1's sequences back and runs them to the end (w1's
        # Celery consumer still takes messages, but a stuck engine hands them back).
        wait_until(lambda: all(record(r, i).get("status") == "succeeded" for i in lost), 90,
                   "w1's sequences to finish on w2")
        at_end = {i: (api.job(i), r.xrange(f"llmq:seq:{i}:events")) for i in lost}
    finally:
        model.resume()                            # ... and now w1 wakes up with stale work

    # w1 does wake up with its stale copies and tries to go on with them: refused, dropped.
    wait_until(lambda: w1.log_path.read_text().count("dropping a stale copy") >= len(lost), 30,
               "w1 to drop its stale copies")
    for seq_id, (job, events) in at_end.items():
        # Nothing it did afterwards reached the finished records or their streams.
        assert api.job(seq_id) == job and r.xrange(f"llmq:seq:{seq_id}:events") == events
        assert record(r, seq_id)["worker"] == w2.hostname
        assert record(r, seq_id)["attempts"] == "2"

    finals = assert_all_succeeded_once(api, r, ids, MAX_TOKENS)
    for seq_id in ids:
        stream = readers[seq_id].result()
        # Readers see one consistent answer: after the (last) reset, the tokens add up to the
        # final text, and the done event carries exactly what GET returns.
        assert stream.texts_after_last_reset() == finals[seq_id]["text"], seq_id
        assert stream.done == finals[seq_id] == api.job(seq_id)
        kinds = stream_kinds(r, seq_id)
        assert kinds[-1] == "done", kinds          # nothing written after the end
    assert w1.proc.poll() is None and w2.proc.poll() is None
    # ... and w1, awake again, serves new work.
    wait_until(lambda: len(api.request("GET", "/readyz").json()["workers"]) == 2, 30,
               "both workers to be ready")
