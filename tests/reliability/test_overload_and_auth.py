"""Overload, per-key limits and API keys, against a real redis-server and the real HTTP app.

No worker runs here, so nothing drains the queue: what was accepted must still be in Redis,
and what was refused must have left nothing behind.
"""
from __future__ import annotations

import time

import pytest

from common.store import SequenceStore
from support import wait_until

pytestmark = pytest.mark.integration

BODY = {"prompt": "Hello", "max_tokens": 8}


def _records(r) -> list[str]:
    return [k for k in r.scan_iter("llmq:seq:*") if not k.endswith(":events")]


def _assert_429(resp, what: str) -> int:
    assert resp.status_code == 429, (what, resp.status_code, resp.text)
    err = resp.json()["error"]
    assert err["type"] == "rate_limit_error", err
    retry_after = int(resp.headers["Retry-After"])
    assert 1 <= retry_after <= 61, retry_after
    return retry_after


def _away_from_a_minute_boundary() -> None:
    """The rate windows are fixed minutes: start a burst well inside one (a burst of a few
    requests, with 10 s to spare for a slow machine)."""
    wait_until(lambda: time.time() % 60 <= 50, 62, "a point well inside a minute",
               interval=0.2)


def test_queue_full_answers_429_and_keeps_every_accepted_job(world):
    api = world.api(max_queued=3)
    r = world.client()
    accepted = [api.submit(**BODY)["id"] for _ in range(3)]
    refused = api.request("POST", "/v1/jobs", json=BODY)
    _assert_429(refused, "single past the limit")
    assert "queue is full" in refused.json()["error"]["message"]
    # A batch that does not fit is refused whole.
    _assert_429(api.request("POST", "/v1/jobs", json={"prompts": ["a", "b"], "max_tokens": 8}),
                "batch past the limit")
    # Every accepted job is still there, queued, with its Celery message in the broker; the
    # refused requests wrote nothing.
    assert SequenceStore(r).queue_depth("llmq") == 3
    assert sorted(k.split(":")[-1] for k in _records(r)) == sorted(accepted)
    assert [api.job(i)["status"] for i in accepted] == ["queued"] * 3


def test_per_key_request_rate_limit(world):
    api = world.api(api_keys=("key-a", "key-b"), rate_limit_rpm=2)
    a, b = api.with_key("key-a"), api.with_key("key-b")
    _away_from_a_minute_boundary()
    a.submit(**BODY)
    a.submit(**BODY)
    _assert_429(a.request("POST", "/v1/jobs", json=BODY), "third request of key a")
    assert b.submit(**BODY)["status"] == "queued"          # the other key is not affected
    assert len(_records(world.client())) == 3


def test_per_key_token_rate_limit(world):
    api = world.api(api_keys=("key-a", "key-b"), rate_limit_tpm=100).with_key("key-a")
    _away_from_a_minute_boundary()
    api.submit(prompt="x", max_tokens=60)
    resp = api.request("POST", "/v1/jobs", json={"prompt": "x", "max_tokens": 60})
    _assert_429(resp, "120 of 100 tokens")
    assert "tokens per minute" in resp.json()["error"]["message"]
    assert api.with_key("key-b").submit(prompt="x", max_tokens=60)["status"] == "queued"


def test_every_route_but_health_and_playground_needs_a_key(world):
    api = world.api(api_keys=("key-a", "key-b"))
    server = world.apis[-1]
    open_paths = {"/health", "/healthz", "/readyz", "/"}
    checked = 0
    for rule in server.app.url_map.iter_rules():
        path = rule.rule.replace("<seq_id>", "seq-0").replace("<path:filename>",
                                                               "playground.html")
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            for headers in ({}, {"Authorization": "Bearer wrong"},
                            {"Authorization": "key-a"}):     # not a Bearer credential
                resp = api.request(method, path, headers=headers, json={})
                if path in open_paths or path.startswith("/static/"):
                    assert resp.status_code != 401, (method, path)
                    continue
                assert resp.status_code == 401, (method, path, headers, resp.status_code)
                assert resp.headers["WWW-Authenticate"] == "Bearer"
                assert resp.json()["error"]["type"] == "authentication_error"
                checked += 1
    assert checked >= 3 * 8, checked     # jobs, stream, generate, openai, metrics, docs ...


def test_another_keys_job_does_not_exist(world):
    api = world.api(api_keys=("key-a", "key-b"))
    a, b = api.with_key("key-a"), api.with_key("key-b")
    job = a.submit(**BODY)
    for method, path in [("GET", f"/v1/jobs/{job['id']}"),
                         ("GET", f"/v1/jobs/{job['id']}/stream"),
                         ("DELETE", f"/v1/jobs/{job['id']}")]:
        resp = b.request(method, path)
        assert resp.status_code == 404, (method, path, resp.status_code, resp.text)
        assert resp.json()["error"]["type"] == "not_found_error"
        # ... exactly as for an id that was never issued.
        unknown = b.request(method, path.replace(job["id"], "seq-" + "0" * 32))
        assert unknown.status_code == 404 and unknown.json()["error"]["message"] == \
            resp.json()["error"]["message"].replace(job["id"], "seq-" + "0" * 32)
    # b's DELETE did nothing: the job is a's, still queued.
    assert a.job(job["id"])["status"] == "queued"
    assert a.request("DELETE", f"/v1/jobs/{job['id']}").json()["status"] == "cancelled"
