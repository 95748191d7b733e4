"""SSE streams and Redis pub/sub of a job's tokens, through the whole stack."""
from __future__ import annotations

import json
import re
import time

import pytest
import redis
import requests

from llmq_client import get_job, submit, wait_job
from sse import iter_events, open_stream, read_stream

pytestmark = pytest.mark.integration

ENTRY_ID = re.compile(r"^(\d+)-(\d+)$")


def _key(entry_id: str) -> tuple[int, int]:
    m = ENTRY_ID.match(entry_id)
    assert m, entry_id
    return int(m.group(1)), int(m.group(2))


def _triples(stream) -> list[tuple]:
    return [(e.id, e.event, e.data) for e in stream.events]


def assert_well_formed(stream) -> dict:
    """Token events then exactly one done event; ids increase; the deltas add up to the text."""
    kinds = [e.event for e in stream.events]
    assert kinds[-1] == "done" and kinds.count("done") == 1, kinds
    assert set(kinds[:-1]) <= {"token"}, kinds
    keys = [_key(e.id) for e in stream.events]
    assert keys == sorted(keys) and len(set(keys)) == len(keys), "ids must strictly increase"
    for e in stream.tokens:
        assert set(e.json) == {"text"} and isinstance(e.json["text"], str)
    final = stream.done.json
    assert "".join(stream.texts) == final["text"]
    return final


def test_stream_of_a_running_job(stack):
    url = stack["url"]
    job = submit(url, prompt="Hello there", max_tokens=40, temperature=0, ignore_eos=True)
    stream = read_stream(f"{url}/v1/jobs/{job['id']}/stream")
    assert stream.response.headers["Cache-Control"] == "no-cache"
    final = assert_well_formed(stream)
    assert 0 < len(stream.tokens) <= 40
    assert final["status"] == "succeeded" and final["usage"]["completion_tokens"] == 40
    # The done event carries the final job object, exactly as GET shows it.
    assert final == get_job(url, job["id"])


def test_tokens_arrive_while_the_job_runs(stack):
    url = stack["url"]
    job = submit(url, prompt="Hello there", max_tokens=400, temperature=0, ignore_eos=True)
    resp = open_stream(f"{url}/v1/jobs/{job['id']}/stream")
    try:
        first = next(iter_events(resp))
        seen_at_first_event = get_job(url, job["id"])
    finally:
        resp.close()
    assert first.event == "token"
    # A stream is live: its first token is readable long before the job's 400th.
    assert seen_at_first_event["status"] == "running", seen_at_first_event["status"]
    assert seen_at_first_event["usage"]["completion_tokens"] < 400
    requests.delete(f"{url}/v1/jobs/{job['id']}", timeout=30)
    wait_job(url, job["id"])


