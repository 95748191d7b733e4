"""The Flask app on fakeredis with a recording Celery stub: shapes, errors, auth, readiness."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import threading

import fakeredis
import pytest

from common.protocol import GENERATE_TASK, FinishReason
from common.store import CANCELLED_KEY, record_key

from .factories import RecordingCelery, make_settings


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
    # GET adds where it stands (no message in a real broker here: next, no rate known yet)
    assert client.get(f"/v1/jobs/{job['id']}").get_json() == {
        **job, "queue_position": 0, "estimated_start_s": None}


def test_a_jobs_deadline_counts_from_its_created_at(api):
    """A job that ends on its timeout never reports having taken less than the timeout:
    the deadline and created_at are one clock reading, not two taken admission apart."""
    client, r, celery, store = api
    job = client.post("/v1/jobs", json={"prompt": "x", "timeout": 0.5}).get_json()
    rec = r.hgetall(record_key(job["id"]))
    assert float(rec["deadline"]) - float(rec["created_at"]) == pytest.approx(0.5, abs=1e-9)
    assert job["created_at"] == float(rec["created_at"])


def test_default_max_tokens_and_top_k_normalisation(api):
    client, r, celery, store = api
    job = client.post("/v1/jobs", json={"prompt": "x", "top_k": -1}).get_json()
    params = store.load_request(job["id"]).params
    assert params.max_tokens == 256 and params.top_k == 0   # off, not unset (the model's)
    job = client.post("/v1/jobs", json={"prompt": "x"}).get_json()
    assert store.load_request(job["id"]).params.top_k is None


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
    assert "temperature" in err["message"] and err["param"] == "temperature"   # as OpenAI's
    err = assert_error(client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 10**9}), 400)
    assert "max_tokens" in err["message"]


def test_only_json_bodies_are_read(api):
    """text/plain was read as JSON: a cross-site form (no preflight) could queue jobs on a
    server without keys beyond loopback. vLLM refuses other media types too."""
    client, r, celery, _ = api
    body = json.dumps({"prompt": "x", "max_tokens": 1})
    for path in ("/v1/jobs", "/v1/completions"):
        err = assert_error(client.post(path, data=body, content_type="text/plain"), 415)
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    assert celery.calls == [] and r.keys("llmq:seq:*") == []
    ok = client.post("/v1/jobs", data=body, content_type="application/json; charset=utf-8")
    assert ok.status_code == 202


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_nan_or_infinity_literal_is_named_as_not_json(api, literal):
    """Python's json reads them: the client was told "temperature: should be <= 2"."""
    client, *_ = api
    err = assert_error(client.post("/v1/jobs", data='{"prompt": "x", "temperature": %s}' % literal,
                                   content_type="application/json"), 400)
    assert f"{literal} is not a JSON number" in err["message"]


def test_a_job_request_that_streams_is_refused_on_the_jobs_route(api):
    """/v1/jobs answered 202 without streaming, after taking one of the key's stream slots (a
    429 too_many_streams for a request that streams nothing)."""
    client, _, celery, _ = api
    err = assert_error(client.post("/v1/jobs", json={"prompt": "x", "stream": True}), 400)
    assert err["param"] == "stream" and "/v1/generate" in err["message"]
    assert celery.calls == []


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

    store.publish_deltas([TokenDelta(jid, "Bon", 1)])
    store.publish_deltas([TokenDelta(jid, "jour 🎉", 2)])
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


# --- tenants (docs/security.md) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def _tenant_api():
    return Api(api_keys=("k1", "k2"), metrics_keys=("scraper",), key_max_streams=2,
               owner_secret="s1")


@pytest.fixture
def tenants(_tenant_api):
    return _tenant_api.reset()


def _job_of(a: Api, key: str, **body) -> str:
    resp = a.client.post("/v1/jobs", json={"prompt": "x", **body}, headers=auth(key))
    assert resp.status_code == 202, resp.get_data(as_text=True)
    return resp.get_json()["id"]


