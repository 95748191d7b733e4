"""The OpenAI-compatible routes, driven by the official `openai` client against the real stack.

Everything here runs once per backend (the tiny random model on transformers, the default GGUF
on llama.cpp): greedy decoding is deterministic, so equalities between runs (stream vs
non-stream, seeds, stop strings cut out of a greedy run's own output) are exact. `ignore_eos`
keeps a model from stopping early.
"""
from __future__ import annotations

import json
import socket
import uuid

import pytest
import requests

from support import wait_until
from sse import iter_events

import openai  # noqa: E402 - required (requirements-dev.txt): never a skip

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me about foxes."}]


def get_job(stack, seq_id: str) -> dict:
    r = requests.get(f"{stack['url']}/v1/jobs/{seq_id}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def create(client, model, kind: str, **kw):
    """One non-streamed request; returns (response, text, finish_reason)."""
    if kind == "completions":
        resp = client.completions.create(model=model, prompt=PROMPT, **kw)
        return resp, resp.choices[0].text, resp.choices[0].finish_reason
    resp = client.chat.completions.create(model=model, messages=MESSAGES, **kw)
    return resp, resp.choices[0].message.content, resp.choices[0].finish_reason


def stream(client, model, kind: str, **kw):
    """One streamed request; returns (chunks, text, finish_reason)."""
    if kind == "completions":
        chunks = list(client.completions.create(model=model, prompt=PROMPT, stream=True, **kw))
        pieces = [c.choices[0].text for c in chunks if c.choices]
    else:
        chunks = list(client.chat.completions.create(model=model, messages=MESSAGES,
                                                     stream=True, **kw))
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason]
    assert len(finishes) == 1, finishes   # exactly one chunk carries the finish reason
    return chunks, "".join(pieces), finishes[0]


GREEDY = dict(temperature=0, max_tokens=16, extra_body={"ignore_eos": True})


