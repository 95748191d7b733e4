"""Files, batches, job listing and webhooks, driven through the official `openai` SDK (files and
batches) against the real HTTP app, a real redis-server and a real Celery worker on the tiny
model, with a webhook receiver on loopback that checks every signature.

One world (redis-server, worker, APIs) serves the whole module. At most INFLIGHT batch lines
are queued or running at once, so a batch of more lines has lines waiting (to cancel, to
expire); the worker has SLOTS task threads, one of which a batch's driver holds, so while a
batch runs one of its lines waits in the broker (to be overtaken by an interactive request).
"""
from __future__ import annotations

import json

import pytest
import requests

from common.batch_store import line_seq_id
from reliability.factories import World
from support import wait_until
from webhook_receiver import WebhookReceiver, new_secret

import openai  # noqa: E402 - required (requirements-dev.txt): never a skip

pytestmark = pytest.mark.integration

KEYS = ("key-one", "key-two")
INFLIGHT = 4
SLOTS = 4
SECRET = new_secret()
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    w = World(tmp_path_factory.mktemp("batches"), tiny_model_dir)
    try:
        w.start_redis()
        # A step floor: a long line (400 tokens) outlasts a 3 s completion window on any
        # machine (the expiry test relied on this one's being slow enough).
        w.worker("w1", min_step_s=0.01, LLMQ_WEBHOOK_SECRET=SECRET, LLMQ_WEBHOOK_ALLOWED_HOSTS="127.0.0.1",
                 LLMQ_BATCH_MAX_INFLIGHT=str(INFLIGHT), LLMQ_MAX_NUM_SEQS=str(SLOTS))
        w.delivery_worker("d1", LLMQ_WEBHOOK_SECRET=SECRET,
                          LLMQ_WEBHOOK_ALLOWED_HOSTS="127.0.0.1")
        yield w
    finally:
        w.close()


@pytest.fixture(scope="module")
def api(world):
    return world.api(api_keys=KEYS, webhook_secret=SECRET, webhook_allowed_hosts=("127.0.0.1",))


@pytest.fixture(scope="module")
def model(api) -> str:
    return api.with_key(KEYS[0]).request("GET", "/v1/models").json()["data"][0]["id"]


def sdk(api, key: str = KEYS[0]):
    return openai.OpenAI(base_url=api.url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture
def receiver(api):
    """Checks every signature with KEYS[0]'s own webhook secret (GET /v1/webhooks/secret)."""
    secret = api.with_key(KEYS[0]).request("GET", "/v1/webhooks/secret").json()["secret"]
    assert secret != SECRET
    r = WebhookReceiver(secret)
    yield r
    r.stop()


def jsonl(lines) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def chat_line(custom_id: str, content: str, model: str, max_tokens: int = 8, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": model, "messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, "temperature": 0, **extra}}


def wait_batch(client, batch_id: str, timeout_s: float = 180.0):
    def ended():
        b = client.batches.retrieve(batch_id)
        return b if b.status in ("completed", "failed", "expired", "cancelled") else None
    return wait_until(ended, timeout_s, f"batch {batch_id} to end", interval=0.2)


def lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def assert_each_once(custom_ids: list[str], out: list[dict], err: list[dict]) -> None:
    got = [x["custom_id"] for x in out + err]
    assert sorted(got) == sorted(custom_ids)   # every line once, in one file or the other


