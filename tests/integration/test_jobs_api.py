"""The jobs API through the whole stack: HTTP -> Redis -> Celery worker -> model process."""
from __future__ import annotations

import json

import pytest
import redis
import requests


from support import ApiServer, wait_until
from llmq_client import assert_error, generate, get_job, submit, wait_job

pytestmark = pytest.mark.integration

GREEDY = {"temperature": 0, "ignore_eos": True}


def test_submit_then_poll_until_finished(stack):
    url = stack["url"]
    r = requests.post(url + "/v1/jobs", json={"prompt": "Hello there", "max_tokens": 12, **GREEDY},
                      timeout=60)
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] == "queued"
    assert r.headers["Location"] == f"/v1/jobs/{job['id']}"
    assert job["prompt"] == "Hello there" and job["messages"] is None
    assert job["text"] == "" and job["finish_reason"] is None and job["error"] is None
    assert job["usage"]["completion_tokens"] == 0
    assert isinstance(job["created_at"], float) and job["finished_at"] is None

    seen: list[str] = []
    final = wait_job(url, job["id"], seen=seen)
    # Statuses only move forward: queued -> running -> succeeded (polling may skip some).
    order = ["queued", "running", "succeeded"]
    assert seen == sorted(seen, key=order.index) and seen[-1] == "succeeded", seen
    assert final["id"] == job["id"] and final["prompt"] == "Hello there"
    assert final["finish_reason"] == "length" and final["error"] is None
    assert final["usage"]["completion_tokens"] == 12
    assert final["usage"]["prompt_tokens"] > 0
    assert final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + 12
    assert final["text"]
    assert final["created_at"] <= final["started_at"] <= final["finished_at"]
    # A finished job reads the same every time.
    assert get_job(url, job["id"]) == final


def test_batch_keeps_prompt_order_and_gives_distinct_ids(stack):
    url = stack["url"]
    prompts = ["Hello there", "The quick brown fox", "Ünïcödé ✓ café", "Hello there"]
    body = submit(url, prompts=prompts, max_tokens=10, **GREEDY)
    jobs = body["jobs"]
    assert [j["prompt"] for j in jobs] == prompts
    assert all(j["status"] == "queued" for j in jobs)
    assert len({j["id"] for j in jobs}) == len(prompts)
    finals = [wait_job(url, j["id"]) for j in jobs]
    assert [f["prompt"] for f in finals] == prompts
    assert all(f["status"] == "succeeded" and f["usage"]["completion_tokens"] == 10 for f in finals)
    # Greedy: the same prompt gives the same text within a batch, different prompts differ.
    assert finals[0]["text"] == finals[3]["text"]
    assert len({f["text"] for f in finals[:3]}) == 3, [f["text"] for f in finals]


