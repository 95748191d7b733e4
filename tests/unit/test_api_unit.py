"""The Flask app on fakeredis with a recording Celery stub: shapes, errors, auth, readiness."""
from __future__ import annotations

import json
import subprocess
import sys

import fakeredis
import pytest

from common.protocol import GENERATE_TASK, FinishReason
from common.store import CANCELLED_KEY, record_key

from .factories import RecordingCelery, make_settings

pytest.importorskip("lupa", reason="fakeredis needs lupa to run the store's Lua scripts")

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


class Api:
    """One app per settings (building it costs ~0.3 s); reset() gives each test a clean slate."""

    def __init__(self, **settings_overrides):
        from app import create_app

        self.r = fakeredis.FakeRedis(decode_responses=True)
        self.celery = RecordingCelery()
        self.app = create_app(make_settings(**settings_overrides), redis_client=self.r,
                              celery=self.celery)
        self.app.testing = True
        self.client = self.app.test_client()
        self.store = self.app.extensions["llmq"]["store"]

    def reset(self) -> "Api":
        self.r.flushall()
        self.celery.calls.clear()
        return self


@pytest.fixture(scope="module")
def _default_api():
    return Api(wait_timeout_s=0.1)   # a route that waits for a worker must not hang a test


@pytest.fixture(scope="module")
def _keyed_api():
    return Api(api_keys=("k1", "k2"))


@pytest.fixture(scope="module")
def _tight_api():
    return Api(max_prompts=2, max_tokens_limit=10, max_body_bytes=1000)


@pytest.fixture
def api(_default_api):
    a = _default_api.reset()
    return a.client, a.r, a.celery, a.store


@pytest.fixture
def tight(_tight_api):
    a = _tight_api.reset()
    return a.client, a.r, a.celery


def assert_error(resp, status, type_=None):
    assert resp.status_code == status, resp.get_data(as_text=True)
    assert resp.is_json, resp.get_data(as_text=True)
    err = resp.get_json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if type_:
        assert err["type"] == type_
    return err


# --- creating jobs ---------------------------------------------------------------------------
def test_post_prompt_creates_a_queued_job_and_sends_one_task(api):
    client, r, celery, store = api
    resp = client.post("/v1/jobs", json={"prompt": "Hello 🎉", "max_tokens": 5, "stop": "\n"})
    assert resp.status_code == 202
    job = resp.get_json()
    assert job["id"].startswith("seq-") and job["status"] == "queued"
    assert job["object"] == "job" and job["prompt"] == "Hello 🎉"
    assert resp.headers["Location"] == f"/v1/jobs/{job['id']}"
    assert len(celery.calls) == 1
    call = celery.calls[0]
    assert (call["name"], call["args"], call["task_id"], call["queue"]) == (
        GENERATE_TASK, [job["id"]], job["id"], "llmq")
    req = store.load_request(job["id"])
    assert req.prompt == "Hello 🎉"
    assert (req.params.max_tokens, req.params.stop) == (5, ["\n"])
    assert client.get(f"/v1/jobs/{job['id']}").get_json() == job


def test_default_max_tokens_and_top_k_normalisation(api):
    client, r, celery, store = api
    job = client.post("/v1/jobs", json={"prompt": "x", "top_k": -1}).get_json()
    params = store.load_request(job["id"]).params
    assert params.max_tokens == 256 and params.top_k is None


def test_post_messages(api):
    client, r, celery, store = api
    msgs = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "café?"}]
    resp = client.post("/v1/jobs", json={"messages": msgs})
    assert resp.status_code == 202
    job = resp.get_json()
    assert job["messages"] == msgs and job["prompt"] is None
    assert store.load_request(job["id"]).messages == msgs
    assert len(celery.calls) == 1