# --- models -----------------------------------------------------------------------------------
def test_models_list_returns_the_served_model(client, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    assert models.data[0].object == "model"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert info.value.code == "model_not_found"
    assert info.value.param == "model"


# --- completions and chat, non-stream and stream ----------------------------------------------
def test_completion(client, model, stack):
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.object == "text_completion"
    assert resp.model == model
    assert len(resp.choices) == 1 and resp.choices[0].index == 0
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
    job = get_job(stack, resp.id)
    assert job["text"] == resp.choices[0].text
    assert job["usage"] == resp.usage.model_dump(exclude_none=True)


def test_completion_with_a_list_of_prompts(client, model):
    resp = client.completions.create(model=model, prompt=[PROMPT, "Hello"], max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 8
    # Each prompt's text is what it gets alone (same greedy run).
    alone = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert resp.choices[1].text == alone.choices[0].text


def test_chat_completion(client, model, stack):
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion"
    assert resp.model == model
    msg = resp.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 6
    job = get_job(stack, resp.id)
    assert job["text"] == msg.content
    assert job["messages"] == MESSAGES


def test_chat_max_completion_tokens(client, model):
    resp = client.chat.completions.create(model=model, messages=MESSAGES,
                                          max_completion_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 5
    assert resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_stream_equals_non_stream_at_temperature_0(client, model, kind):
    resp, text, finish = create(client, model, kind, **GREEDY)
    chunks, streamed, streamed_finish = stream(client, model, kind, **GREEDY)
    assert streamed == text and text
    assert streamed_finish == finish == "length"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != resp.id
    assert all(c.usage is None for c in chunks)   # no usage chunk unless asked for
    if kind == "chat":
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.object == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_stream_options_include_usage(client, model, kind):
    chunks, _text, finish = stream(client, model, kind, max_tokens=7, temperature=0,
                                   stream_options={"include_usage": True},
                                   extra_body={"ignore_eos": True})
    assert finish == "length"
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 7
    assert last.usage.prompt_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + 7
    assert all(c.choices and c.usage is None for c in chunks[:-1])


# --- stop, length, seeds ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_stop_string_cuts_the_text(client, model, kind):
    # Seeded sampling: varied text (greedy on the random model repeats one token), and the
    # same tokens again in the run with the stop string, up to where it stops.
    sampled = dict(temperature=1.0, seed=5, max_tokens=16, extra_body={"ignore_eos": True})
    _resp, full, _ = create(client, model, kind, **sampled)
    # A stop string taken from the run's own output, first seen after its start.
    stop = next((full[i:i + 2] for i in range(len(full) // 2, len(full) - 1)
                 if full[i:i + 2].strip() and full.index(full[i:i + 2]) > 0), None)
    assert stop, f"no usable stop string in {full!r}"
    resp, text, finish = create(client, model, kind, stop=[stop, "never-seen-stop"], **sampled)
    assert finish == "stop"
    assert stop not in text
    assert text == full[:full.index(stop)] and text
    assert resp.usage.completion_tokens <= 16
    # Streamed, the held-back tail never leaks the stop string either.
    _chunks, streamed, streamed_finish = stream(client, model, kind, stop=stop, **sampled)
    assert (streamed, streamed_finish) == (text, "stop")


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_max_tokens_gives_length(client, model, kind):
    resp, _text, finish = create(client, model, kind, max_tokens=3, temperature=0.7,
                                 extra_body={"ignore_eos": True})
    assert finish == "length"
    assert resp.usage.completion_tokens == 3


def test_seed_reproducible_at_temperature_1(client, model):
    def run(seed):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first = run(1234)
    assert run(1234) == first
    assert run(4321) != first   # the seed does steer sampling (16 tokens of near-uniform noise)


# --- errors -----------------------------------------------------------------------------------
BAD = [
    pytest.param(dict(temperature=5), "temperature", None, id="temperature-5"),
    pytest.param(dict(n=0), "n", None, id="n-0"),
    pytest.param(dict(extra_body={"frobnicate": 1}), "frobnicate", "unsupported_parameter",
                 id="unknown-parameter"),
    pytest.param(dict(extra_body={"use_beam_search": True}), "use_beam_search",
                 "unsupported_parameter", id="use_beam_search"),
    pytest.param(dict(extra_body={"functions": [{"name": "f"}]}),   # (chat takes `tools`)
                 "functions", "unsupported_parameter", id="functions"),
    pytest.param(dict(extra_body={"repetition_penalty": 0}), "repetition_penalty", None,
                 id="repetition_penalty-0"),
]


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("bad,param,code", BAD)
def test_bad_values_are_400_with_an_openai_error(client, model, kind, bad, param, code):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, model, kind, max_tokens=2, **bad)
    err = info.value
    assert err.status_code == 400
    body = err.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert isinstance(body["message"], str) and param in body["message"]
    assert body["type"] == err.type == "invalid_request_error"
    assert body["param"] == err.param == param
    assert body["code"] == err.code == code


# --- ids --------------------------------------------------------------------------------------
def test_response_id_is_the_sequence_id(client, model, stack):
    raw = client.completions.with_raw_response.create(model=model, prompt=PROMPT, max_tokens=4,
                                                      temperature=0)
    resp = raw.parse()
    assert resp.id.startswith("seq-")
    assert raw.headers["X-Request-Id"] == resp.id
    job = get_job(stack, resp.id)
    assert job["status"] == "succeeded"
    assert job["text"] == resp.choices[0].text
    assert job["usage"]["completion_tokens"] == resp.usage.completion_tokens


def test_streamed_chat_id_is_the_sequence_id(client, model, stack):
    with client.chat.completions.with_streaming_response.create(
            model=model, messages=MESSAGES, max_tokens=4, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) as raw:
        seq_id = raw.headers["X-Request-Id"]
        chunks = list(raw.parse())
    assert seq_id.startswith("seq-")
    assert {c.id for c in chunks} == {seq_id}
    job = get_job(stack, seq_id)
    assert job["status"] == "succeeded"
    assert job["text"] == "".join(c.choices[0].delta.content or "" for c in chunks)


# --- vLLM's extras ----------------------------------------------------------------------------
def test_top_k_and_min_p_reach_the_sampler(client, model):
    greedy = client.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        # At temperature 1 only the most likely token survives either filter: greedy text.
        resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, seed=7,
                                         extra_body={"ignore_eos": True, **extra})
        assert resp.choices[0].text == greedy, extra


def test_repetition_penalty_is_accepted(client, model):
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    assert resp.usage.completion_tokens == 6


def test_stop_token_ids_and_min_tokens(client, model, default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)   # every stack's tokenizer
    chunks, full, _ = stream(client, model, "completions", **GREEDY)
    pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    # A piece of the greedy output that is exactly one token, early enough to stop well before
    # max_tokens (the streamed pieces are the tokens' text, one per engine step).
    found = None
    for i, piece in enumerate(pieces[:8]):
        ids = tok.encode(piece, add_special_tokens=False)
        if len(ids) == 1 and tok.decode(ids) == piece:
            found = (i, piece, ids[0])
            break
    assert found, f"no single-token piece among {pieces[:8]!r}"
    i, piece, token_id = found
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True,
                                                 "stop_token_ids": [token_id]})
    text = resp.choices[0].text
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens <= i + 1
    assert full.startswith(text + piece)   # the stop token's text is not output (as vLLM)
    # min_tokens holds the stop token off until that many tokens are out.
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True, "min_tokens": i + 4,
                                                 "stop_token_ids": [token_id]})
    assert resp.usage.completion_tokens >= i + 4