def test_api_keys_written_with_spaces_after_commas_all_authenticate(monkeypatch):
    """Issue 13, bug 6: "key1, key2" made the second key ' key2', which never matched."""
    from app import create_app
    from common.settings import Settings

    monkeypatch.setenv("LLMQ_API_KEYS", "key1, key2 ,key3")
    settings = Settings.from_env()
    assert settings.api_keys == ("key1", "key2", "key3")
    app = create_app(settings, redis_client=fakeredis.FakeRedis(decode_responses=True),
                     celery=RecordingCelery())
    client = app.test_client()
    for key in ("key1", "key2", "key3"):
        assert client.post("/v1/jobs", json={"prompt": "x"}, headers=auth(key)).status_code == 202
    assert_error(client.post("/v1/jobs", json={"prompt": "x"}, headers=auth("key")), 401)


def test_owner_is_an_hmac_under_the_server_secret_not_a_plain_hash(tenants):
    import hashlib
    import hmac

    owner = tenants.r.hget(record_key(_job_of(tenants, "k1")), "owner")
    assert owner != hashlib.sha256(b"k1").hexdigest()[:32]      # guessable offline
    assert owner == hmac.new(b"s1", b"k1", hashlib.sha256).hexdigest()[:32]
    assert tenants.r.hget(record_key(_job_of(tenants, "k2")), "owner") != owner


def test_owner_secret_is_made_once_in_redis_when_not_configured():
    a, b = Api(api_keys=("k1",)), Api(api_keys=("k1",))
    b.r = b.store.r = a.r   # two API replicas on one Redis
    b.app.extensions["llmq"]["store"] = a.store
    jid = a.client.post("/v1/jobs", json={"prompt": "x"}, headers=auth("k1")).get_json()["id"]
    secret = a.r.get("llmq:owner-secret")
    assert secret and len(secret) == 64
    assert b.client.get(f"/v1/jobs/{jid}", headers=auth("k1")).status_code == 200


def test_keys_never_share_cached_prefixes_unless_allowed(tenants):
    """Issue 13, bug 8: the prefix cache's salt carries the owner, so cached_tokens cannot tell
    one key what another sent; a request's own cache_salt still splits its key's cache."""
    def salt(key, **body):
        params = tenants.r.hget(record_key(_job_of(tenants, key, **body)), "params")
        return json.loads(params)["cache_salt"]

    s1, s2 = salt("k1"), salt("k2")
    assert s1 and s2 and s1 != s2 and salt("k1") == s1
    assert salt("k1", cache_salt="mine") not in (s1, None)
    shared = Api(api_keys=("k1", "k2"), share_prefix_cache=True)
    for key in ("k1", "k2"):
        resp = shared.client.post("/v1/jobs", json={"prompt": "x"}, headers=auth(key))
        params = shared.r.hget(record_key(resp.get_json()["id"]), "params")
        assert json.loads(params)["cache_salt"] is None


