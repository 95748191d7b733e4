"""DELETE /v1/jobs/<id>: running, queued and finished jobs, through the whole stack."""
from __future__ import annotations

import pytest
import redis

from common.store import SequenceStore
from worker.workload_manager import MAX_DECODE_PASSES
from support import wait_until
from llmq_client import cancel, generate, get_job, submit, wait_job
from sse import read_stream

pytestmark = pytest.mark.integration

LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}


def _redis(stack) -> redis.Redis:
    return redis.Redis.from_url(stack["redis"].url, decode_responses=True)


def _done_events(r: redis.Redis, seq_id: str) -> int:
    return sum(1 for _id, f in r.xrange(f"llmq:seq:{seq_id}:events") if f["event"] == "done")


def _worker_info(stack) -> dict:
    return _redis(stack).hgetall(f"llmq:worker:{stack['worker'].hostname}")


def _worker_idle(stack) -> bool:
    info = _worker_info(stack)
    return info.get("running") == "0" and info.get("waiting") == "0"


def _tokens_so_far(url: str, seq_id: str, n: int):
    """The job once it has n tokens, or has ended; None while it waits or is short of them (a
    slow worker may not have started it yet: `queued` is no reason to stop waiting)."""
    job = get_job(url, seq_id)
    ended = job["status"] in ("succeeded", "failed", "cancelled")
    return job if job["usage"]["completion_tokens"] >= n or ended else None


def test_cancel_a_running_job_keeps_its_text(stack):
    url = stack["url"]
    job = submit(url, prompt="Hello there", **LONG)
    seen = wait_until(lambda: _tokens_so_far(url, job["id"], 3), 90, "a few tokens")
    assert seen["status"] == "running", seen
    at_cancel = cancel(url, job["id"])
    assert at_cancel["id"] == job["id"]
    assert at_cancel["status"] in ("running", "cancelled")

    stream = read_stream(f"{url}/v1/jobs/{job['id']}/stream")
    final = stream.done.json
    assert final["status"] == "cancelled" and final["finish_reason"] == "cancelled"
    assert final["error"] is None and final["finished_at"] is not None
    # It stopped within a few steps of the DELETE, far from its 400 tokens. The engine sees a
    # cancel when it publishes a step, and a backend that runs several decode passes per step
    # (multi-step, llama.cpp) publishes only at the step's end: that step's passes count too.
    n = final["usage"]["completion_tokens"]
    slack = 8 + MAX_DECODE_PASSES
    assert 3 <= n <= at_cancel["usage"]["completion_tokens"] + slack, (n, at_cancel["usage"])
    # ... and kept exactly the text it had streamed.
    assert final["text"] == "".join(stream.texts) and final["text"]
    assert get_job(url, job["id"]) == final

    # The engine dropped it; nothing more is written, and a second DELETE changes nothing.
    wait_until(lambda: _worker_idle(stack), 30, "the worker to drop the cancelled job")
    assert cancel(url, job["id"]) == final
    assert get_job(url, job["id"]) == final
    assert _done_events(_redis(stack), job["id"]) == 1


def test_cancel_right_after_submit_never_runs_to_completion(stack):
    url = stack["url"]
    job = submit(url, prompt="Hello there", **LONG)
    at_cancel = cancel(url, job["id"])
    assert at_cancel["status"] in ("queued", "running", "cancelled")
    final = wait_job(url, job["id"])
    assert final["status"] == "cancelled" and final["finish_reason"] == "cancelled"
    assert final["usage"]["completion_tokens"] < 50
    stream = read_stream(f"{url}/v1/jobs/{job['id']}/stream")
    assert stream.done.json == final and "".join(stream.texts) == final["text"]


def test_cancel_a_queued_job_means_it_never_runs(stack):
    url = stack["url"]
    r = _redis(stack)
    # The worker holds 64 sequences (64 task threads, prefetch 1): fill them all, so the next
    # job waits in the Celery queue. One filler first, decoding before the others join.
    first = submit(url, prompt="Hello there", **LONG)["id"]
    wait_until(lambda: _tokens_so_far(url, first, 2), 90, "the first filler to decode")
    fillers = [first] + [j["id"] for j in submit(url, prompts=["Hello there"] * 63, **LONG)["jobs"]]
    try:
        wait_until(lambda: all(s == "running" for s in
                               (r.hget(f"llmq:seq:{i}", "status") for i in fillers)),
                   60, "64 running sequences")
        job = submit(url, prompt="Queued behind the others", **LONG)
        assert get_job(url, job["id"])["status"] == "queued"

        cancelled = cancel(url, job["id"])
        # A queued job is cancelled at once, by the API, without waiting for a worker.
        assert cancelled["status"] == "cancelled" and cancelled["finish_reason"] == "cancelled"
        assert cancelled["text"] == "" and cancelled["started_at"] is None
        assert cancelled["usage"]["completion_tokens"] == 0
        stream = read_stream(f"{url}/v1/jobs/{job['id']}/stream")
        assert [e.event for e in stream.events] == ["done"]
        assert stream.done.json == cancelled
    finally:
        # All but one first, so the batch never empties with 64 rows to free at once.
        for seq_id in fillers[1:]:
            cancel(url, seq_id)
        wait_until(lambda: all(get_job(url, s)["status"] == "cancelled" for s in fillers[1:]),
                   60, "63 fillers to be cancelled")
        cancel(url, fillers[0])
    for seq_id in fillers:
        assert wait_job(url, seq_id)["status"] == "cancelled"

    # Its task is delivered once the fillers leave, and skipped: the record never ran.
    depth = SequenceStore(r).queue_depth
    wait_until(lambda: depth("llmq") == 0 and r.hlen("unacked") == 0, 60,
               "the Celery queue to drain")
    wait_until(lambda: _worker_idle(stack), 30, "the worker to go idle")
    assert get_job(url, job["id"]) == cancelled
    assert r.hget(f"llmq:seq:{job['id']}", "attempts") == "0"
    assert _done_events(r, job["id"]) == 1


def test_cancel_a_finished_job_leaves_it_succeeded(stack):
    url = stack["url"]
    job = generate(url, prompt="Hello there", max_tokens=5, temperature=0)
    assert job["status"] == "succeeded", job
    after = cancel(url, job["id"])
    assert after == job
    assert get_job(url, job["id"]) == job
    assert _done_events(_redis(stack), job["id"]) == 1
