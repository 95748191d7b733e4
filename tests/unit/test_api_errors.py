"""Failures over HTTP on fakeredis: the limits check, the failure mapping, the OpenAI streams'
error chunk and `reset` handling, and the one wait-or-cancel (hang-ups cancel everything)."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading

import fakeredis
import pytest
import redis

from common.protocol import FinishReason
from common.store import CANCELLED_KEY, Finish, TokenDelta

from .factories import RecordingCelery, make_settings


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
CONTEXT = 64   # the context the fake worker reports


class FinishingCelery(RecordingCelery):
    """Stands in for Celery and a worker: each sequence sent ends at once as `outcome` says."""

    def __init__(self):
        super().__init__()
        self.store = None
        # finish() keywords, or a function of (store, seq_id) that plays what a worker does;
        # None: the sequence stays queued
        self.outcome = None

    def send_task(self, name, args=None, kwargs=None, **options):
        super().send_task(name, args, kwargs, **options)
        if callable(self.outcome):
            self.outcome(self.store, args[0])
        elif self.outcome is not None:
            self.store.start(args[0], "w1")
            self.store.finish(args[0], **self.outcome)


class Api:
    """One app on fakeredis whose worker stand-in plays a chosen outcome; reset() per test."""

    def __init__(self, **overrides):
        from app import create_app

        self.r = fakeredis.FakeRedis(decode_responses=True)
        self.celery = FinishingCelery()
        self.settings = make_settings(**{"wait_timeout_s": 5.0, **overrides})
        self.app = create_app(self.settings, redis_client=self.r, celery=self.celery)
        self.app.testing = True
        self.client = self.app.test_client()
        self.store = self.celery.store = self.app.extensions["llmq"]["store"]

    def reset(self, outcome=None, context: int | None = CONTEXT) -> "Api":
        self.r.flushall()
        self.celery.calls.clear()
        self.celery.outcome = outcome
        if context:
            self.store.heartbeat("w1", {"model_loaded": 1, "max_model_len": context}, 60)
        engine = self.app.extensions["llmq"]["engine"]
        engine._workers_read_at = -1e9   # re-read the heartbeat now
        return self

    def seq_ids(self) -> list[str]:
        return [c["args"][0] for c in self.celery.calls]

    def status(self, seq_id: str) -> str:
        return self.store.get_job(seq_id)["status"]


@pytest.fixture(scope="module")
def _api(default_model_dir):
    return Api(model=default_model_dir, max_prompt_chars=2000)


@pytest.fixture
def api(_api):
    return _api.reset()


def error_of(resp, status: int) -> dict:
    assert resp.status_code == status, resp.get_data(as_text=True)
    err = resp.get_json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def stream_datas(resp) -> list:
    """The `data:` payloads of an OpenAI stream, JSON-decoded ([DONE] kept as a string)."""
    out = []
    for block in resp.get_data(as_text=True).split("\n\n"):
        if block.startswith("data: "):
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


LONG = " ".join(["hello"] * 100)   # 100 tokens: past the 64 of CONTEXT
ROUTES = [("/v1/completions", {"prompt": LONG}, "prompt"),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]},
           "messages"),
          ("/v1/jobs", {"prompt": LONG}, "prompt"),
          ("/v1/generate", {"messages": [{"role": "user", "content": LONG}]}, "messages")]


# --- refused before anything is queued ----------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,param", ROUTES)
def test_prompt_past_the_context_is_400_before_it_queues(api, path, body, param, stream):
    if stream and path == "/v1/jobs":
        pytest.skip("/v1/jobs does not stream")
    err = error_of(api.client.post(path, json={**body, "stream": stream}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == param
    assert f"maximum context length is {CONTEXT} tokens" in err["message"]
    assert "100 input tokens" in err["message"] or param == "messages"
    assert api.celery.calls == [] and api.r.dbsize() == 2   # only the heartbeat's keys


def test_explicit_max_tokens_past_the_room_is_400_an_unset_one_is_capped(api):
    prompt = " ".join(["hello"] * 50)
    err = error_of(api.client.post("/v1/completions", json={"prompt": prompt,
                                                            "max_tokens": 20}), 400)
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    assert "(20 > 64 - 50)" in err["message"], err
    err = error_of(api.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": 60}), 400)
    assert err["param"] == "max_completion_tokens"
    # Unset: the job is accepted; the worker cuts the default to the room left.
    assert api.client.post("/v1/jobs", json={"prompt": prompt}).status_code == 202


def test_multi_prompt_names_the_prompt_past_the_context(api):
    err = error_of(api.client.post("/v1/completions", json={"prompt": ["hi", LONG]}), 400)
    assert err["message"].startswith("prompt 1: ") and api.celery.calls == []


def test_without_a_worker_report_the_worker_decides(api):
    api.reset(context=None)   # no worker has said what its context is
    assert api.client.post("/v1/jobs", json={"prompt": LONG}).status_code == 202


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"request_id": "mine-1"}, "request_id"),
    ({"stop": [str(i) for i in range(17)]}, "stop"),
])
def test_openai_routes_share_the_job_routes_limits(api, path, body, param):
    inp = {"prompt": "hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]}
    err = error_of(api.client.post(path, json={**inp, **body}), 400)
    assert err["param"] == param, err
    assert api.celery.calls == []


@pytest.mark.parametrize("keys", [(), ("k1",)])
def test_more_sequences_than_the_queue_could_ever_hold_is_400_not_an_endless_429(keys):
    """LLMQ_MAX_QUEUED=100: a key's share is 50, so 60 prompts got 429 Retry-After: 2 on an
    empty queue, forever; without keys, 120 did."""
    api = Api(api_keys=keys, max_queued=100, max_prompts=128).reset()
    n = 60 if keys else 120
    err = error_of(api.client.post("/v1/jobs", headers={"Authorization": "Bearer k1"}, json={
        "prompts": [f"p{i}" for i in range(n)], "max_tokens": 4}), 400)
    assert err["code"] == "request_too_large" and "LLMQ_MAX_QUEUED" in err["message"]
    assert api.celery.calls == []
    ok = api.client.post("/v1/jobs", headers={"Authorization": "Bearer k1"}, json={
        "prompts": [f"p{i}" for i in range(50)], "max_tokens": 4})
    assert ok.status_code == 202, ok.get_data(as_text=True)


def test_a_submission_whose_bookkeeping_fails_queues_nothing(api, monkeypatch):
    """The jobs index (GET /v1/jobs) and webhook registration were written after the messages
    were sent: a Redis error there answered 503 "retry shortly" for jobs that ran anyway, and
    a retry ran them twice."""
    def blip(*_args, **_kwargs):
        raise redis.ConnectionError("blip")

    monkeypatch.setattr(api.app.extensions["llmq"]["jobs_index"], "add", blip)
    resp = api.client.post("/v1/jobs", json={"prompts": ["a", "b"]})
    assert resp.status_code == 503 and resp.headers["Retry-After"]
    assert api.celery.calls == []
    records = [k for k in api.r.scan_iter("llmq:seq:*") if api.r.type(k) == "hash"]
    # ended, not left queued with no message
    assert [api.r.hget(k, "status") for k in records] == ["failed", "failed"]


def test_a_submission_the_broker_refuses_midway_is_not_listed_nor_reported():
    """The broker fails at the second message: the 503 said nothing was accepted, but the
    records stayed in GET /v1/jobs (as failed) and each fired a `completed` webhook."""
    api = Api(webhook_secret="whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").reset()
    sent = []

    def flaky(store, seq_id):
        sent.append(seq_id)
        if len(sent) == 2:
            raise redis.ConnectionError("broker gone")

    api.celery.outcome = flaky
    resp = api.client.post("/v1/jobs", json={"prompts": ["a", "b", "c"],
                                             "webhook": "http://93.184.216.34/hook"})
    assert resp.status_code == 503, resp.get_data(as_text=True)
    assert len(sent) == 2
    assert [api.status(s) for s in sent] == ["failed", "failed"]   # the one sent is ended too
    assert api.client.get("/v1/jobs").get_json()["data"] == []
    assert api.app.extensions["llmq"]["webhooks"].due_job_events() == []

    # A worker that took a sent message before the failure runs it: it stays listed, hooked.
    sent.clear()

    def taken_then_gone(store, seq_id):
        sent.append(seq_id)
        if len(sent) == 1:
            store.start(seq_id, "w1")
        else:
            raise redis.ConnectionError("broker gone")

    api.celery.outcome = taken_then_gone
    resp = api.client.post("/v1/jobs", json={"prompts": ["a", "b"],
                                             "webhook": "http://93.184.216.34/hook"})
    assert resp.status_code == 503
    assert [j["id"] for j in api.client.get("/v1/jobs").get_json()["data"]] == [sent[0]]
    assert api.status(sent[0]) == "running" and api.status(sent[1]) == "failed"
    api.store.finish(sent[0], FinishReason.STOP, text="done")
    assert [e[:2] for e in api.app.extensions["llmq"]["webhooks"].due_job_events()] == [
        (sent[0], "completed")]


def test_min_tokens_over_the_default_max_tokens_says_so(api):
    err = error_of(api.client.post("/v1/completions", json={"prompt": "hi", "min_tokens": 17}),
                   400)
    assert "(16, the default)" in err["message"], err


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x" * 2001}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1500},
                                           {"role": "user", "content": "y" * 501}]}),
])
def test_openai_routes_apply_max_prompt_chars(api, path, body):
    err = error_of(api.client.post(path, json=body), 400)
    assert "2000 characters" in err["message"] and api.celery.calls == []


# --- failures while running ---------------------------------------------------------------------
FAILED = {"reason": FinishReason.ERROR, "error": "index 2147483647 is out of bounds",
          "text": "", "completion_tokens": 0}
TIMED_OUT = {"reason": FinishReason.TIMEOUT, "text": "Once", "completion_tokens": 1}
REFUSED = {"reason": FinishReason.ERROR, "error": "prompt is 700 tokens; the model's context "
           "is 512", "error_code": "context_length_exceeded", "text": "",
           "completion_tokens": 0}


@pytest.mark.parametrize("outcome,status,type_", [
    (FAILED, 500, "server_error"), (TIMED_OUT, 504, "timeout_error"),
    (REFUSED, 400, "invalid_request_error")])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_failed_sequence_is_an_openai_error_not_a_200(api, path, outcome, status, type_):
    api.reset(outcome)
    body = {"prompt": "hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]}
    resp = api.client.post(path, json=body)
    err = error_of(resp, status)
    assert err["type"] == type_ and resp.headers["X-Request-Id"] == api.seq_ids()[0]
    if outcome is FAILED:
        assert err["code"] == "sequence_failed" and "out of bounds" in err["message"]


@pytest.mark.parametrize("outcome,code", [(FAILED, "sequence_failed"), (TIMED_OUT, "timeout")])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_failed_stream_ends_with_an_error_chunk(api, path, outcome, code):
    api.reset(outcome)
    body = {"prompt": "hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]}
    resp = api.client.post(path, json={**body, "stream": True})
    assert resp.status_code == 200
    datas = stream_datas(resp)
    assert datas[-1] == "[DONE]" and datas[-2]["error"]["code"] == code, datas
    assert not any(c["finish_reason"] == "error" for d in datas[:-1] if "choices" in d
                   for c in d["choices"])


def test_generate_answers_a_failed_job_with_its_status_and_record(api):
    api.reset(FAILED)
    resp = api.client.post("/v1/generate", json={"prompt": "hi"})
    err = error_of(resp, 500)
    assert err["type"] == "server_error"
    job = resp.get_json()["job"]
    assert job["status"] == "failed" and job["id"] == api.seq_ids()[0]
    api.reset(REFUSED)
    resp = api.client.post("/v1/generate", json={"prompts": ["a", "b"]})
    assert error_of(resp, 400)["code"] == "context_length_exceeded"
    assert [j["status"] for j in resp.get_json()["results"]] == ["failed", "failed"]


def test_failure_of_maps_every_finish():
    from app.errors import failure_of

    def job(reason, error=None):
        return {"finish_reason": reason, "error": error, "usage": {"completion_tokens": 3}}

    assert failure_of(job("stop")) is None and failure_of(job("length")) is None
    assert failure_of(job("cancelled")) is None   # OpenAI's "abort", not an error
    assert failure_of(job("error", {"message": "boom"})).status == 500
    assert failure_of(job("error", {"message": "x", "code": "invalid_prompt"})).status == 400
    assert failure_of(job("timeout")).status == 504


# --- hang-ups: one wait-or-cancel for every route that waits -----------------------------------
@pytest.fixture
def hung_up(monkeypatch):
    import app.waiting

    monkeypatch.setattr(app.waiting, "client_gone", lambda: True)


def test_multi_prompt_completion_whose_client_hangs_up_cancels_every_prompt(api, hung_up):
    resp = api.client.post("/v1/completions", json={"prompt": ["a", "b", "c"]})
    assert resp.status_code == 499
    ids = api.seq_ids()
    assert len(ids) == 3 and [api.status(s) for s in ids] == ["cancelled"] * 3


@pytest.mark.parametrize("body", [{"prompt": "a"}, {"prompts": ["a", "b"]}])
def test_generate_whose_client_hangs_up_is_cancelled(api, hung_up, body):
    assert api.client.post("/v1/generate", json=body).status_code == 499
    assert [api.status(s) for s in api.seq_ids()] == ["cancelled"] * len(api.seq_ids())


@pytest.fixture
def short_wait(_api):
    """LLMQ_WAIT_TIMEOUT of 0.2 s, for one test."""
    api = _api.reset()
    ext = api.app.extensions["llmq"]
    ext["settings"] = api.settings.replace(wait_timeout_s=0.2)
    yield api
    ext["settings"] = api.settings


def test_openai_request_past_the_wait_timeout_is_504_and_cancelled(short_wait):
    err = error_of(short_wait.client.post("/v1/completions", json={"prompt": "a"}), 504)
    assert err["type"] == "timeout_error"
    assert short_wait.status(short_wait.seq_ids()[0]) == "cancelled"


def test_generate_past_the_wait_timeout_is_202_and_runs_on(short_wait):
    resp = short_wait.client.post("/v1/generate", json={"prompt": "a"})
    assert resp.status_code == 202 and resp.get_json()["status"] == "queued"
    assert resp.headers["Location"] == f"/v1/jobs/{short_wait.seq_ids()[0]}"
    resp = short_wait.client.post("/v1/generate", json={"prompts": ["a", "b"]})
    assert resp.status_code == 202
    assert [j["status"] for j in resp.get_json()["jobs"]] == ["queued", "queued"]


# --- streams: reset, resume after the end ------------------------------------------------------
def _stream_text(datas, chat: bool) -> str:
    key = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
    return "".join(key(c) for d in datas if isinstance(d, dict) and "choices" in d
                   for c in d["choices"])


def _lost_and_rerun(store, seq_id):
    """A worker streams "Hello wor" and is lost; another runs the sequence again."""
    _, first = store.start(seq_id, "w1")
    store.publish_deltas([TokenDelta(seq_id, "Hello", 1, first),
                          TokenDelta(seq_id, " wor", 2, first)])
    assert store.reclaim("w1") == [seq_id]            # the worker was lost: a reset event
    _, second = store.start(seq_id, "w2")
    store.publish_deltas([TokenDelta(seq_id, "Hel", 1, second)])
    store.publish_deltas([TokenDelta(seq_id, "lo world", 2, second)])
    store.publish_deltas([TokenDelta(seq_id, "!", 3, second)])
    store.finish(seq_id, FinishReason.STOP, text="Hello world!", completion_tokens=3)


def _lost_and_rerun_differently(store, seq_id):
    _, first = store.start(seq_id, "w1")
    store.publish_deltas([TokenDelta(seq_id, "Hello", 1, first)])
    store.reclaim("w1")
    _, second = store.start(seq_id, "w2")
    store.publish_deltas([TokenDelta(seq_id, "Goodbye", 1, second)])


@pytest.mark.parametrize("chat", [False, True])
def test_openai_stream_after_a_reset_sends_the_text_once(api, chat):
    api.reset(_lost_and_rerun)
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
                  if chat else ("/v1/completions", {"prompt": "x"}))
    datas = stream_datas(api.client.post(path, json={**body, "stream": True}))
    assert _stream_text(datas, chat) == "Hello world!" and datas[-1] == "[DONE]"
    assert datas[-2]["choices"][0]["finish_reason"] == "stop"


def test_openai_stream_whose_rerun_differs_ends_with_an_error_and_cancels(api):
    api.reset(_lost_and_rerun_differently)
    datas = stream_datas(api.client.post("/v1/completions", json={"prompt": "x",
                                                                   "stream": True}))
    assert _stream_text(datas, False) == "Hello"
    assert datas[-2]["error"]["code"] == "stream_diverged" and datas[-1] == "[DONE]"
    assert api.r.sismember(CANCELLED_KEY, api.seq_ids()[0])   # the engine stops it


def _cancelled_with_a_held_back_tail(store, seq_id):
    """stop=["world"]: "Hello" goes out, " wor" is held back (it may begin the stop string),
    then the job is cancelled: the worker writes the tail into the final text (its abort)."""
    _, a = store.start(seq_id, "w1")
    store.publish_deltas([TokenDelta(seq_id, "Hello", 1, a),
                          TokenDelta(seq_id, "", 2, a)])
    store.finish(seq_id, FinishReason.CANCELLED, text="Hello wor", completion_tokens=2)


@pytest.mark.parametrize("chat", [False, True])
def test_a_cancelled_stream_sends_the_text_held_back_for_a_stop_string(api, chat):
    api.reset(_cancelled_with_a_held_back_tail)
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
                  if chat else ("/v1/completions", {"prompt": "x"}))
    datas = stream_datas(api.client.post(path, json={**body, "stop": ["world"],
                                                     "stream": True}))
    assert _stream_text(datas, chat) == "Hello wor"
    assert datas[-2]["choices"][0]["finish_reason"] == "abort"


TOKENS = ["Hello", " wor", "ld", "!"]


def _entry(i: int) -> dict:
    return {"token_id": 100 + i, "token": TOKENS[i], "logprob": -0.1 * (i + 1), "rank": 1,
            "top_logprobs": []}


def _lost_and_rerun_the_same_with_logprobs(store, seq_id):
    """Greedy: "Hello", " wor" stream with their entries, the worker is lost, and the re-run
    makes the same tokens and goes on."""
    _, first = store.start(seq_id, "w1")
    for i in range(2):
        store.publish_deltas([TokenDelta(seq_id, TOKENS[i], i + 1,
                                         first, logprobs=[_entry(i)])])
    assert store.reclaim("w1") == [seq_id]
    _, second = store.start(seq_id, "w2")
    for i in range(4):
        store.publish_deltas([TokenDelta(seq_id, TOKENS[i], i + 1,
                                         second, logprobs=[_entry(i)])])
    store.finish_many([Finish(seq_id, FinishReason.STOP, text="".join(TOKENS),
                              completion_tokens=4, logprobs=[_entry(i) for i in range(4)])])


def test_a_streams_logprobs_after_a_reset_are_each_tokens_once(api):
    """The re-run's token that crosses what was sent went out without its entry, and the
    finish chunk sent the last entry twice: Hello, wor, !, !"""
    api.reset(_lost_and_rerun_the_same_with_logprobs)
    datas = stream_datas(api.client.post("/v1/completions", json={
        "prompt": "x", "logprobs": 1, "stream": True}))
    chunks = [c for d in datas if isinstance(d, dict) and "choices" in d for c in d["choices"]]
    assert "".join(c["text"] for c in chunks) == "Hello world!"
    assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == TOKENS


def test_stream_options_without_stream_is_a_400(api):
    """As OpenAI and vLLM answer it; it was accepted and ignored."""
    err = error_of(api.client.post("/v1/completions", json={
        "prompt": "x", "stream_options": {"include_usage": True}}), 400)
    assert err["param"] == "stream_options"


def test_a_queued_openai_stream_writes_keep_alives(default_model_dir):
    """A stream writes at least every LLMQ_SSE_KEEPALIVE: its slot lease is renewed on writes
    (LLMQ_KEY_MAX_STREAMS) and proxies drop silent connections. A queued completions stream
    wrote nothing at all until its first token."""
    api = Api(model=default_model_dir, sse_keepalive_s=0.05).reset()
    # (only a bound for the failing case: the test client reads the first chunk before it
    # returns, and the stream would wait for its queued job forever)
    guard = threading.Timer(10, lambda: [api.store.finish(i, FinishReason.CANCELLED)
                                         for i in api.seq_ids()])
    guard.start()
    try:
        resp = api.client.post("/v1/completions", json={"prompt": "x", "stream": True},
                               buffered=False)
        first = next(iter(resp.response))
    finally:
        guard.cancel()
    seq_id = resp.headers["X-Request-Id"]
    assert first.decode().startswith(":"), first
    assert resp.headers["X-Accel-Buffering"] == "no"
    api.store.finish(seq_id, FinishReason.CANCELLED)
    body = b"".join(resp.response).decode()
    assert body.rstrip().endswith("data: [DONE]")


def test_the_openai_sdk_reads_a_stream_through_its_keep_alives(default_model_dir, monkeypatch):
    """The official client skips SSE comment lines: a stream that waited (keep-alives first)
    reads as any other, and stream_options without stream is its BadRequestError."""
    import httpx2 as httpx   # the HTTP client the openai SDK (3.x) is built on
    import openai

    from app import openai_stream

    api = Api(model=default_model_dir, sse_keepalive_s=0.05).reset()
    written, kept_alive, passes = [], [], []

    def recording(environ, start_response):   # what the server wrote, as it wrote it
        for part in api.app.wsgi_app(environ, start_response):
            written.append(part)
            yield part

    def first_token_after_a_keep_alive():   # (asked on each idle pass of the stream)
        passes.append(1)
        if not kept_alive and any(p.startswith(b": keep-alive") for p in written):
            kept_alive.append(len(passes))
        if kept_alive == [len(passes)] or len(passes) == 3 and not kept_alive:
            # its token comes after a keep-alive (after 3 passes without: the failing case)
            [seq_id] = api.seq_ids()
            _, a = api.store.start(seq_id, "w1")
            api.store.publish_deltas([TokenDelta(seq_id, "Hi", 1, a)])
            api.store.finish(seq_id, FinishReason.STOP, text="Hi", completion_tokens=1)
        return False

    monkeypatch.setattr(openai_stream, "client_gone", first_token_after_a_keep_alive)
    client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="unused", http_client=(
        httpx.Client(transport=httpx.WSGITransport(app=recording))))
    model = client.models.list().data[0].id
    chunks = list(client.completions.create(model=model, prompt="x", stream=True))
    assert kept_alive and "".join(c.choices[0].text for c in chunks) == "Hi"
    assert chunks[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt="x",
                                  stream_options={"include_usage": True})
    assert refused.value.body["param"] == "stream_options"


def test_an_openai_stream_rides_out_a_redis_outage_then_ends_with_an_error_chunk(
        api, monkeypatch):
    """The hub hands its reader's Redis error to every subscriber; the stream was cut off
    (no error chunk, no [DONE]: the SDK raised RemoteProtocolError) at the first one, and a
    reconnect of the hub's reader ended every OpenAI stream of the process."""
    from app import openai_stream
    from common.stream_hub import Subscription

    reads = []
    real_read = Subscription.read
    store = api.app.extensions["llmq"]["engine"].store
    real_get = store.get_record

    def flaky(self, timeout_s):
        reads.append(1)
        if len(reads) <= 2:
            raise redis.ConnectionError("Connection reset by peer")
        if len(reads) <= 4:
            return []   # the hub's reader sleeping between its tries: Redis is still down
        return real_read(self, timeout_s)

    def down_while_flaky(seq_id):
        if len(reads) <= 4:
            raise redis.ConnectionError("Connection refused")
        return real_get(seq_id)

    api.reset(_lost_and_rerun)   # a stream that finishes once it can read
    monkeypatch.setattr(Subscription, "read", flaky)
    monkeypatch.setattr(store, "get_record", down_while_flaky)
    datas = stream_datas(api.client.post("/v1/completions", json={"prompt": "x",
                                                                   "stream": True}))
    assert _stream_text(datas, False) == "Hello world!" and datas[-1] == "[DONE]"

    monkeypatch.setattr(openai_stream, "REDIS_OUTAGE_S", 0.0)
    monkeypatch.setattr(store, "get_record", real_get)
    reads.clear()
    api.reset()   # stays queued
    monkeypatch.setattr(Subscription, "read", lambda self, timeout_s: (_ for _ in ()).throw(
        redis.ConnectionError("Connection refused")))
    datas = stream_datas(api.client.post("/v1/completions", json={"prompt": "x",
                                                                   "stream": True}))
    assert datas[-2]["error"]["code"] == "service_unavailable" and datas[-1] == "[DONE]"