def test_batch_lines_carry_their_keys_salt_like_any_request(tenants):
    """A batch line's sequences are salted with the key that sent the batch (they were not:
    two keys' batches shared cached prefixes, and cached_tokens told one what the other sent)."""
    from common.batch_store import BatchStore

    def line_salt(key, **body):
        line = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", **body}}
        f = tenants.client.post("/v1/files", headers=auth(key), data={
            "purpose": "batch", "file": (io.BytesIO(json.dumps(line).encode()), "in.jsonl")})
        b = tenants.client.post("/v1/batches", headers=auth(key), json={
            "input_file_id": f.get_json()["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"})
        assert b.status_code == 200, b.get_data(as_text=True)
        return BatchStore(tenants.r, 3600).line(b.get_json()["id"], 0)["params"]["cache_salt"]

    job_salt = json.loads(tenants.r.hget(record_key(_job_of(tenants, "k1")), "params"))
    assert line_salt("k1") == job_salt["cache_salt"] != line_salt("k2")
    assert line_salt("k1", cache_salt="mine") not in (job_salt["cache_salt"], None)


def test_health_routes_show_no_details_without_a_key(tenants):
    tenants.store.heartbeat("w1@secret-host", {"model_loaded": 1, "prefill_tokens": 16}, 10)
    client = tenants.client
    resp = client.get("/health")
    assert resp.status_code == 200 and resp.get_data() == b""
    resp = client.get("/readyz")
    assert resp.status_code == 200 and resp.get_json() == {"status": "ready"}
    assert resp.get_json() == client.get("/readyz", headers=auth("wrong")).get_json()
    # A tenant's key shows no more: the workers' counters sum every key's traffic.
    assert resp.get_json() == client.get("/readyz", headers=auth("k1")).get_json()
    detailed = client.get("/readyz", headers=auth("scraper")).get_json()
    assert [w["name"] for w in detailed["workers"]] == ["w1@secret-host"]
    tenants.r.flushall()
    assert client.get("/health").status_code == 503 and client.get("/health").get_data() == b""
    assert client.get("/readyz").get_json() == {"status": "unavailable"}


def test_metrics_are_for_the_metrics_key_not_a_tenants(tenants):
    """Any tenant's key read /metrics: the prefill and request counters sum every key's
    traffic, so one key could watch another's load."""
    client = tenants.client
    err = client.get("/metrics", headers=auth("k1"))
    assert err.status_code == 403 and err.get_json()["error"]["type"] == "permission_error"
    assert "LLMQ_METRICS_KEYS" in err.get_json()["error"]["message"]
    assert client.get("/metrics").status_code == 401
    ok = client.get("/metrics", headers=auth("scraper"))
    assert ok.status_code == 200 and "llmq_queue_depth" in ok.get_data(as_text=True)
    # The scraper's key is not a tenant's: it queues and reads nothing.
    assert client.post("/v1/jobs", json={"prompt": "x"}, headers=auth("scraper")).status_code == 401
    assert client.get("/v1/jobs", headers=auth("scraper")).status_code == 401


@pytest.mark.parametrize("path", ["/v1/jobs/{id}:events", "/v1/jobs/{id}:events/stream",
                                  "/v1/jobs/{id}x", "/v1/jobs/seq-{zeros}0"])
def test_malformed_job_ids_are_404_before_touching_redis(tenants, path):
    jid = _job_of(tenants, "k1")
    path = path.format(id=jid, zeros="0" * 32)
    for method in ("GET", "DELETE"):
        if method == "DELETE" and path.endswith("/stream"):
            continue
        resp = tenants.client.open(path, method=method, headers=auth("k1"))
        assert_error(resp, 404, "not_found_error")


@pytest.mark.parametrize("position", ["1-0\n", "1" * 23 + "-0", f"{2**64}-0", "0-0 ", "1-", "x"])
def test_malformed_stream_positions_are_400(tenants, position):
    jid = _job_of(tenants, "k1")
    for kw in ({"headers": {**auth("k1"), "Last-Event-ID": position}},
               {"headers": auth("k1"), "query_string": {"last_event_id": position}}):
        if "\n" in position and "Last-Event-ID" in kw["headers"]:
            continue   # a header cannot carry a newline; the query string can
        err = assert_error(tenants.client.get(f"/v1/jobs/{jid}/stream", **kw), 400)
        assert err["param"] == "last_event_id"


def test_stop_strings_are_bounded_in_number_and_length(tenants):
    client = tenants.client
    too_long = "x" * 257
    err = assert_error(client.post("/v1/jobs", json={"prompt": "x", "stop": [too_long]},
                                   headers=auth("k1")), 400)
    assert err["param"] == "stop" and "256" in err["message"]
    model = client.get("/v1/models", headers=auth("k1")).get_json()["data"][0]["id"]
    assert_error(client.post("/v1/completions", headers=auth("k1"), json={
        "model": model, "prompt": "x", "stop": [too_long]}), 400)
    assert client.post("/v1/jobs", json={"prompt": "x", "stop": ["x" * 256]},
                       headers=auth("k1")).status_code == 202


def test_a_key_holds_at_most_its_streams(tenants):
    from common.store import owner_streams_key

    jid = _job_of(tenants, "k1")
    tenants.store.request_cancel(jid)                  # finished: its stream replays and ends
    open_ = [tenants.client.get(f"/v1/jobs/{jid}/stream", headers=auth("k1"),
                                buffered=False) for _ in range(2)]
    assert all(r.status_code == 200 for r in open_)
    err = assert_error(tenants.client.get(f"/v1/jobs/{jid}/stream", headers=auth("k1")), 429,
                       "rate_limit_error")
    assert err["code"] == "too_many_streams"
    # A streamed submission is refused before its job exists.
    before = tenants.r.keys("llmq:seq:*")
    assert_error(tenants.client.post("/v1/generate", json={"prompt": "x", "stream": True},
                                     headers=auth("k1")), 429)
    model = tenants.client.get("/v1/models", headers=auth("k1")).get_json()["data"][0]["id"]
    for path, body in [("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/responses", {"input": "x"})]:
        assert_error(tenants.client.post(path, headers=auth("k1"), json={
            "model": model, "stream": True, **body}), 429)
    assert tenants.r.keys("llmq:seq:*") == before
    # Another key has its own streams; closing one gives the slot back.
    jid2 = _job_of(tenants, "k2")
    tenants.store.request_cancel(jid2)
    assert tenants.client.get(f"/v1/jobs/{jid2}/stream", headers=auth("k2")).status_code == 200
    open_[1].close()   # (last opened first: Flask's test client nests their contexts)
    resp = tenants.client.get(f"/v1/jobs/{jid}/stream", headers=auth("k1"))
    assert resp.status_code == 200 and "event: done" in resp.get_data(as_text=True)
    open_[0].close()
    assert tenants.r.zcard(owner_streams_key(tenants.r.hget(record_key(jid), "owner"))) == 0


def test_a_head_on_a_stream_gives_its_slot_back(tenants):
    """A HEAD's body is never read, so the slot the body would have given back stayed taken
    until its lease ran out: `curl -I` twice locked the key out of streaming for a minute."""
    jid = _job_of(tenants, "k1")
    tenants.store.request_cancel(jid)
    for _ in range(3):
        resp = tenants.client.head(f"/v1/jobs/{jid}/stream", headers=auth("k1"))
        resp.close()
        assert resp.status_code == 200
    resp = tenants.client.get(f"/v1/jobs/{jid}/stream", headers=auth("k1"))
    assert resp.status_code == 200 and "event: done" in resp.get_data(as_text=True)


def test_rate_limits_count_sequences_and_prompt_tokens():
    a = Api(api_keys=("k1", "k2"), rate_limit_rpm=5, rate_limit_tpm=2000)
    post = lambda key, body: a.client.post("/v1/jobs", json=body, headers=auth(key))  # noqa: E731
    # A 64-prompt request is 64 sequences: more than 5 a minute can ever take.
    err = assert_error(post("k1", {"prompts": ["x"] * 64, "max_tokens": 1}), 400)
    assert "64 sequences" in err["message"] and "RPM" in err["message"]
    # An 8,001-character prompt with max_tokens 1 is charged ~2,001 tokens, not 1.
    err = assert_error(post("k1", {"prompt": "y" * 8001, "max_tokens": 1}), 400)
    assert "2002 tokens" in err["message"]
    assert post("k1", {"prompts": ["x"] * 4, "max_tokens": 1}).status_code == 202
    resp = post("k1", {"prompts": ["x"] * 2, "max_tokens": 1})
    err = assert_error(resp, 429, "rate_limit_error")
    assert "sequences per minute" in err["message"] and 1 <= int(resp.headers["Retry-After"]) <= 61
    assert err["code"] == "rate_limit_exceeded"                    # OpenAI's code
    assert post("k1", {"prompt": "x", "max_tokens": 1}).status_code == 202   # the 5th fits
    assert post("k2", {"prompt": "y" * 4000, "max_tokens": 900}).status_code == 202
    resp = post("k2", {"prompt": "y" * 4000, "max_tokens": 900})   # 1,900 + 1,900 > 2,000
    err = assert_error(resp, 429, "rate_limit_error")
    assert "tokens per minute" in err["message"] and "Retry-After" in resp.headers
    assert len(a.celery.calls) == 4 + 1 + 1


def test_a_keys_share_of_the_queue_leaves_room_for_others():
    a = Api(api_keys=("k1", "k2"), max_queued=8)         # LLMQ_KEY_QUEUE_SHARE 0.5: 4 each
    post = lambda key, n: a.client.post(  # noqa: E731
        "/v1/jobs", json={"prompts": ["x"] * n, "max_tokens": 1}, headers=auth(key))
    assert post("k1", 4).status_code == 202
    err = assert_error(post("k1", 1), 429, "rate_limit_error")
    assert "LLMQ_KEY_QUEUE_SHARE" in err["message"]
    assert post("k2", 4).status_code == 202              # the flood did not fill the queue
    # Sequences past a key's share of a batch queue behind every other key's.
    priorities = [c["priority"] for c in a.celery.calls]
    assert priorities == [None] * 4 + [None] * 4         # 64 x 0.5 = 32 before demotion
    b = Api(api_keys=("k1", "k2"), max_num_seqs=4)       # a fair batch share of 2
    b.client.post("/v1/jobs", json={"prompts": ["x"] * 3, "max_tokens": 1}, headers=auth("k1"))
    b.client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 1, "priority": 2},
                  headers=auth("k1"))
    b.client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 1}, headers=auth("k2"))
    assert [c["priority"] for c in b.celery.calls] == [None, None, 5, 7, None]
    # Each record keeps the priority it was queued at (bug 10: a hand-back queues it the same).
    assert [b.store.priority_of(c["args"][0]) for c in b.celery.calls] == [None, None, 5, 7, None]


