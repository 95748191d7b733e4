"""Many models behind one endpoint (LLMQ_MODELS): two genuinely different tiny models, each
served by its own real worker on its own queue, one API routing by `model`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from reliability.factories import World, record
from support import build_tiny_model, wait_until

import openai  # noqa: E402 - required (requirements-dev.txt): never a skip

SECOND = "second"
ALIAS = "gpt-4o-mini"
SECOND_CONTEXT = 256   # the second worker's LLMQ_MAX_MODEL_LEN: /v1/models tells them apart
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir, default_model_dir):
    second_dir = build_tiny_model(tmp_path_factory.mktemp("second-model"), default_model_dir,
                                  seed=1)
    # The first entry a bare source (named after its folder, the default), the second named.
    models = f"{tiny_model_dir},{SECOND}={second_dir}"
    w = World(tmp_path_factory.mktemp("many-models"), tiny_model_dir)
    # (the CPU kernels are no part of routing: without them a worker starts at once, even on a
    # checkout whose kernels are not built yet)
    w.models_env = {"LLMQ_MODELS": models, "LLMQ_MODEL_ALIASES": f"{ALIAS}={SECOND}",
                    "LLMQ_DECODE_KERNEL": "0", "LLMQ_LAYER_KERNELS": "0"}
    w.first = Path(tiny_model_dir).name
    try:
        w.start_redis()
        workers = [w.worker("first", wait=False, **w.models_env),
                   w.worker(SECOND, wait=False, LLMQ_SERVE_MODEL=SECOND,
                            LLMQ_MAX_MODEL_LEN=str(SECOND_CONTEXT), **w.models_env)]
        for worker in workers:
            worker.wait_ready()
        w.api_client = w.api(models=tuple(models.split(",")),
                             model_aliases=(f"{ALIAS}={SECOND}",))
        yield w
    finally:
        w.close()


@pytest.fixture(scope="module")
def client(world):
    return openai.OpenAI(base_url=world.api_client.url + "/v1", api_key="unused",
                         max_retries=0, timeout=120)


def ran_on(world, seq_id: str) -> str:
    return record(world.client(), seq_id)["worker"]


def test_each_request_is_answered_by_its_own_model(world, client):
    first, second = "first@test", f"{SECOND}@test"
    logprobs = {}
    for name, worker in ((world.first, first), (SECOND, second), (ALIAS, second)):
        resp = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Say something."}],
            max_tokens=4, temperature=0, logprobs=True)
        assert ran_on(world, resp.id) == worker, name
        # The answer names the model that ran it (an alias resolved).
        assert resp.model == (world.first if worker == first else SECOND)
        logprobs[name] = [round(t.logprob, 3) for t in resp.choices[0].logprobs.content]
    # Two different models (random weights: their text is alike, their logprobs are not).
    assert logprobs[SECOND] == logprobs[ALIAS] != logprobs[world.first]
    # /v1/jobs: `model` routes; without it, the default.
    api = world.api_client
    named = api.submit(prompt="Hello", max_tokens=4, model=SECOND)
    default = api.submit(prompt="Hello", max_tokens=4)
    assert (named["model"], default["model"]) == (SECOND, world.first)
    for job, worker in ((named, second), (default, first)):
        assert api.wait_job(job["id"])["status"] == "succeeded"
        assert ran_on(world, job["id"]) == worker


def test_models_are_listed_and_an_unknown_one_is_not_found(world, client):
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {world.first, SECOND}
    assert listed[SECOND].max_model_len == SECOND_CONTEXT
    assert listed[world.first].max_model_len > SECOND_CONTEXT
    assert {m.owned_by for m in listed.values()} == {"llmq"}
    assert {m.backend for m in listed.values()} == {"transformers"}
    assert client.models.retrieve(ALIAS).id == SECOND
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert exc.value.code == "model_not_found"
    r = world.api_client.request("POST", "/v1/jobs", json={"prompt": "hi", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_context_is_checked_against_the_model_named(world, client):
    # Fits the first model's context, not the second's: refused before it queues.
    prompt = " ".join(["word"] * (SECOND_CONTEXT + 20))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SECOND, prompt=prompt, max_tokens=4)
    resp = client.completions.create(model=world.first, prompt=prompt, max_tokens=4)
    assert resp.usage.completion_tokens == 4


def test_prefix_caches_are_not_shared_between_models(world, client):
    messages = [{"role": "system", "content": "You answer briefly. " * 20},
                {"role": "user", "content": "Hello there."}]

    def cached(model: str) -> int:
        resp = client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                              temperature=0)
        return resp.usage.prompt_tokens_details.cached_tokens

    cached(world.first)
    assert cached(world.first) > 0          # the first model's cache holds the prompt
    assert cached(SECOND) == 0              # the second's does not: it never saw it
    assert cached(SECOND) > 0


def test_a_batch_mixes_models_line_by_line(world, client):
    lines = [{"custom_id": f"{model}-{i}", "method": "POST", "url": CHAT,
              "body": {"model": model, "messages": [{"role": "user", "content": f"Say {i}"}],
                       "max_tokens": 4, "temperature": 0}}
             for i in range(2) for model in (world.first, SECOND, ALIAS)]
    raw = "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = client.files.create(file=("mixed.jsonl", raw), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")

    def ended():
        b = client.batches.retrieve(batch.id)
        return b if b.status in ("completed", "failed", "expired", "cancelled") else None

    done = wait_until(ended, 180, "the mixed batch to end", interval=0.2)
    assert done.status == "completed" and done.request_counts.completed == len(lines)
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert len(out) == len(lines)
    for line in out:
        body = line["response"]["body"]
        wanted = world.first if line["custom_id"].startswith(world.first) else SECOND
        assert body["model"] == wanted, line
        assert ran_on(world, body["id"]) == ("first@test" if wanted == world.first
                                             else f"{SECOND}@test")


def test_a_model_without_a_worker_is_503_and_serves_again_when_it_returns(world, client):
    api = world.api_client
    second = next(w for w in world.workers if w.name == SECOND)
    second.stop()   # a warm shutdown: it leaves the registry

    def unlisted():
        return SECOND not in {m.id for m in client.models.list().data}

    wait_until(unlisted, 60, "the second model to leave /v1/models")
    r = api.request("POST", "/v1/chat/completions", json={
        "model": SECOND, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "model_not_ready" and int(r.headers["Retry-After"]) > 0
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=ALIAS, prompt="hi", max_tokens=2)
    # The other model serves on, untouched.
    resp = client.completions.create(model=world.first, prompt="hi", max_tokens=2)
    assert ran_on(world, resp.id) == "first@test"
    # Back: served at once (the API looks again when a model seems to have no worker).
    second.start()
    resp = client.completions.create(model=SECOND, prompt="hi", max_tokens=2)
    assert ran_on(world, resp.id) == f"{SECOND}@test"