def test_stream_resumed_at_its_done_event_ends_with_204(api):
    seq_id = api.client.post("/v1/jobs", json={"prompt": "x"}).get_json()["id"]
    api.store.start(seq_id, "w1")
    api.store.publish_deltas([TokenDelta(seq_id, "Hi", 1)])
    api.store.finish(seq_id, FinishReason.STOP, text="Hi", completion_tokens=1)
    done_id = api.store.read_events(seq_id)[-1][0]
    resp = api.client.get(f"/v1/jobs/{seq_id}/stream", headers={"Last-Event-ID": done_id},
                          buffered=False)
    try:
        assert resp.status_code == 204   # EventSource stops reconnecting
    finally:
        resp.close()
    engine = api.app.extensions["llmq"]["engine"]
    # The engine's event reader ends too, instead of idling until the record expires.
    assert list(itertools.islice(engine.events(seq_id, done_id, keepalive_s=0.05), 3)) == []


def test_an_event_reader_whose_last_entries_are_on_their_way_waits_for_them(api, monkeypatch):
    """The stream hub can hand a reader's entries over (moving its position past them) just
    after that reader's read came back empty. Judged from that position, the finished sequence
    has nothing left and the reader would end without its tokens and done event; the end check
    goes from what the reader has yielded instead."""
    seq_id = api.client.post("/v1/jobs", json={"prompt": "x"}).get_json()["id"]
    api.store.start(seq_id, "w1")
    api.store.publish_deltas([TokenDelta(seq_id, "Hi", 1)])
    api.store.finish(seq_id, FinishReason.STOP, text="Hi", completion_tokens=1)
    engine = api.app.extensions["llmq"]["engine"]
    subscribe = engine.streams.subscribe

    def late(positions):
        sub = subscribe(positions)
        read, held, calls = sub.read, [], []

        def first_read_misses_them(timeout_s):
            calls.append(1)
            if len(calls) > 1:
                out, held[:] = held[:], []
                return out or read(timeout_s)
            while not any(kind == "done" for _s, _e, kind, _d in held):
                held.extend(read(10.0))   # delivered: the position is past them now
            return []                     # ...but this read had come back empty

        sub.read = first_read_misses_them
        return sub

    monkeypatch.setattr(engine.streams, "subscribe", late)
    got = list(itertools.islice(engine.events(seq_id, "0-0", keepalive_s=0.05), 10))
    kinds = [ev[1] for ev in got if ev is not None]
    assert "token" in kinds and kinds[-1:] == ["done"]