def test_a_submission_arriving_mid_submission_cannot_pass_a_keys_share(monkeypatch):
    """The share was read, then the records written, in separate round trips: requests that
    arrived together all passed the check before any wrote (16 at once took a key to 13 of 5).
    Here the second arrives while the first is between its check and its write."""
    a = Api(api_keys=("k1",), max_queued=10)               # LLMQ_KEY_QUEUE_SHARE 0.5: 5
    post = lambda: a.client.post(  # noqa: E731
        "/v1/jobs", json={"prompts": ["x"] * 3, "max_tokens": 1}, headers=auth("k1"))
    create, second, arrived = a.store.create, [], threading.Event()

    def create_after_another_arrived(*args, **kw):
        if not arrived.is_set():
            arrived.set()
            t = threading.Thread(target=lambda: second.append(post()))
            t.start()
            t.join()
        return create(*args, **kw)
    monkeypatch.setattr(a.store, "create", create_after_another_arrived)
    first = post()
    assert first.status_code == 202
    err = assert_error(second[0], 429, "rate_limit_error")
    assert err["code"] == "queue_share_exceeded" and "LLMQ_KEY_QUEUE_SHARE" in err["message"]
    [mine] = a.r.keys("llmq:owner:*:seqs")
    assert a.r.zcard(mine) == 3 and len(a.celery.calls) == 3
    assert a.r.zcard("llmq:admitting") == 0                 # sent: counted in the broker's lists