# --- files ------------------------------------------------------------------------------------
def test_files_upload_list_retrieve_content_delete_through_the_sdk(api):
    client, other = sdk(api), sdk(api, KEYS[1])
    content = jsonl([{"custom_id": "a", "method": "POST", "url": CHAT, "body": {}}])
    f = client.files.create(file=("in.jsonl", content), purpose="batch")
    assert (f.object, f.purpose, f.bytes, f.filename) == ("file", "batch", len(content),
                                                          "in.jsonl")
    assert client.files.retrieve(f.id).id == f.id
    assert f.id in [x.id for x in client.files.list()]
    assert client.files.content(f.id).content == content
    # Another key: the file does not exist.
    assert f.id not in [x.id for x in other.files.list()]
    for call in (other.files.retrieve, other.files.content, other.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_file_over_the_size_cap_is_413_and_over_the_line_cap_is_400(world):
    small = world.api(file_max_bytes=200, file_max_lines=2)
    client = openai.OpenAI(base_url=small.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as big:
        client.files.create(file=("big.jsonl", b"{}\n" * 100), purpose="batch")
    assert big.value.status_code == 413
    assert "LLMQ_FILE_MAX_BYTES" in big.value.response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as many:
        client.files.create(file=("many.jsonl", b"{}\n{}\n{}\n"), purpose="batch")
    assert "LLMQ_FILE_MAX_LINES" in many.value.response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")


# --- batches ----------------------------------------------------------------------------------
def test_batch_runs_through_the_sdk_with_a_malformed_line_and_signed_webhooks(
        world, api, model, receiver):
    client = sdk(api)
    prompts = {f"req-{i}": f"Say something about the number {i}." for i in range(6)}
    lines = [chat_line(cid, p, model) for cid, p in prompts.items()]
    raw = jsonl(lines) + b"this is not json\n" + jsonl(
        [{**chat_line("wrong-url", "x", model), "url": "/v1/completions"},
         chat_line("bad-param", "x", model, use_beam_search=True)])
    f = client.files.create(file=("batch.jsonl", raw), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h",
                                  metadata={"run": "test"},
                                  extra_body={"webhook": receiver.url + "/hooks",
                                              "webhook_events": ["started", "completed"]})
    assert batch.status == "validating" and batch.request_counts.total == 9
    done = wait_batch(client, batch.id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 3)
    assert done.metadata == {"run": "test"}
    out, err = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(prompts)
    assert sorted(str(x["custom_id"]) for x in err) == ["None", "bad-param", "wrong-url"]
    assert all(x["response"] is None and x["error"]["code"] for x in err)
    # OpenAI's `errors`: each malformed line's code, message and line number in the file.
    assert done.errors.object == "list"
    assert [(e.line, e.code, e.param) for e in done.errors.data] == [
        (7, "invalid_request", None), (8, "invalid_request", "url"),
        (9, "unsupported_parameter", "use_beam_search")]
    # `usage` sums the lines' tokens.
    bodies = [x["response"]["body"]["usage"] for x in out]
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in bodies) > 0
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in bodies) > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens

    # Each output line is what the interactive route answers for the same request (greedy).
    for line in out:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["id"].startswith("batch_req_")
        body = line["response"]["body"]
        assert body["object"] == "chat.completion"
        assert line["response"]["request_id"] == body["id"]
        alone = client.chat.completions.create(
            model=model, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": prompts[line["custom_id"]]}])
        assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content

    # Webhooks: started, then completed with the final batch, each signed.
    wait_until(lambda: receiver.of_type("batch.completed"), 30, "the batch.completed webhook")
    started, completed = receiver.of_type("batch.started"), receiver.of_type("batch.completed")
    assert len(started) == 1 and len(completed) == 1
    assert all(d.signature_ok and d.path == "/hooks" for d in started + completed)
    assert started[0].webhook_id != completed[0].webhook_id
    assert completed[0].body["data"]["id"] == batch.id
    assert completed[0].body["data"]["output_file_id"] == done.output_file_id
    assert completed[0].body["data"]["request_counts"] == {"total": 9, "completed": 6,
                                                           "failed": 3}
    # ... and in OpenAI's event shape: the SDK verifies and parses it.
    secret = api.with_key(KEYS[0]).request("GET", "/v1/webhooks/secret").json()["secret"]
    event = client.webhooks.unwrap(completed[0].raw, completed[0].headers, secret=secret)
    assert (event.type, event.data.id, event.object) == ("batch.completed", batch.id, "event")
    assert event.id == "evt_" + completed[0].webhook_id.removeprefix("msg_")

    # Celery (and so Flower) names them: the driver, each line, each delivery (the last on the
    # delivery worker, never on a generation one).
    log = world.workers[0].log_path.read_text()
    assert "Task llmq.batch[" in log
    assert f"Task llmq.batch_line[{out[0]['response']['request_id']}] received" in log
    assert "Task llmq.webhook[" not in log
    deliveries = world.workers[1].log_path.read_text()
    assert f"Task llmq.webhook[{completed[0].webhook_id}] received" in deliveries


def test_a_batch_whose_every_line_is_malformed_fails_with_its_errors(api, model):
    client = sdk(api)
    raw = b"not json\n" + jsonl([chat_line("x", "hi", model, top_k="two")])
    f = client.files.create(file=("bad.jsonl", raw), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    done = wait_batch(client, batch.id, 60)
    assert done.status == "failed" and done.failed_at
    assert [e.line for e in done.errors.data] == [1, 2]
    assert all(e.code and e.message for e in done.errors.data)
    assert done.output_file_id is None
    err = lines_of(client, done.error_file_id)
    assert [x["custom_id"] for x in err] == [None, "x"]
    assert err[0]["error"]["message"].startswith("line 1: ")
    assert (done.request_counts.total, done.request_counts.failed) == (2, 2)


def test_batch_lines_answer_logprobs_and_are_jobs_only_their_owner_reads(api, model):
    client, one, two = sdk(api), api.with_key(KEYS[0]), api.with_key(KEYS[1])
    f = client.files.create(file=("lp.jsonl", jsonl(
        [chat_line("lp", "Say hi.", model, max_tokens=3, logprobs=True, top_logprobs=2)])),
        purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    done = wait_batch(client, batch.id)
    [line] = lines_of(client, done.output_file_id)
    content = line["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == line["response"]["body"]["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    # The line's job (response.request_id) is its owner's to read, and nobody else's; it is
    # not in GET /v1/jobs (docs/batches.md says why).
    seq_id = line["response"]["request_id"]
    assert one.request("GET", f"/v1/jobs/{seq_id}").json()["status"] == "succeeded"
    assert two.request("GET", f"/v1/jobs/{seq_id}").status_code == 404
    for key in (one, two):
        listed = key.request("GET", "/v1/jobs", params={"limit": 100}).json()["data"]
        assert seq_id not in [j["id"] for j in listed]


def test_batch_of_completions_and_its_listing(api, model):
    client = sdk(api)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": f"Once upon a time {i}", "max_tokens": 4}}
             for i in range(3)]
    f = client.files.create(file=("c.jsonl", jsonl(lines)), purpose="batch")
    first = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                  completion_window="24h")
    second = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                   completion_window="24h")
    for b in (first, second):
        done = wait_batch(client, b.id)
        out = lines_of(client, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == ["c0", "c1", "c2"]
        assert all(x["response"]["body"]["object"] == "text_completion" for x in out)
        assert done.error_file_id is None
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more
    assert client.batches.list(limit=1, after=second.id).data[0].id == first.id
    assert first.id not in [b.id for b in sdk(api, KEYS[1]).batches.list()]


def long_batch(client, model, prefix: str, window: str = "24h"):
    """A batch of 4 x INFLIGHT lines of 400 tokens each: most of it waits at any time."""
    ids = [f"{prefix}-{i}" for i in range(4 * INFLIGHT)]
    f = client.files.create(file=(f"{prefix}.jsonl", jsonl(
        [chat_line(c, "Tell a long story.", model, max_tokens=400, ignore_eos=True)
         for c in ids])), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=CHAT,
                                 completion_window=window), ids


def test_cancel_ends_queued_lines_and_cancels_running_ones(api, model):
    client = sdk(api)
    batch, ids = long_batch(client, model, "long")
    one = api.with_key(KEYS[0])
    first_line = line_seq_id(batch.id, 0)
    wait_until(lambda: one.request("GET", f"/v1/jobs/{first_line}").json().get("status")
               == "running", 60, "the batch's first line to run")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_batch(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    out, err = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert_each_once(ids, out, err)
    assert len(err) >= 3 * INFLIGHT   # at most the first INFLIGHT lines could have finished
    assert {x["error"]["code"] for x in err} == {"batch_cancelled"}
    assert done.request_counts.completed + done.request_counts.failed == len(ids)
    # The line that was running was stopped, not left to finish its 400 tokens.
    job = one.wait_job(first_line)
    assert job["status"] == "cancelled" and job["usage"]["completion_tokens"] < 400


def test_an_interactive_request_overtakes_the_batch_lines_waiting_for_a_slot(api, model):
    client, one = sdk(api), api.with_key(KEYS[0])
    batch, ids = long_batch(client, model, "prio")
    lines = [line_seq_id(batch.id, i) for i in range(len(ids))]

    def waiting_behind_a_full_worker():
        jobs = [one.request("GET", f"/v1/jobs/{s}").json() for s in lines[:INFLIGHT]]
        running = [j for j in jobs if j.get("status") == "running"]
        queued = [j["id"] for j in jobs if j.get("status") == "queued"]
        return queued if len(running) == SLOTS - 1 and queued else None

    waiting = wait_until(waiting_behind_a_full_worker, 60, "batch lines waiting for a slot")
    job = one.submit(prompt="Interactive", max_tokens=2)
    overtaken = [s for s in waiting if one.job(s)["status"] == "queued"]
    assert overtaken, "the waiting lines started before the interactive request was queued"
    started = one.wait_job(job["id"])["started_at"]
    for seq_id in overtaken:
        line = one.job(seq_id)
        assert line["started_at"] is None or line["started_at"] > started
    client.batches.cancel(batch.id)
    wait_batch(client, batch.id)


def test_completion_window_expires_the_batch_keeping_what_finished(api, model):
    client = sdk(api)
    batch, ids = long_batch(client, model, "w", window="3s")
    done = wait_batch(client, batch.id, 60)
    assert done.status == "expired" and done.expired_at
    out, err = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert_each_once(ids, out, err)
    assert err and {x["error"]["code"] for x in err} == {"batch_expired"}
    assert all(x["response"]["status_code"] == 200 for x in out)


def test_another_keys_batch_runs_beside_one_keys_two_long_batches(api, model):
    """Key one's two long batches hold both of the worker's batch driver slots and every line
    in flight; key two's small batch still gets a driver (one of key one's gives way) and its
    share of the lines, and ends while key one's batches run on."""
    client, other = sdk(api), sdk(api, KEYS[1])
    hogs = [long_batch(client, model, f"hog{i}")[0] for i in range(2)]
    wait_until(lambda: all(client.batches.retrieve(b.id).status == "in_progress" for b in hogs),
               60, "both long batches to be driven")
    f = other.files.create(file=("small.jsonl", jsonl([chat_line("s", "Hi", model, 2)])),
                           purpose="batch")
    small = other.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    done = wait_batch(other, small.id, 120)
    assert done.status == "completed" and done.request_counts.completed == 1
    assert [client.batches.retrieve(b.id).status for b in hogs] == ["in_progress"] * 2
    for b in hogs:
        client.batches.cancel(b.id)
    for b in hogs:
        assert wait_batch(client, b.id).status == "cancelled"


def test_another_key_gets_404_for_batches(api, model):
    client, other = sdk(api), sdk(api, KEYS[1])
    f = client.files.create(file=("o.jsonl", jsonl([chat_line("o", "hi", model)])),
                            purpose="batch")
    with pytest.raises(openai.NotFoundError):   # not your input file
        other.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    for call in (other.batches.retrieve, other.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call(batch.id)
    done = wait_batch(client, batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)


def test_bad_batch_requests_are_400(api, model):
    client = sdk(api)
    f = client.files.create(file=("b.jsonl", jsonl([chat_line("b", "hi", model)])),
                            purpose="batch")
    for kw in ({"endpoint": "/v1/embeddings"}, {"completion_window": "forever"},
               {"extra_body": {"webhook": "http://10.0.0.1/hook"}}):
        args = {"input_file_id": f.id, "endpoint": CHAT, "completion_window": "24h", **kw}
        with pytest.raises(openai.BadRequestError):
            client.batches.create(**args)


# --- jobs: listing and webhooks -----------------------------------------------------------------
def test_jobs_list_newest_first_paginated_filtered_and_per_key(api):
    one, two = api.with_key(KEYS[0]), api.with_key(KEYS[1])
    mine = [one.submit(prompt=f"list me {i}", max_tokens=2)["id"] for i in range(5)]
    theirs = two.submit(prompt="not yours", max_tokens=2)["id"]
    for seq_id in mine:
        one.wait_job(seq_id)
    seen, after = [], None
    while True:
        page = one.request("GET", "/v1/jobs", params={"limit": 2, **(
            {"after": after} if after else {})}).json()
        seen += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen[:5] == mine[::-1]                 # newest first
    assert theirs not in seen
    assert [j["id"] for j in two.request("GET", "/v1/jobs").json()["data"]] == [theirs]
    done = one.request("GET", "/v1/jobs", params={"status": "succeeded", "limit": 100}).json()
    assert set(mine) <= {j["id"] for j in done["data"]}
    assert all(j["status"] == "succeeded" for j in done["data"])
    assert one.request("GET", "/v1/jobs", params={"status": "nope"}).status_code == 400
    assert one.request("GET", "/v1/jobs", params={"after": theirs}).status_code == 400


def test_job_webhooks_are_signed_retried_and_keep_their_id(api, receiver):
    receiver.fail_first = 1   # every event's first attempt fails: it comes again
    one = api.with_key(KEYS[0])
    job = one.submit(prompt="Hook me", max_tokens=4, webhook=receiver.url + "/job",
                     webhook_events=["started", "completed"])
    wait_until(lambda: len(receiver.of_type("job.completed")) == 2, 60,
               "job.completed delivered twice (a failure, then the retry)")
    wait_until(lambda: len(receiver.of_type("job.started")) == 2, 30, "job.started twice")
    for kind in ("job.started", "job.completed"):
        first, again = receiver.of_type(kind)
        assert first.signature_ok and again.signature_ok
        assert first.webhook_id == again.webhook_id            # stable per event
        assert first.body["data"]["id"] == job["id"]
    assert receiver.of_type("job.completed")[0].body["data"]["status"] == "succeeded"


def test_a_responses_webhook_is_openais_event_and_the_sdk_unwraps_it(api, model, receiver):
    client = sdk(api)
    secret = api.with_key(KEYS[0]).request("GET", "/v1/webhooks/secret").json()["secret"]
    r = client.responses.create(model=model, input="Hook me", background=True,
                                max_output_tokens=4, temperature=0,
                                extra_body={"webhook": receiver.url + "/responses"})
    done = wait_until(lambda: receiver.of_type("response.incomplete")
                      or receiver.of_type("response.completed"), 60, "the response's event")
    event = client.webhooks.unwrap(done[0].raw, done[0].headers, secret=secret)
    assert event.type == f"response.{client.responses.retrieve(r.id).status}"
    assert event.data.id == r.id and event.object == "event" and event.id.startswith("evt_")
    seq_id = "seq-" + r.id.removeprefix("resp_")   # told once, in OpenAI's shape only
    assert all(d.body["data"]["id"] != seq_id for d in receiver.of_type("job.completed"))
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(done[0].raw + b" ", done[0].headers, secret=secret)


def test_another_keys_event_sent_to_a_receiver_does_not_verify_with_its_secret(api, receiver):
    """Anyone may name any URL as a webhook: what tells the receiver's owner an event is not of
    its own jobs is that it is signed with the sender's key, not the receiver owner's."""
    job = api.with_key(KEYS[1]).submit(prompt="Not yours", max_tokens=2,
                                      webhook=receiver.url + "/spoof")
    wait_until(lambda: receiver.of_type("job.completed"), 60, "the other key's job.completed")
    [event] = receiver.of_type("job.completed")
    assert event.body["data"]["id"] == job["id"] and not event.signature_ok


def test_webhook_to_a_private_address_is_refused_at_submit(api, receiver):
    one = api.with_key(KEYS[0])
    port = receiver.url.rsplit(":", 1)[1]
    for url in (f"http://localhost:{port}/", "http://10.1.2.3/", "http://169.254.169.254/",
                "http://[::1]/", "file:///etc/passwd"):
        r = one.request("POST", "/v1/jobs", json={"prompt": "x", "webhook": url})
        assert r.status_code == 400, (url, r.text)
        assert r.json()["error"]["param"] == "webhook"