# --- the counter is transformers' count, without torch ------------------------------------------
def test_prompt_counter_counts_as_the_worker_tokenizes(default_model_dir):
    from transformers import AutoTokenizer

    from common.prompt_counter import PromptCounter, model_folder

    counter = PromptCounter(model_folder(default_model_dir, "unused"))
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    for prompt in ["Hello", LONG, "émoji 🙂\n\nand tabs\t."]:
        assert counter.count({"prompt": prompt}) == len(tok(prompt)["input_ids"])
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Tell me"},
                      {"role": "assistant", "content": "OK"},
                      {"role": "user", "content": "more 🙂"}]):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert counter.count({"messages": messages}) == len(
            tok(text, add_special_tokens=False)["input_ids"])


_COUNT_WITHOUT_TORCH = """
import sys, fakeredis
from app import create_app
from common.settings import Settings
app = create_app(Settings(model=sys.argv[1]), redis_client=fakeredis.FakeRedis(
    decode_responses=True), celery=type("C", (), {"send_task": lambda *a, **k: None})())
app.extensions["llmq"]["store"].heartbeat("w", {"max_model_len": 64}, 60)
resp = app.test_client().post("/v1/jobs", json={"prompt": "hello " * 100})
assert resp.status_code == 400, resp.get_data(as_text=True)
assert "torch" not in sys.modules and "transformers" not in sys.modules
print("ok")
"""


def test_counting_in_the_api_imports_no_torch(default_model_dir):
    proc = subprocess.run([sys.executable, "-c", _COUNT_WITHOUT_TORCH, default_model_dir],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_a_default_model_converted_after_the_api_started_is_counted_later(tmp_path,
                                                                          default_model_dir):
    import shutil

    from common.prompt_counter import LazyPromptCounter

    lazy = LazyPromptCounter("smollm2", str(tmp_path))
    lazy.RETRY_S = 0.0
    assert lazy.get() is None               # the first worker has not converted it yet
    shutil.copytree(default_model_dir, tmp_path / "SmolLM2-135M-Instruct",
                    ignore=shutil.ignore_patterns("*.safetensors"))
    assert lazy.get().count({"prompt": "hello world"}) == 2
