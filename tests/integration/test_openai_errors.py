"""Failures speak HTTP, through the official `openai` client against the real stack (redis,
a Celery worker on the tiny model, the HTTP API): a prompt past the context is a
BadRequestError before anything runs, a sequence that fails while running is an APIError (or
ends its stream with one), and a client that hangs up cancels everything it asked for."""
from __future__ import annotations

import json
import socket
import uuid

import pytest
import requests

from support import FAIL_SEED, ApiServer, wait_until

from test_openai_client import _find_seq_by_prompt, get_job

import openai  # noqa: E402 - required (requirements-dev.txt): never a skip

pytestmark = pytest.mark.integration

def words(n: int) -> str:
    return " ".join(["hello"] * n)     # n tokens (the default model's tokenizer, also the tiny's)
# A stop token id past the vocabulary passes the API (ids are bounded by int32 only) and makes
# the sampler index outside the logits while min_tokens masks it: the model process reports
# the error for this sequence alone (tests/reliability/test_bad_requests.py).
# The test workers fail a sequence with this seed in the model process (LLMQ_TEST_FAIL_SEED):
# no input does any more (a stop id past the vocabulary did; now a 400 at admission).
POISON = {"seed": FAIL_SEED, "temperature": 1.0}
FINISHED = ("succeeded", "cancelled", "failed")