def test_messages_go_through_the_chat_template(stack):
    url = stack["url"]
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hello there"}]
    job = submit(url, messages=messages, max_tokens=6, **GREEDY)
    assert job["messages"] == messages and job["prompt"] is None
    plain = submit(url, prompt="Hello there", max_tokens=6, **GREEDY)
    chat, plain = wait_job(url, job["id"]), wait_job(url, plain["id"])
    assert chat["status"] == "succeeded" and chat["messages"] == messages
    assert chat["usage"]["completion_tokens"] == 6
    # The template wraps the contents in role markers: many more prompt tokens than the text.
    assert chat["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 10


def test_max_tokens_ends_with_length(stack):
    url = stack["url"]
    jobs = [submit(url, prompt="Once upon a time", max_tokens=n, **GREEDY) for n in (1, 17)]
    for n, job in zip((1, 17), jobs):
        final = wait_job(url, job["id"])
        assert final["status"] == "succeeded"
        assert final["finish_reason"] == "length"
        assert final["usage"]["completion_tokens"] == n


def _stop_string_in(text: str) -> tuple[str, int]:
    """A substring that first appears past the start and well before the end of `text`."""
    for start in range(1, len(text) * 2 // 3):
        for size in (4, 3, 2):
            s = text[start:start + size]
            if len(s) == size and s.strip() and text.find(s) == start:
                return s, start
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_string_cuts_the_text_and_ends_with_stop(stack):
    url = stack["url"]
    prompt = "Ünïcödé ✓ café"
    full = generate(url, prompt=prompt, max_tokens=30, **GREEDY)
    assert full["finish_reason"] == "length"
    stop, at = _stop_string_in(full["text"])

    job = generate(url, prompt=prompt, max_tokens=30, stop=["never appears", stop], **GREEDY)
    assert job["status"] == "succeeded"
    assert job["finish_reason"] == "stop"
    assert stop not in job["text"]
    assert job["text"] == full["text"][:at]
    assert job["usage"]["completion_tokens"] < 30

    # A single string works like a one-element list.
    single = generate(url, prompt=prompt, max_tokens=30, stop=stop, **GREEDY)
    assert (single["text"], single["finish_reason"]) == (job["text"], "stop")


def test_seed_reproduces_sampling_through_the_stack(stack):
    url = stack["url"]
    common = {"max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    batch = submit(url, prompts=["Hello", "Hello"], seed=1234, **common)["jobs"]
    alone = submit(url, prompt="Hello", seed=1234, **common)
    other = submit(url, prompt="Hello", seed=4321, **common)
    unseeded = [submit(url, prompt="Hello", **common) for _ in range(2)]
    texts = [wait_job(url, j["id"])["text"] for j in batch + [alone, other] + unseeded]
    same_seed, other_seed, free = texts[:3], texts[3], texts[4:]
    if stack["backend"] == "llama_cpp":
        # One KV pool shared by every sequence: attention rounds by where a sequence's cells
        # lie, so a seed repeats in the same company (docs/api.md, `seed`): alone, again.
        alone_twice = [wait_job(url, submit(url, prompt="Hello", seed=1234, **common)["id"])
                       ["text"] for _ in range(2)]
        assert alone_twice[0] == alone_twice[1], alone_twice
    else:
        # The same seed gives the same tokens, in a batch or alone, whatever shares the step.
        assert same_seed[0] == same_seed[1] == same_seed[2], same_seed
    assert other_seed != same_seed[2]
    # Without a seed every sequence draws its own randomness.
    assert free[0] != free[1]


def _worker_info(stack) -> dict:
    client = redis.Redis.from_url(stack["redis"].url, decode_responses=True)
    return client.hgetall(f"llmq:worker:{stack['worker'].hostname}")


def test_sequential_jobs_do_not_restart_the_model_process(stack):
    url = stack["url"]

    def idle_after(num_finished: int):
        info = _worker_info(stack)
        done = int(info.get("num_finished", 0)) >= num_finished and info.get("running") == "0"
        return info if done else None

    generate(url, prompt="Hello there", max_tokens=3, temperature=0)
    first = wait_until(lambda: idle_after(0), 30, "a heartbeat after the first job")
    # The batch is empty again; a new job starts a new batch on the same model process.
    job = generate(url, prompt="Hello there", max_tokens=3, temperature=0)
    assert job["status"] == "succeeded"
    second = wait_until(lambda: idle_after(int(first["num_finished"]) + 1), 30,
                        "a heartbeat after the second job")
    assert second["model_starts"] == first["model_starts"], (first, second)


def test_greedy_is_deterministic(stack):
    url = stack["url"]
    a = submit(url, prompt="The meaning of life is", max_tokens=16, temperature=0)
    b = submit(url, prompt="The meaning of life is", max_tokens=16, temperature=0)
    c = generate(url, prompt="The meaning of life is", max_tokens=16, temperature=0)
    a, b = wait_job(url, a["id"]), wait_job(url, b["id"])
    assert a["text"] == b["text"] == c["text"]
    assert a["usage"] == b["usage"] == c["usage"]


def test_generate_waits_for_the_final_job(stack):
    url = stack["url"]
    job = generate(url, prompt="Hello there", max_tokens=9, **GREEDY)
    assert job["status"] == "succeeded" and job["finish_reason"] == "length"
    assert job["usage"]["completion_tokens"] == 9 and job["finished_at"] is not None
    assert get_job(url, job["id"]) == job


def test_generate_batch_returns_results_in_prompt_order(stack):
    url = stack["url"]
    prompts = ["The quick brown fox", "Hello there", "Ünïcödé ✓ café"]
    singles = [submit(url, prompt=p, max_tokens=8, **GREEDY) for p in prompts]
    body = generate(url, prompts=prompts, max_tokens=8, **GREEDY)
    results = body["results"]
    assert [r["prompt"] for r in results] == prompts
    assert all(r["status"] == "succeeded" for r in results)
    assert len({r["id"] for r in results}) == 3
    # Each result holds its own prompt's text: the same as the prompt generated alone.
    assert [r["text"] for r in results] == [wait_job(url, s["id"])["text"] for s in singles]
    for r in results:
        assert get_job(url, r["id"]) == r


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/jobs/seq-does-not-exist"),
    ("DELETE", "/v1/jobs/seq-does-not-exist"),
    ("GET", "/v1/jobs/seq-does-not-exist/stream"),
])
def test_unknown_job_is_404(stack, method, path):
    r = requests.request(method, stack["url"] + path, timeout=30)
    err = assert_error(r, 404)
    assert err["type"] == "not_found_error"


def _seq_keys(stack) -> int:
    client = redis.Redis.from_url(stack["redis"].url)
    return sum(1 for _ in client.scan_iter("llmq:seq:*"))


BAD_BODIES = {
    "malformed json": b'{"prompt": "hi",',
    "not an object": json.dumps(["hi"]).encode(),
    "no input": json.dumps({"max_tokens": 5}).encode(),
    "two inputs": json.dumps({"prompt": "hi", "prompts": ["hi"]}).encode(),
    "empty prompt": json.dumps({"prompt": ""}).encode(),
    "blank prompt": json.dumps({"prompt": "   "}).encode(),
    "prompt not a string": json.dumps({"prompt": 42}).encode(),
    "empty prompts": json.dumps({"prompts": []}).encode(),
    "empty prompt in batch": json.dumps({"prompts": ["ok", ""]}).encode(),
    "too many prompts": json.dumps({"prompts": ["hi"] * 65}).encode(),
    "empty messages": json.dumps({"messages": []}).encode(),
    "bad role": json.dumps({"messages": [{"role": "robot", "content": "hi"}]}).encode(),
    "max_tokens -1": json.dumps({"prompt": "hi", "max_tokens": -1}).encode(),
    "max_tokens 0": json.dumps({"prompt": "hi", "max_tokens": 0}).encode(),
    "max_tokens 10**9": json.dumps({"prompt": "hi", "max_tokens": 10**9}).encode(),
    "max_tokens fractional": json.dumps({"prompt": "hi", "max_tokens": 2.5}).encode(),
    "temperature 5": json.dumps({"prompt": "hi", "temperature": 5}).encode(),
    "temperature NaN": b'{"prompt": "hi", "temperature": NaN}',
    "temperature string": json.dumps({"prompt": "hi", "temperature": "hot"}).encode(),
    "top_p 0": json.dumps({"prompt": "hi", "top_p": 0}).encode(),
    "seed too big": json.dumps({"prompt": "hi", "seed": 2**64}).encode(),
    "empty stop": json.dumps({"prompt": "hi", "stop": [""]}).encode(),
    "too many stops": json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}).encode(),
    "min_tokens above max_tokens": json.dumps({"prompt": "hi", "max_tokens": 2,
                                               "min_tokens": 3}).encode(),
    "unknown parameter": json.dumps({"prompt": "hi", "frobnicate": True}).encode(),
    "prompt too long": json.dumps({"prompt": "x" * 100_001}).encode(),
    "stream with prompts": json.dumps({"prompts": ["a"], "stream": True}).encode(),
}


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/generate"])
@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_input_is_a_4xx_json_error(stack, path, case):
    before = _seq_keys(stack)
    r = requests.post(stack["url"] + path, data=BAD_BODIES[case],
                      headers={"Content-Type": "application/json"}, timeout=30)
    err = assert_error(r, 400)
    assert err["type"] == "invalid_request_error"
    assert _seq_keys(stack) == before, "a rejected request must not create a sequence"