def test_post_prompts_returns_jobs_in_order_with_one_task_each(api):
    client, r, celery, store = api
    prompts = [f"prompt {i}" for i in range(5)]
    resp = client.post("/v1/jobs", json={"prompts": prompts, "temperature": 0})
    assert resp.status_code == 202
    body = resp.get_json()
    assert body["object"] == "list"
    jobs = body["jobs"]
    assert [j["prompt"] for j in jobs] == prompts
    assert len({j["id"] for j in jobs}) == 5
    assert [c["task_id"] for c in celery.calls] == [j["id"] for j in jobs]
    assert all(c["args"] == [c["task_id"]] and c["name"] == GENERATE_TASK for c in celery.calls)


# --- reading ---------------------------------------------------------------------------------
def test_get_unknown_job_is_404_json(api):
    client, *_ = api
    assert_error(client.get("/v1/jobs/seq-nope"), 404, "not_found_error")
    assert_error(client.delete("/v1/jobs/seq-nope"), 404)
    assert_error(client.get("/v1/jobs/seq-nope/stream"), 404)


def test_unknown_route_and_wrong_method_are_json(api):
    client, *_ = api
    assert_error(client.get("/v1/nothing-here"), 404)
    assert_error(client.put("/v1/jobs", json={"prompt": "x"}), 405)


# --- validation: always a 400 JSON error, never a 500 ----------------------------------------
BAD_BODIES = [
    b"{not json",
    b"",
    b"null",
    b"{}",
    json.dumps({"stream": True}).encode(),
    b"[1, 2]",
    b'"a string"',
    b"42",
    b"\xff\xfe\x00",
    json.dumps({"prompt": ""}).encode(),
    json.dumps({"prompt": "  "}).encode(),
    json.dumps({"prompt": 5}).encode(),
    json.dumps({"prompt": {"text": "x"}}).encode(),
    json.dumps({"prompt": "a", "prompts": ["b"]}).encode(),
    json.dumps({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}).encode(),
    json.dumps({"prompt": "x", "max_tokens": -1}).encode(),
    json.dumps({"prompt": "x", "max_tokens": 0}).encode(),
    json.dumps({"prompt": "x", "max_tokens": 10**9}).encode(),
    json.dumps({"prompt": "x", "max_tokens": 10**30}).encode(),
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
    json.dumps({"prompt": "x", "temperature": 3}).encode(),
    json.dumps({"prompt": "x", "temperature": -1}).encode(),
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "temperature": Infinity}',
    json.dumps({"prompt": "x", "top_p": 0}).encode(),
    json.dumps({"prompt": "x", "seed": 2**64}).encode(),
    json.dumps({"prompts": ["p"] * 65}).encode(),
    json.dumps({"prompts": []}).encode(),
    json.dumps({"prompt": "x", "unknown": True}).encode(),
    json.dumps({"prompt": "x", "stop": ["s"] * 17}).encode(),
    json.dumps({"prompt": "x" * 100_001}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x" * 100_001}]}).encode(),
    json.dumps({"prompt": "x", "min_tokens": 9, "max_tokens": 3}).encode(),
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=lambda b: b[:40].decode("latin-1"))
def test_bad_request_bodies_are_400_json(api, body):
    client, r, celery, _ = api
    resp = client.post("/v1/jobs", data=body, content_type="application/json")
    assert_error(resp, 400, "invalid_request_error")
    assert celery.calls == []
    assert r.keys("llmq:seq:*") == []                  # nothing was stored


def test_error_message_names_the_field(api):
    client, *_ = api
    err = assert_error(client.post("/v1/jobs", json={"prompt": "x", "temperature": 9}), 400)
    assert "temperature" in err["message"]
    err = assert_error(client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 10**9}), 400)
    assert "max_tokens" in err["message"]


def test_limits_come_from_settings(tight):
    client, _, celery = tight
    assert_error(client.post("/v1/jobs", json={"prompts": ["a", "b", "c"]}), 400)
    assert_error(client.post("/v1/jobs", json={"prompt": "a", "max_tokens": 11}), 400)
    assert client.post("/v1/jobs", json={"prompts": ["a", "b"], "max_tokens": 10}).status_code == 202
    assert len(celery.calls) == 2


