"""Redis goes down and comes back (append-only file on, same port, same directory).

What was accepted survives (finished results, queued sequences, the broker queue); while it is
down the API answers 503 with Retry-After at once (no hang, no 500); afterwards the API and the
worker reconnect by themselves and everything, old and new, finishes exactly once.
"""
from __future__ import annotations

import pytest

from common.store import SequenceStore
from support import wait_until

from .factories import elapsed, running_with_tokens, stream_kinds

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SHORT = {"max_tokens": 8, "ignore_eos": True, "temperature": 0}
MIN_STEP_S = 0.05


def test_redis_restart_with_aof_loses_nothing_and_everyone_reconnects(aof_world):
    world = aof_world
    # One sequence at a time, so the later ones wait in the broker queue through the outage.
    # Each step lasts at least MIN_STEP_S: the long one (150 tokens, >= 7.5 s) is still
    # running when Redis goes down, on any machine.
    world.worker("w1", min_step_s=MIN_STEP_S, LLMQ_MAX_NUM_SEQS="1")
    api, r = world.api(), world.client()
    store = SequenceStore(r)

    finished = api.wait_job(api.submit(prompt="Before the outage", **SHORT)["id"], 60)
    assert finished["status"] == "succeeded"
    long_id = api.submit(prompt="A long one", max_tokens=150, ignore_eos=True,
                         temperature=0)["id"]
    queued = [api.submit(prompt=f"Waiting {i}", **SHORT)["id"] for i in range(2)]
    wait_until(lambda: running_with_tokens(r, [long_id], 3) and store.queue_depth("llmq") == 2,
               60, "one running, two waiting in the broker")
    reader = api.stream(long_id, reconnect=True)   # an EventSource-like reader
    # Connected and reading before the outage: else it only met 503s and read everything
    # from the start, and the resume from Last-Event-ID went untested.
    wait_until(lambda: reader.events, 30, "the reader's first events")

    world.redis_server.stop()            # SIGTERM: Redis writes its AOF out on the way down

    # During the outage every route that needs Redis answers 503 + Retry-After, quickly.
    calls = [("GET", f"/v1/jobs/{finished['id']}", None),
             ("POST", "/v1/jobs", {"prompt": "During the outage", **SHORT}),
             ("DELETE", f"/v1/jobs/{queued[0]}", None),
             ("GET", f"/v1/jobs/{queued[0]}/stream", None)]
    for method, path, body in calls:
        resp, took = elapsed(api.request, method, path, json=body, timeout=20)
        assert resp.status_code == 503, (method, path, resp.status_code, resp.text)
        assert int(resp.headers["Retry-After"]) >= 1, resp.headers
        assert resp.json()["error"]["type"] == "service_unavailable", resp.text
        assert took < 10, (method, path, took)
    ready = api.request("GET", "/readyz")
    assert ready.status_code == 503 and ready.json()["reason"].startswith("redis"), ready.text
    assert api.request("GET", "/healthz").status_code == 200   # the process itself is fine

    world.redis_server.start()           # same port, same directory: it loads the AOF

    # Everything accepted before the outage is still there.
    wait_until(lambda: api.request("GET", "/readyz").status_code == 200, 60,
               "the API and the worker to reconnect")
    assert api.job(finished["id"]) == finished
    for seq_id in queued:
        assert api.job(seq_id)["status"] in ("queued", "running", "succeeded")

    # ... and it all finishes, exactly once, with the whole text.
    new_id = api.submit(prompt="After the outage", **SHORT)["id"]
    for seq_id, n in [(long_id, 150), *[(q, 8) for q in queued], (new_id, 8)]:
        job = api.wait_job(seq_id, 120)
        assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == n, job
        kinds = stream_kinds(r, seq_id)
        assert kinds.count("done") == 1 and kinds[-1] == "done", kinds
    stream = reader.result(60)
    final = api.job(long_id)
    # The reader's connection broke with Redis and resumed from its Last-Event-ID: it got every
    # stored event once, in order; the tokens made while Redis was away were kept by the engine
    # and published afterwards, so the deltas still add up to the final text.
    assert stream.reconnects >= 1 and stream.resumed_after, stream.resumed_after
    assert [e.id for e in stream.events] == [i for i, _f in r.xrange(f"llmq:seq:{long_id}:events")]
    assert stream.texts_after_last_reset() == final["text"] and stream.done == final
