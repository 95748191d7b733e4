"""OpenAI's Responses API through the official `openai` SDK against the real stack: background
create, retrieve, cancel, the stored event stream resumed by sequence_number, a conversation
continued by previous_response_id, text.format json_schema (the SDK's parse() and stream
helper), streamed and waited-for text alike; Idempotency-Key on the creating routes (also
concurrently); queue figures on a finished job; /tokenize and /detokenize."""
from __future__ import annotations

import threading
import uuid
from typing import Literal

import pytest
import requests
from pydantic import BaseModel, Field

from support import wait_until

import openai  # noqa: E402 - required (requirements-dev.txt): never a skip

pytestmark = pytest.mark.integration

ASK = "Tell me about foxes."
GREEDY = dict(temperature=0, max_output_tokens=8)


class Pet(BaseModel):
    """Bounded, so that a random model's constrained text ends well within its tokens."""
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=20)


def finished(client, resp_id: str, timeout_s: float = 60):
    def done():
        r = client.responses.retrieve(resp_id)
        return r if r.status not in ("queued", "in_progress") else None
    return wait_until(done, timeout_s, "the response to finish")


def dicts(events) -> list[dict]:
    return [e.to_dict() for e in events]


def test_background_create_is_queued_then_retrieve_reaches_its_end(client, model, stack):
    r = client.responses.create(model=model, input=ASK, background=True, **GREEDY)
    assert r.status == "queued" and r.background and r.id.startswith("resp_")
    done = finished(client, r.id)
    assert done.status in ("completed", "incomplete")   # (a random model: eos or length)
    if done.status == "incomplete":
        assert done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text and done.output[0].content[0].text == done.output_text
    assert done.usage.output_tokens > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    # the sequence underneath, with how it went
    job = requests.get(f"{stack['url']}/v1/jobs/seq-{r.id.removeprefix('resp_')}",
                       timeout=10).json()
    assert job["text"] == done.output_text
    m = job["metrics"]
    assert m["attempts"] == 1 and m["queue_s"] >= 0 and m["ttft_s"] >= m["queue_s"]
    assert m["tokens_per_s"] > 0


def test_cancel_ends_a_long_response_cancelled(client, model):
    r = client.responses.create(model=model, input=ASK, background=True,
                                max_output_tokens=400, temperature=0)
    wait_until(lambda: client.responses.retrieve(r.id).status == "in_progress", 30,
               "the response to start")
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.retrieve(r.id).usage.output_tokens < 400


def test_a_stream_resumed_after_n_replays_exactly_the_events_after_n(client, model):
    r = client.responses.create(model=model, input=ASK, background=True,
                                max_output_tokens=200, temperature=0)
    live = client.responses.retrieve(r.id, stream=True)
    seen = []
    for event in live:
        seen.append(event.to_dict())
        if len(seen) == 6:
            break
    live.close()   # the client goes away mid-run; a background response runs on
    rest = dicts(client.responses.retrieve(r.id, stream=True, starting_after=5))
    full = dicts(client.responses.retrieve(r.id, stream=True))
    assert seen + rest == full
    assert [e["sequence_number"] for e in full] == list(range(len(full)))
    assert [e["type"] for e in full[:4]] == ["response.created", "response.in_progress",
                                             "response.output_item.added",
                                             "response.content_part.added"]
    assert full[-1]["type"] in ("response.completed", "response.incomplete")
    text = "".join(e["delta"] for e in full if e["type"] == "response.output_text.delta")
    assert text == client.responses.retrieve(r.id).output_text
    for n in (0, len(full) // 2, len(full) - 2, len(full) - 1):
        assert dicts(client.responses.retrieve(r.id, stream=True, starting_after=n)) \
            == full[n + 1:]


def test_streamed_text_equals_the_waited_for_text(client, model):
    kw = dict(model=model, input=ASK, temperature=0, max_output_tokens=12)
    plain = client.responses.create(**kw)
    assert plain.status in ("completed", "incomplete") and not plain.background
    events = list(client.responses.create(**kw, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    assert events[-1].response.status == plain.status


def test_previous_response_id_continues_the_conversation(client, model, stack):
    first = client.responses.create(model=model, input="My name is Ada.", **GREEDY)
    second = client.responses.create(model=model, input="What is my name?",
                                     previous_response_id=first.id, **GREEDY)
    assert second.previous_response_id == first.id and second.output_text
    job = requests.get(f"{stack['url']}/v1/jobs/seq-{second.id.removeprefix('resp_')}",
                       timeout=10).json()
    assert job["messages"] == [{"role": "user", "content": "My name is Ada."},
                               {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens > first.usage.input_tokens
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["What is my name?"]


def test_json_schema_text_format_parses_and_the_stream_helper_works(client, model):
    kw = dict(model=model, input="Describe a pet as JSON.", text_format=Pet,
              max_output_tokens=64, temperature=0)
    parsed = client.responses.parse(**kw)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Pet)
    with client.responses.stream(**kw) as stream:
        for _event in stream:
            pass
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed


def test_the_same_idempotency_key_answers_the_first_response(client, model):
    key = {"Idempotency-Key": uuid.uuid4().hex}
    a = client.responses.create(model=model, input=ASK, background=True, **GREEDY,
                                extra_headers=key)
    b = client.responses.create(model=model, input=ASK, background=True, **GREEDY,
                                extra_headers=key)
    assert b.id == a.id and b.status == "queued"
    with pytest.raises(openai.UnprocessableEntityError):
        client.responses.create(model=model, input="another", background=True, **GREEDY,
                                extra_headers=key)


def test_concurrent_posts_with_one_key_run_once(stack):
    url, prompt, key = stack["url"], f"idempotent {uuid.uuid4().hex}", uuid.uuid4().hex
    answers, barrier = [], threading.Barrier(8)

    def post():
        barrier.wait()
        answers.append(requests.post(f"{url}/v1/jobs", json={"prompt": prompt, "max_tokens": 2},
                                     headers={"Idempotency-Key": key}, timeout=30))

    threads = [threading.Thread(target=post) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {a.status_code for a in answers} <= {202, 409}
    ids = {a.json()["id"] for a in answers if a.status_code == 202}
    assert len(ids) == 1
    retry = requests.post(f"{url}/v1/jobs", json={"prompt": prompt, "max_tokens": 2},
                          headers={"Idempotency-Key": key}, timeout=30)
    assert retry.status_code == 202 and retry.json()["id"] in ids
    jobs = requests.get(f"{url}/v1/jobs", params={"limit": 100}, timeout=10).json()["data"]
    assert sum(j["prompt"] == prompt for j in jobs) == 1


def test_tokenize_counts_as_the_worker_does(client, model, stack):
    url, prompt = stack["url"], "The quick brown fox"
    done = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    t = requests.post(f"{url}/tokenize", json={"prompt": prompt}, timeout=10).json()
    assert t["count"] == len(t["tokens"]) == done.usage.prompt_tokens
    assert t["max_model_len"] > t["count"]
    back = requests.post(f"{url}/detokenize", json={"tokens": t["tokens"]}, timeout=10).json()
    assert back["prompt"].endswith(prompt)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user",
                                                                  "content": ASK}], max_tokens=1)
    t = requests.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": ASK}]},
                      timeout=10).json()
    assert t["count"] == chat.usage.prompt_tokens