_NESTED = b'{"prompt": "x", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
_SURROGATE = b'{"prompt": "a\\ud800b"}'          # valid JSON, but not encodable as UTF-8


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/generate", "/v1/completions"])
def test_deeply_nested_json_is_400_not_500(api, path):
    client, *_ = api
    resp = client.post(path, data=_NESTED, content_type="application/json")
    assert_error(resp, 400)


def test_lone_surrogate_is_400_not_500(api):
    client, r, celery, _ = api
    resp = client.post("/v1/jobs", data=_SURROGATE, content_type="application/json")
    assert_error(resp, 400)


@pytest.mark.parametrize("extra", [{"top_k": 10**30}, {"stop_token_ids": [-5]}])
def test_openai_request_bounds_sampling_ints(extra):
    from pydantic import ValidationError

    from app.openai_api import CompletionRequest

    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", **extra})


def test_sampling_ints_that_would_break_the_sampler_are_400(api):
    client, r, celery, _ = api
    for extra in ({"top_k": 10**30}, {"stop_token_ids": [-5]}, {"stop_token_ids": [10**30]}):
        assert_error(client.post("/v1/jobs", json={"prompt": "x", **extra}), 400)
    assert celery.calls == []


def test_body_over_max_body_bytes_is_413_json(tight):
    client, r, celery = tight
    resp = client.post("/v1/jobs", json={"prompt": "x" * 2000})
    assert_error(resp, 413)
    assert celery.calls == [] and r.keys("llmq:seq:*") == []
    assert client.post("/v1/jobs", json={"prompt": "x" * 100}).status_code == 202


# --- API keys --------------------------------------------------------------------------------
@pytest.fixture
def keyed(_keyed_api):
    a = _keyed_api.reset()
    return a.client, a.r, a.celery


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def test_missing_or_wrong_key_is_401(keyed):
    client, r, celery = keyed
    for headers in ({}, auth("nope"), auth(""), {"Authorization": "k1"},
                    {"Authorization": "Basic azE6"}, auth("k1x")):
        resp = client.post("/v1/jobs", json={"prompt": "x"}, headers=headers)
        assert_error(resp, 401, "authentication_error")
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert_error(client.get("/v1/jobs/seq-x"), 401)
    assert celery.calls == []


def test_health_is_open_with_keys(keyed):
    client, *_ = keyed
    assert client.get("/healthz").status_code == 200
    assert client.get("/healthz").get_json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 503      # open (not 401), just not ready


def test_jobs_are_private_to_their_key(keyed):
    client, r, celery = keyed
    resp = client.post("/v1/jobs", json={"prompt": "secret"}, headers=auth("k1"))
    assert resp.status_code == 202
    jid = resp.get_json()["id"]
    assert client.get(f"/v1/jobs/{jid}", headers=auth("k1")).status_code == 200
    assert client.get(f"/v1/jobs/{jid}", headers={"Authorization": "bearer  k1 "}).status_code == 200
    assert_error(client.get(f"/v1/jobs/{jid}", headers=auth("k2")), 404)
    assert_error(client.get(f"/v1/jobs/{jid}/stream", headers=auth("k2")), 404)
    assert_error(client.delete(f"/v1/jobs/{jid}", headers=auth("k2")), 404)
    # k2's failed cancel left the job alone.
    assert client.get(f"/v1/jobs/{jid}", headers=auth("k1")).get_json()["status"] == "queued"
    assert not r.sismember(CANCELLED_KEY, jid)
    assert "k1" not in r.hget(record_key(jid), "owner")   # the key itself is not stored


# --- cancel and stream -----------------------------------------------------------------------
def test_delete_queued_job_cancels_it(api):
    client, r, celery, store = api
    jid = client.post("/v1/jobs", json={"prompt": "x"}).get_json()["id"]
    resp = client.delete(f"/v1/jobs/{jid}")
    assert resp.status_code == 200
    job = resp.get_json()
    assert job["status"] == "cancelled" and job["finish_reason"] == "cancelled"
    assert client.get(f"/v1/jobs/{jid}").get_json()["status"] == "cancelled"
    # The worker that later receives the task does not run it.
    assert store.start(jid, "w1") == ("cancelled", 0)