def test_oversized_body_is_413_json(stack):
    r = requests.post(stack["url"] + "/v1/jobs", data=b'{"prompt": "' + b"x" * (3 << 20) + b'"}',
                      headers={"Content-Type": "application/json"}, timeout=30)
    assert_error(r, 413)


def test_unknown_route_and_wrong_method_are_json(stack):
    assert_error(requests.get(stack["url"] + "/v1/nothing-here", timeout=30), 404)
    assert_error(requests.put(stack["url"] + "/v1/jobs", json={"prompt": "x"}, timeout=30), 405)


def test_health_and_readiness(stack):
    r = requests.get(stack["url"] + "/healthz", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = requests.get(stack["url"] + "/readyz", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ready"
    assert stack["worker"].hostname in [w["name"] for w in body["workers"]]
    # The worker says what it built around the model: its KV cache's dtype and its kernels.
    me = next(w for w in body["workers"] if w["name"] == stack["worker"].hostname)
    if stack["backend"] == "transformers":
        # auto: float16 under a float32 model where the C++ kernel attends, else the model's
        widened = me["dtype"] == "float32" and "decode attention: C++ kernel" in me["kernels"]
        assert me["kv_cache_dtype"] == ("float16" if widened else me["dtype"]), me
    else:
        assert me["kv_cache_dtype"] == {"llama_cpp": "float16", "vllm": me["dtype"]}[
            stack["backend"]], me
        assert me["kernels"].lower().startswith(stack["backend"].split("_")[0]), me


def test_readiness_is_503_without_a_worker(redis_server):
    from common.settings import Settings

    # Same Redis server, another database: no worker has ever beaten there.
    url = redis_server.url.rsplit("/", 1)[0] + "/3"
    api = ApiServer(Settings.from_env(redis_url=url, model="none")).start()
    try:
        r = requests.get(api.url + "/readyz", timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["status"] == "unavailable"
        assert requests.get(api.url + "/healthz", timeout=30).status_code == 200
    finally:
        api.stop()