# --- client disconnects -----------------------------------------------------------------------
LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}


def test_disconnecting_a_stream_cancels_but_a_job_stream_does_not(stack):
    url = stack["url"]
    # An OpenAI stream belongs to its connection: hanging up cancels the sequence.
    with requests.Session() as s:
        resp = s.post(url + "/v1/completions", json={"prompt": PROMPT, "stream": True, **LONG},
                      stream=True, timeout=60)
        assert resp.status_code == 200, resp.text
        seq_id = resp.headers["X-Request-Id"]
        events = iter_events(resp)
        for _ in range(2):
            assert json.loads(next(events).data)["id"] == seq_id
        resp.close()
    job = wait_until(lambda: (j := get_job(stack, seq_id))["status"] in
                     ("succeeded", "cancelled", "failed") and j, 30, "the stream's sequence to end")
    assert job["status"] == "cancelled", job
    assert job["finish_reason"] == "cancelled"
    assert job["usage"]["completion_tokens"] < 400

    # A /v1/jobs job is not tied to a connection: its stream reader may come and go.
    r = requests.post(url + "/v1/jobs", json={"prompt": PROMPT, **LONG}, timeout=10)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    with requests.Session() as s:
        resp = s.get(f"{url}/v1/jobs/{job_id}/stream", stream=True, timeout=60)
        events = (e for e in iter_events(resp) if e.event == "token")
        next(events), next(events)
        resp.close()
    assert get_job(stack, job_id)["status"] == "running"
    job = wait_until(lambda: (j := get_job(stack, job_id))["status"] in
                     ("succeeded", "cancelled", "failed") and j, 60, "the job to end")
    assert job["status"] == "succeeded", job
    assert job["usage"]["completion_tokens"] == 400


def _find_seq_by_prompt(stack, prompt: str) -> str | None:
    import redis

    r = redis.Redis(port=stack["redis"].port, decode_responses=True)
    for key in r.scan_iter("llmq:seq:seq-*", count=1000):
        if not key.endswith(":events") and r.hget(key, "prompt") == prompt:
            return key.removeprefix("llmq:seq:")
    return None


def test_disconnecting_a_waiting_request_cancels(stack):
    """A non-streamed /v1/completions waits for the result; a client that hangs up meanwhile
    cancels it (the server notices at its next keep-alive check)."""
    host, port = stack["url"].removeprefix("http://").split(":")
    prompt = f"disconnect me {uuid.uuid4().hex}"
    body = json.dumps({"prompt": prompt, **LONG}).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        seq_id = wait_until(lambda: _find_seq_by_prompt(stack, prompt), 10,
                            "the request's sequence to be created")
        wait_until(lambda: get_job(stack, seq_id)["usage"]["completion_tokens"] > 0, 30,
                   "the sequence to produce tokens")
    finally:
        sock.close()
    job = wait_until(lambda: (j := get_job(stack, seq_id))["status"] in
                     ("succeeded", "cancelled", "failed") and j, 30, "the sequence to end")
    assert job["status"] == "cancelled", job
    assert job["usage"]["completion_tokens"] < 400