def test_a_filtered_job_list_reads_a_bounded_number_of_records(monkeypatch):
    """`?status=running&limit=1` read every record of the key's index, whole (text and all),
    looking for one match: a page now looks at most at PAGE_SCAN jobs past those it returns,
    reads whole only those it returns, and says where to go on."""
    PAGE_SCAN = 1000    # docs/api.md (common.owner_index.PAGE_SCAN)
    a = Api(api_keys=("k1",), max_queued=10_000, key_queue_share=1.0)
    ids = []
    for _ in range(PAGE_SCAN // 50 + 2):
        resp = a.client.post("/v1/jobs", json={"prompts": ["x"] * 50}, headers=auth("k1"))
        ids += [j["id"] for j in resp.get_json()["jobs"]]
    a.r.hset(record_key(ids[0]), "status", "running")    # the oldest: last in the list
    looked, whole = [], []
    zrevrange, get_records = a.r.zrevrange, a.store.get_records
    monkeypatch.setattr(a.r, "zrevrange", lambda *args: (
        lambda got: (looked.extend(got), got)[1])(zrevrange(*args)))
    monkeypatch.setattr(a.store, "get_records", lambda seq_ids: (
        whole.extend(seq_ids), get_records(seq_ids))[1])
    pages, after = [], None
    while True:
        looked.clear(), whole.clear()
        resp = a.client.get("/v1/jobs", headers=auth("k1"), query_string={
            "status": "running", "limit": 1, **({"after": after} if after else {})})
        assert resp.status_code == 200, resp.get_json()
        page = resp.get_json()
        assert len(whole) == len(page["data"]) and len(looked) <= PAGE_SCAN + 3
        pages.append(page)
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert len(pages) == 2 and pages[0]["data"] == [] and pages[0]["last_id"] in ids
    assert [j["id"] for j in pages[1]["data"]] == [ids[0]]
