"""DELETE /v1/jobs/<id>: running, queued and finished jobs, through the whole stack."""
from __future__ import annotations

import pytest
import redis

from conftest import wait_until
from llmq_client import cancel, generate, get_job, submit, wait_job
from sse import iter_events, open_stream, read_stream

pytestmark = pytest.mark.integration

LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}


def _redis(tiny_stack) -> redis.Redis:
    return redis.Redis.from_url(tiny_stack["redis"].url, decode_responses=True)


def _done_events(r: redis.Redis, seq_id: str) -> int:
    return sum(1 for _id, f in r.xrange(f"llmq:seq:{seq_id}:events") if f["event"] == "done")


def _worker_idle(tiny_stack) -> bool:
    info = _redis(tiny_stack).hgetall(f"llmq:worker:{tiny_stack['worker'].hostname}")
    return info.get("running") == "0" and info.get("waiting") == "0"


def test_cancel_a_running_job_keeps_its_text(tiny_stack):
    url = tiny_stack["url"]
    job = submit(url, prompt="Hello there", **LONG)
    resp = open_stream(f"{url}/v1/jobs/{job['id']}/stream")
    events, at_cancel = [], None
    for ev in iter_events(resp):
        events.append(ev)
        if ev.event == "done":
            break
        if at_cancel is None and len(events) == 3:
            at_cancel = cancel(url, job["id"])
            assert at_cancel["id"] == job["id"]
            assert at_cancel["status"] in ("running", "cancelled")
    resp.close()
    assert at_cancel is not None, "the job ended before three tokens were streamed"

    final = events[-1].json
    assert events[-1].event == "done"
    assert final["status"] == "cancelled" and final["finish_reason"] == "cancelled"
    assert final["error"] is None and final["finished_at"] is not None
    # It stopped within a few steps of the DELETE, far from its 400 tokens ...
    n = final["usage"]["completion_tokens"]
    assert 3 <= n <= at_cancel["usage"]["completion_tokens"] + 8, (n, at_cancel["usage"])
    # ... and kept exactly the text it had streamed.
    streamed = "".join(e.json["text"] for e in events if e.event == "token")
    assert final["text"] == streamed and streamed
    assert get_job(url, job["id"]) == final

    # The engine dropped it; nothing more is written, and a second DELETE changes nothing.
    wait_until(lambda: _worker_idle(tiny_stack), 30, "the worker to drop the cancelled job")
    assert cancel(url, job["id"]) == final
    assert get_job(url, job["id"]) == final
    assert _done_events(_redis(tiny_stack), job["id"]) == 1


def test_cancel_a_queued_job_means_it_never_runs(tiny_stack):
    url = tiny_stack["url"]
    r = _redis(tiny_stack)
    # The worker holds 64 sequences (64 task threads, prefetch 1): fill them all, so the next
    # job waits in the Celery queue.
    fillers = [j["id"] for j in submit(url, prompts=["Hello there"] * 64, **LONG)["jobs"]]
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
        for seq_id in fillers:
            cancel(url, seq_id)
    for seq_id in fillers:
        assert wait_job(url, seq_id)["status"] == "cancelled"

    # Its task is delivered once the fillers leave, and skipped: the record never ran.
    wait_until(lambda: r.llen("llmq") == 0 and r.hlen("unacked") == 0, 60,
               "the Celery queue to drain")
    wait_until(lambda: _worker_idle(tiny_stack), 30, "the worker to go idle")
    assert get_job(url, job["id"]) == cancelled
    assert r.hget(f"llmq:seq:{job['id']}", "attempts") == "0"
    assert _done_events(r, job["id"]) == 1


def test_cancel_a_finished_job_leaves_it_succeeded(tiny_stack):
    url = tiny_stack["url"]
    job = generate(url, prompt="Hello there", max_tokens=5, temperature=0)
    assert job["status"] == "succeeded"
    after = cancel(url, job["id"])
    assert after == job
    assert get_job(url, job["id"]) == job
    assert _done_events(_redis(tiny_stack), job["id"]) == 1