def test_delete_running_job_only_flags_it(api):
    client, r, celery, store = api
    jid = client.post("/v1/jobs", json={"prompt": "x"}).get_json()["id"]
    store.start(jid, "w1")
    job = client.delete(f"/v1/jobs/{jid}").get_json()
    assert job["status"] == "running"
    assert store.cancelled_among([jid]) == {jid}


def test_stream_of_a_finished_job_replays_and_ends(api):
    client, r, celery, store = api
    jid = client.post("/v1/jobs", json={"prompt": "x"}).get_json()["id"]
    store.start(jid, "w1")
    from common.store import TokenDelta

    store.publish_deltas([TokenDelta(jid, "Bon", "Bon", 1)])
    store.publish_deltas([TokenDelta(jid, "jour 🎉", "Bonjour 🎉", 2)])
    store.finish(jid, FinishReason.STOP, text="Bonjour 🎉", completion_tokens=2)
    resp = client.get(f"/v1/jobs/{jid}/stream")
    assert resp.status_code == 200 and resp.mimetype == "text/event-stream"
    body = resp.get_data(as_text=True)
    events = [blk for blk in body.split("\n\n") if blk.startswith("id:")]
    assert [e.split("\n")[1] for e in events] == ["event: token", "event: token", "event: done"]
    datas = [json.loads(e.split("\n")[2].removeprefix("data: ")) for e in events]
    assert "".join(d["text"] for d in datas[:2]) == "Bonjour 🎉"
    assert datas[2]["status"] == "succeeded" and datas[2]["text"] == "Bonjour 🎉"
    # Resuming after the first event gives exactly the rest.
    first_id = events[0].split("\n")[0].removeprefix("id: ")
    resumed = client.get(f"/v1/jobs/{jid}/stream", headers={"Last-Event-ID": first_id})
    assert [blk.split("\n")[1] for blk in resumed.get_data(as_text=True).split("\n\n")
            if blk.startswith("id:")] == ["event: token", "event: done"]


def test_stream_with_bad_last_event_id_is_400(api):
    client, *_ = api
    jid = client.post("/v1/jobs", json={"prompt": "x"}).get_json()["id"]
    assert_error(client.get(f"/v1/jobs/{jid}/stream", headers={"Last-Event-ID": "abc"}), 400)


# --- readiness -------------------------------------------------------------------------------
def test_readyz_needs_a_worker_with_the_model(api):
    client, r, celery, store = api
    assert client.get("/healthz").status_code == 200
    resp = client.get("/readyz")
    assert resp.status_code == 503 and resp.get_json()["status"] == "unavailable"
    store.heartbeat("w1@h", {"model_loaded": 0}, 10)
    assert client.get("/readyz").status_code == 503       # alive but still loading
    store.heartbeat("w2@h", {"model_loaded": 1}, 10)
    resp = client.get("/readyz")
    assert resp.status_code == 200
    body = resp.get_json()
    assert body["status"] == "ready" and [w["name"] for w in body["workers"]] == ["w2@h"]


# --- no torch in the API process -------------------------------------------------------------
_NO_TORCH = """
import sys
def check(step):
    assert "torch" not in sys.modules, step + " imports torch"
    assert "transformers" not in sys.modules, step + " imports transformers"
import common, common.protocol, common.settings, common.store, common.celery_config
check("common")
import app
from app import create_app
create_app
check("import app")
import fakeredis
create_app(redis_client=fakeredis.FakeRedis(decode_responses=True))
check("create_app()")
print("ok")
"""


def test_api_side_does_not_import_torch():
    """Each step is checked in turn (in one interpreter: each costs a second or more)."""
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