def test_finished_job_replays_the_identical_stream_and_resumes_after_an_id(stack):
    url = stack["url"]
    job = submit(url, prompt="The quick brown fox", max_tokens=24, temperature=0,
                 ignore_eos=True)
    first = read_stream(f"{url}/v1/jobs/{job['id']}/stream")
    assert_well_formed(first)
    assert len(first.tokens) >= 4
    replay = read_stream(f"{url}/v1/jobs/{job['id']}/stream")
    assert _triples(replay) == _triples(first)

    # Last-Event-ID: exactly the events after that id, by header or by query parameter.
    events = first.events
    for cut in (0, len(events) // 2, len(events) - 2):
        resumed = read_stream(f"{url}/v1/jobs/{job['id']}/stream", last_event_id=events[cut].id)
        assert _triples(resumed) == _triples(first)[cut + 1:], cut
    by_query = read_stream(f"{url}/v1/jobs/{job['id']}/stream?last_event_id={events[1].id}")
    assert _triples(by_query) == _triples(first)[2:]


def test_reconnecting_mid_stream_loses_and_repeats_nothing(stack):
    url = stack["url"]
    job = submit(url, prompt="Hello there", max_tokens=120, temperature=0, ignore_eos=True)
    got = []
    resp = open_stream(f"{url}/v1/jobs/{job['id']}/stream")
    for ev in iter_events(resp):
        got.append(ev)
        if len(got) == 3 or ev.event == "done":
            break
    resp.close()   # the client drops the connection mid-stream
    rest = read_stream(f"{url}/v1/jobs/{job['id']}/stream", last_event_id=got[-1].id)
    events = got + rest.events
    full = read_stream(f"{url}/v1/jobs/{job['id']}/stream")
    assert [(e.id, e.event, e.data) for e in events] == _triples(full)
    final = assert_well_formed(full)
    assert final["usage"]["completion_tokens"] == 120


def test_bad_last_event_id_is_400(stack):
    url = stack["url"]
    job = submit(url, prompt="Hi", max_tokens=2, temperature=0)
    r = requests.get(f"{url}/v1/jobs/{job['id']}/stream", headers={"Last-Event-ID": "nope"},
                     timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]
    wait_job(url, job["id"])


def test_generate_with_stream_true(stack):
    url = stack["url"]
    stream = read_stream(url + "/v1/generate", method="POST",
                         json={"prompt": "Once upon a time", "max_tokens": 15, "temperature": 0,
                               "ignore_eos": True, "stream": True})
    final = assert_well_formed(stream)
    assert final["status"] == "succeeded" and final["usage"]["completion_tokens"] == 15
    assert stream.response.headers["X-Request-Id"] == final["id"]
    assert get_job(url, final["id"]) == final
    # The ids are the stored stream's: a later replay by job id shows the same events.
    assert _triples(read_stream(f"{url}/v1/jobs/{final['id']}/stream")) == _triples(stream)


def test_stop_string_stream_never_shows_the_stop_string(stack):
    url = stack["url"]
    base = submit(url, prompt="Hello there", max_tokens=12, temperature=0, ignore_eos=True)
    text = wait_job(url, base["id"])["text"]
    stop = text[5:8]   # part of a word: held back while it might start the stop string
    assert stop.strip() and text.find(stop) == 5, text
    stream = read_stream(url + "/v1/generate", method="POST",
                         json={"prompt": "Hello there", "max_tokens": 12, "temperature": 0,
                               "ignore_eos": True, "stop": stop, "stream": True})
    final = assert_well_formed(stream)
    assert final["finish_reason"] == "stop" and final["text"] == text[:5]
    assert all(stop not in t for t in stream.texts)


def test_non_ascii_deltas_concatenate_to_the_text(stack):
    url = stack["url"]
    # A random model with tied embeddings keeps repeating the prompt's last token: multi-byte
    # pieces ("é", "ön") for the first two; lone UTF-8 continuation bytes for the CJK prompt,
    # which the detokenizer holds back (they never complete a character) until the end.
    prompts = ["naïve café résumé", "Grüße aus Köln, schön", "日本語のテキスト"]
    jobs = submit(url, prompts=prompts, max_tokens=20, temperature=0, ignore_eos=True)["jobs"]
    non_ascii = checked = 0
    for job in jobs:
        wait_job(url, job["id"])
        stream = read_stream(f"{url}/v1/jobs/{job['id']}/stream")   # parsed as strict UTF-8
        final = assert_well_formed(stream)
        assert final == get_job(url, job["id"])
        assert "".join(stream.texts).encode("utf-8") == final["text"].encode("utf-8")
        if "\ufffd" not in final["text"]:
            # Nothing the model emitted is invalid UTF-8: no delta may show a cut character.
            assert not any("\ufffd" in t for t in stream.texts), stream.texts
            checked += 1
        non_ascii += sum(1 for ch in final["text"] if ord(ch) > 127 and ch != "\ufffd")
    assert non_ascii > 0, "the test needs multi-byte characters in the output"
    assert checked > 0, "every output had an invalid byte: no delta was checked for cut characters"


def test_pubsub_channel_carries_tokens_and_the_final_job(stack):
    url = stack["url"]
    client = redis.Redis.from_url(stack["redis"].url, decode_responses=True)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    job = submit(url, prompt="Hello there", max_tokens=200, temperature=0, ignore_eos=True)
    pubsub.subscribe(f"llmq:tokens:{job['id']}")
    messages = []
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            msg = pubsub.get_message(timeout=1.0)
            if msg is None:
                continue
            messages.append(json.loads(msg["data"]))
            if messages[-1].get("done"):
                break
    finally:
        pubsub.close()
    assert messages and messages[-1].get("done") is True, messages[-3:]
    stream = read_stream(f"{url}/v1/jobs/{job['id']}/stream")
    final = assert_well_formed(stream)
    assert messages[-1] == {"done": True, "job": final}
    assert final == get_job(url, job["id"])
    tokens = messages[:-1]
    assert all(set(m) == {"text"} for m in tokens), tokens[:3]
    texts = [m["text"] for m in tokens]
    # Subscribed after submitting: what arrived is a suffix of the stream, in order.
    assert texts == stream.texts[len(stream.texts) - len(texts):]
    assert len(texts) > 0