@pytest.fixture(scope="module")
def context(stack) -> int:
    """The context the worker serves, from its heartbeat: the tiny model's 512 positions, or
    the llama.cpp stack's LLMQ_MAX_MODEL_LEN."""
    import redis

    from common.store import SequenceStore

    store = SequenceStore(redis.Redis.from_url(stack["redis"].url, decode_responses=True))
    return next(int(w["max_model_len"]) for w in store.live_workers(60)
                if w["name"] == stack["worker"].hostname)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def call(client, model, kind: str, stream: bool, prompt: str = "Hello", **kw):
    """One request; a stream is read to its end. Returns the text."""
    if kind == "completions":
        resp = client.completions.create(model=model, prompt=prompt, stream=stream, **kw)
        pieces = ([c.choices[0].text for c in resp if c.choices] if stream
                  else [resp.choices[0].text])
    else:
        resp = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], stream=stream, **kw)
        pieces = ([c.choices[0].delta.content or "" for c in resp if c.choices] if stream
                  else [resp.choices[0].message.content])
    return "".join(pieces)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_prompt_over_the_context_raises_bad_request(client, stack, context, kind, stream):
    with pytest.raises(openai.BadRequestError) as info:
        call(client, stack["model"], kind, stream, words(context + 200), max_tokens=4)
    err = info.value
    assert err.status_code == 400 and err.code == "context_length_exceeded"
    assert err.param == ("prompt" if kind == "completions" else "messages")
    assert f"maximum context length is {context} tokens" in err.message


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_max_tokens_past_the_room_left_raises_bad_request(client, stack, context, kind):
    prompt = words(context - 42)
    with pytest.raises(openai.BadRequestError) as info:
        call(client, stack["model"], kind, False, prompt, max_tokens=100)
    assert info.value.param == "max_tokens" and info.value.code == "context_length_exceeded"
    # Unset, the default is cut to the room left: the completion ends at the context's end.
    resp = client.completions.create(model=stack["model"], prompt=prompt, max_tokens=None,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"


def test_job_routes_refuse_a_prompt_over_the_context(stack, context):
    for path in ("/v1/jobs", "/v1/generate"):
        r = requests.post(stack["url"] + path, json={"prompt": words(context + 200)}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.fixture
def transformers_only(stack):
    if stack["backend"] != "transformers":
        pytest.skip("the injected failure (LLMQ_TEST_FAIL_SEED) is the transformers backend's")


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_sequence_failing_while_running_raises_api_error(client, stack, kind,
                                                           transformers_only):
    with pytest.raises(openai.InternalServerError) as info:
        call(client, stack["model"], kind, False, max_tokens=20, **POISON)
    err = info.value
    assert err.status_code == 500 and err.code == "sequence_failed" and err.type == "server_error"
    job = get_job(stack, err.response.headers["X-Request-Id"])
    assert job["status"] == "failed" and "injected" in job["error"]["message"]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_stream_failing_while_running_ends_with_an_error(client, stack, kind,
                                                           transformers_only):
    with pytest.raises(openai.APIError) as info:
        call(client, stack["model"], kind, True, max_tokens=20, **POISON)
    assert not isinstance(info.value, openai.APIStatusError)   # the status line said 200
    assert info.value.body["code"] == "sequence_failed", info.value.body
    assert "injected" in info.value.message


def test_generate_answers_a_failed_job_with_500_and_its_record(stack, transformers_only):
    r = requests.post(stack["url"] + "/v1/generate", json={
        "prompt": "Hello", "max_tokens": 20, **POISON}, timeout=60)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "server_error"
    assert r.json()["job"]["status"] == "failed"


# --- an API that cannot count: the worker's refusal keeps its meaning -------------------------
@pytest.fixture(scope="module")
def blind_api(stack):
    """An API that cannot see the model's files (a hub id it has not cached): the worker refuses
    the long prompt at admission, and the record says it was the input."""
    from common.settings import Settings

    api = ApiServer(Settings.from_env(redis_url=stack["redis"].url,
                                      model="llmq-tests/not-a-local-model")).start()
    yield api
    api.stop()


def test_without_a_tokenizer_the_workers_refusal_is_still_a_bad_request(blind_api, context):
    client = openai.OpenAI(base_url=blind_api.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        call(client, "llmq-tests/not-a-local-model", "completions", False, words(context + 200),
             max_tokens=4)
    assert info.value.code == "context_length_exceeded" and str(context) in info.value.message
    with pytest.raises(openai.APIError) as info:   # streamed: the error chunk says the same
        call(client, "llmq-tests/not-a-local-model", "chat", True, words(context + 200),
             max_tokens=4)
    assert info.value.body["code"] == "context_length_exceeded"


# --- hang-ups: every sequence of the request is cancelled -------------------------------------
def _post_and_hang_up(stack, path: str, body: dict, prompt: str, num: int) -> list[str]:
    """Sends the request on a raw socket, waits until its first sequence produces tokens,
    closes the connection, and returns the ids of its `num` sequences (found by prompt)."""
    host, port = stack["url"].removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        ids = [wait_until(lambda i=i: _find_seq_by_prompt(stack, f"{prompt} {i}"), 10,
                          f"sequence {i} to be created") for i in range(num)]
        wait_until(lambda: get_job(stack, ids[0])["usage"]["completion_tokens"] > 0, 30,
                   "the first sequence to produce tokens")
    finally:
        sock.close()
    return ids


LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("path,field", [("/v1/completions", "prompt"),
                                        ("/v1/generate", "prompts")])
def test_a_multi_prompt_request_whose_client_hangs_up_cancels_every_prompt(stack, path, field):
    prompt = f"hang up {uuid.uuid4().hex}"
    prompts = [f"{prompt} {i}" for i in range(3)]
    ids = _post_and_hang_up(stack, path, {field: prompts, **LONG}, prompt, 3)
    jobs = [wait_until(lambda s=s: (j := get_job(stack, s))["status"] in FINISHED and j, 60,
                       "the sequence to end") for s in ids]
    assert [j["status"] for j in jobs] == ["cancelled"] * 3, jobs
    assert all(j["usage"]["completion_tokens"] < 400 for j in jobs)


def test_a_waiting_generate_whose_client_hangs_up_is_cancelled(stack):
    prompt = f"generate then hang up {uuid.uuid4().hex}"
    [seq_id] = _post_and_hang_up(stack, "/v1/generate", {"prompt": f"{prompt} 0", **LONG},
                                 prompt, 1)
    job = wait_until(lambda: (j := get_job(stack, seq_id))["status"] in FINISHED and j, 60,
                     "the sequence to end")
    assert job["status"] == "cancelled" and job["usage"]["completion_tokens"] < 400
