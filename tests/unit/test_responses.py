"""The Responses API on fakeredis with a recording Celery stub: stream events numbered from a
sequence's stored Redis stream (replays, resets, a re-run that diverges), Idempotency-Key's
claims, queue positions, and the routes' shapes, refusals and ownership."""
from __future__ import annotations

import io
import json
import threading

import fakeredis
import pytest

from app.response_events import ResponseEventLog
from common.idempotency_store import IdempotencyStore
from common.protocol import FinishReason
from common.queue_store import QueueStore, queue_lists
from common.store import SequenceStore, TokenDelta

from .test_api_unit import Api, assert_error, auth


# --- event numbering --------------------------------------------------------------------------
@pytest.fixture
def store():
    return SequenceStore(fakeredis.FakeRedis(decode_responses=True), result_ttl_s=300,
                         pending_ttl_s=3000, stream_maxlen=1000)


def new_seq(store, seq_id="seq-" + "a" * 32):
    from common.protocol import SequenceRequest

    return store.create([SequenceRequest(seq_id=seq_id, messages=[
        {"role": "user", "content": "hi"}])])[0]


def tokens(store, seq_id, pieces, attempt=None):
    for i, piece in enumerate(pieces, 1):
        store.publish_deltas([TokenDelta(seq_id, piece, i, attempt=attempt)])


def events_of(store, job, entries=None, after=-1):
    """The events a log makes of the stored stream (or of `entries`), numbered after `after`."""
    log = ResponseEventLog(job, {"background": True, "model": "m"})
    out = log.start()
    for _entry_id, kind, data in entries if entries is not None else stored(store, job):
        out += log.feed(kind, data)
    return [e for e in out if e["sequence_number"] > after]


def stored(store, job):
    return store.read_events(job["id"], "0-0", count=10_000)


def kinds(events):
    return [e["type"].removeprefix("response.") for e in events]


def test_events_follow_the_stored_stream_numbered_from_zero(store):
    job = new_seq(store)
    store.start(job["id"], "w1")
    tokens(store, job["id"], ["Hel", "", "lo"])
    store.finish(job["id"], FinishReason.STOP, text="Hello", completion_tokens=3)
    events = events_of(store, job)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds(events) == ["created", "in_progress", "output_item.added",
                             "content_part.added", "output_text.delta", "output_text.delta",
                             "output_text.done", "content_part.done", "output_item.done",
                             "completed"]
    assert [e["delta"] for e in events if e["type"].endswith(".delta")] == ["Hel", "lo"]
    assert events[0]["response"]["status"] == "queued"   # a background response, as accepted
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hello"
    assert events[-1]["response"]["usage"]["output_tokens"] == 3


def test_a_replay_after_n_is_exactly_the_events_after_n(store):
    job = new_seq(store)
    store.start(job["id"], "w1")
    tokens(store, job["id"], ["a", "b", "c"])
    live = events_of(store, job)   # what a client following it live has seen so far
    store.finish(job["id"], FinishReason.LENGTH, text="abcd", completion_tokens=4)
    full = events_of(store, job)
    assert full[:len(live)] == live   # later entries renumber nothing already sent
    for n in range(-1, len(full)):
        assert events_of(store, job, after=n) == full[n + 1:]
    assert full[-1]["type"] == "response.incomplete"
    assert full[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [e["delta"] for e in full if e["type"].endswith(".delta")] == ["a", "b", "c", "d"]


def test_a_reset_keeps_the_numbers_clients_saw_and_a_repeating_rerun_goes_on(store):
    job = new_seq(store)
    store.start(job["id"], "w1")
    tokens(store, job["id"], ["Hel", "lo"])
    before = events_of(store, job)
    assert store.reclaim("w1") == [job["id"]]   # the worker was lost: a reset event
    store.start(job["id"], "w2")
    tokens(store, job["id"], ["Hel", "lo", " world"])
    store.finish(job["id"], FinishReason.STOP, text="Hello world", completion_tokens=3)
    after = events_of(store, job)
    assert after[:len(before)] == before
    assert [e["delta"] for e in after if e["type"].endswith(".delta")] == ["Hel", "lo", " world"]
    assert after[-1]["type"] == "response.completed"
    assert [e["sequence_number"] for e in after] == list(range(len(after)))


def test_a_rerun_that_differs_ends_the_stream_with_an_error_event_at_a_fixed_number(store):
    job = new_seq(store)
    store.start(job["id"], "w1")
    tokens(store, job["id"], ["Hel", "lo"])
    store.reclaim("w1")
    store.start(job["id"], "w2")
    tokens(store, job["id"], ["Bye"])
    store.finish(job["id"], FinishReason.STOP, text="Bye", completion_tokens=1)
    events = events_of(store, job)
    assert events[-1]["type"] == "error" and events[-1]["code"] == "stream_diverged"
    assert events_of(store, job, after=events[-2]["sequence_number"]) == events[-1:]


def test_a_response_cancelled_while_queued_has_no_output_events(store):
    job = new_seq(store)
    store.request_cancel(job["id"])
    assert kinds(events_of(store, job)) == ["created", "cancelled"]


# --- Idempotency-Key --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def _apis():
    return Api(wait_timeout_s=0.1), Api(api_keys=("k1", "k2"))


@pytest.fixture
def api(_apis):
    return _apis[0].reset()


@pytest.fixture
def keyed(_apis):
    return _apis[1].reset()


def key(k):
    return {"Idempotency-Key": k}


def test_the_same_key_and_body_answer_the_first_job_once(api):
    first = api.client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 3}, headers=key("a"))
    # the same body, keys in another order: the same request
    again = api.client.post("/v1/jobs", data='{"max_tokens": 3,  "prompt": "x"}',
                            content_type="application/json", headers=key("a"))
    assert first.status_code == again.status_code == 202
    assert again.get_json() == first.get_json()
    assert again.headers["Location"] == first.headers["Location"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(api.celery.calls) == 1


def test_the_same_key_with_another_body_or_route_is_422(api):
    api.client.post("/v1/jobs", json={"prompt": "x"}, headers=key("a"))
    for path, body in (("/v1/jobs", {"prompt": "y"}), ("/v1/responses", {"prompt": "x"})):
        err = assert_error(api.client.post(path, json=body, headers=key("a")), 422)
        assert err["code"] == "idempotency_key_reused" and err["param"] == "Idempotency-Key"
    assert len(api.celery.calls) == 1


def test_a_key_still_being_answered_is_409_with_retry_after(api):
    fp_store = api.app.extensions["llmq"]["idempotency"]
    with api.app.test_request_context("/v1/jobs", method="POST", json={"prompt": "x"}):
        from app.idempotency import fingerprint
        state, _token = fp_store.claim("", "a", fingerprint(), 60)
    assert state == "new"
    resp = api.client.post("/v1/jobs", json={"prompt": "x"}, headers=key("a"))
    assert assert_error(resp, 409)["code"] == "idempotency_key_in_use"
    assert resp.headers["Retry-After"] == "1"
    assert api.celery.calls == []


def test_a_refused_request_lets_its_key_go(api):
    assert_error(api.client.post("/v1/jobs", json={"prompt": ""}, headers=key("a")), 400)
    assert api.client.post("/v1/jobs", json={"prompt": ""}, headers=key("a")).status_code == 400
    # the key was released each time: a fixed body with it runs
    assert api.client.post("/v1/jobs", json={"prompt": "x"}, headers=key("b")).status_code == 202


def test_concurrent_requests_with_one_key_run_once(api):
    answers = []

    def post():
        with api.app.test_client() as c:
            answers.append(c.post("/v1/jobs", json={"prompt": "x"}, headers=key("c")))

    threads = [threading.Thread(target=post) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(api.celery.calls) == 1
    ids = {a.get_json()["id"] for a in answers if a.status_code == 202}
    assert len(ids) == 1 and all(a.status_code in (202, 409) for a in answers)


def test_an_upload_is_the_same_request_whatever_its_multipart_boundary(api):
    def upload(content: bytes):
        return api.client.post("/v1/files", headers=key("f"), data={
            "purpose": "batch", "file": (io.BytesIO(content), "in.jsonl")})

    first, again = upload(b'{"a": 1}\n'), upload(b'{"a": 1}\n')
    assert first.status_code == again.status_code == 200, first.get_data(as_text=True)
    assert again.get_json()["id"] == first.get_json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert assert_error(upload(b'{"a": 2}\n'), 422)["code"] == "idempotency_key_reused"


def test_keys_are_scoped_per_api_key(keyed):
    a = keyed.client.post("/v1/jobs", json={"prompt": "x"}, headers={**key("k"), **auth("k1")})
    b = keyed.client.post("/v1/jobs", json={"prompt": "x"}, headers={**key("k"), **auth("k2")})
    assert a.status_code == b.status_code == 202
    assert a.get_json()["id"] != b.get_json()["id"]
    assert len(keyed.celery.calls) == 2


def test_idempotency_store_settles_only_its_own_claim():
    s = IdempotencyStore(fakeredis.FakeRedis(decode_responses=True))
    state, token = s.claim("o", "k", "fp1", 60)
    assert state == "new"
    assert s.claim("o", "k", "fp1", 60) == ("pending", None)
    assert s.claim("o", "k", "fp2", 60) == ("mismatch", None)
    assert not s.answer("o", "k", "not-the-token", {"status": 200}, 60)
    assert s.answer("o", "k", token, {"status": 200, "body": "{}"}, 60)
    assert s.claim("o", "k", "fp1", 60) == ("done", {"status": 200, "body": "{}"})
    assert s.claim("other", "k", "fp2", 60)[0] == "new"   # another owner's key


# --- queue positions --------------------------------------------------------------------------
def test_queue_position_counts_better_priorities_and_those_ahead_in_its_own():
    r = fakeredis.FakeRedis(decode_responses=True)
    lists = queue_lists("llmq")

    def push(priority, seq_id):   # kombu: LPUSH, the consumer takes from the right
        r.lpush(lists[priority], json.dumps({"headers": {"id": seq_id}}))

    for i in range(3):
        push(0, f"seq-p0-{i}")
    for i in range(5):
        push(4, f"seq-p4-{i}")
    push(9, "seq-p9-0")
    q = QueueStore(r)
    assert q.position("llmq", "seq-p0-0", 0) == 0
    assert q.position("llmq", "seq-p0-2", 0) == 2
    assert q.position("llmq", "seq-p4-0", 4) == 3
    assert q.position("llmq", "seq-p4-4", 4) == 7
    assert q.position("llmq", "seq-p9-0", 9) == 8
    # read from both ends: the newest and the next are found at once, the middle past the scan
    assert q.position("llmq", "seq-p4-4", 4, scan=2) == 7
    assert q.position("llmq", "seq-p4-0", 4, scan=2) == 3
    assert q.position("llmq", "seq-p4-2", 4, scan=2) is None
    for i in range(5):   # every one, from either end, whatever the chunking
        assert q.position("llmq", f"seq-p4-{i}", 4, scan=5) == 3 + i
    assert q.position("llmq", "seq-missing", None) is None


# --- routes -----------------------------------------------------------------------------------
def test_a_background_response_is_queued_with_its_queue_figures(api):
    resp = api.client.post("/v1/responses", json={"input": "hi", "background": True,
                                                  "instructions": "Be brief",
                                                  "max_output_tokens": 5})
    body = resp.get_json()
    assert resp.status_code == 200, body
    assert body["object"] == "response" and body["status"] == "queued"
    assert body["id"].startswith("resp_") and body["output"] == [] and body["usage"] is None
    assert body["queue_position"] == 0 and "estimated_start_s" in body
    seq_id = "seq-" + body["id"].removeprefix("resp_")
    rec = api.store.get_record(seq_id)
    assert json.loads(rec["messages"]) == [{"role": "system", "content": "Be brief"},
                                           {"role": "user", "content": "hi"}]
    assert json.loads(rec["params"])["max_tokens"] == 5


def test_flex_runs_at_the_batch_priority(api):
    body = api.client.post("/v1/responses", json={"input": "hi", "background": True,
                                                  "service_tier": "flex"}).get_json()
    assert api.celery.calls[-1]["priority"] == 9
    assert body["service_tier"] == "flex"


def test_previous_response_id_continues_the_conversation(api):
    first = api.client.post("/v1/responses", json={"input": "one", "background": True,
                                                   "instructions": "not carried"}).get_json()
    seq1 = "seq-" + first["id"].removeprefix("resp_")
    err = assert_error(api.client.post("/v1/responses", json={
        "input": "two", "previous_response_id": first["id"]}), 400)
    assert err["param"] == "previous_response_id"   # not finished yet
    api.store.start(seq1, "w1")
    api.store.finish(seq1, FinishReason.STOP, text="ONE", completion_tokens=1)
    second = api.client.post("/v1/responses", json={
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "two"}]}],
        "previous_response_id": first["id"], "background": True}).get_json()
    rec = api.store.get_record("seq-" + second["id"].removeprefix("resp_"))
    assert json.loads(rec["messages"]) == [{"role": "user", "content": "one"},
                                           {"role": "assistant", "content": "ONE"},
                                           {"role": "user", "content": "two"}]
    items = api.client.get(f"/v1/responses/{second['id']}/input_items").get_json()
    assert [i["content"][0]["text"] for i in items["data"]] == ["two"]


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
     "text.format.schema"),
    ({"input": "x", "background": True, "store": False}, "store"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
])
def test_unsupported_or_bad_fields_are_a_400_or_404_naming_them(api, body, param):
    resp = api.client.post("/v1/responses", json=body)
    assert resp.status_code in (400, 404)
    assert assert_error(resp, resp.status_code)["param"] == param
    assert api.celery.calls == []


def test_another_keys_response_is_404(keyed):
    body = keyed.client.post("/v1/responses", json={"input": "hi", "background": True},
                             headers=auth("k1")).get_json()
    for method, path in (("get", ""), ("post", "/cancel"), ("delete", ""),
                         ("get", "/input_items")):
        resp = getattr(keyed.client, method)(f"/v1/responses/{body['id']}{path}",
                                             headers=auth("k2"))
        assert_error(resp, 404)
    assert keyed.client.get(f"/v1/responses/{body['id']}",
                            headers=auth("k1")).status_code == 200


def test_cancel_and_delete(api):
    body = api.client.post("/v1/responses", json={"input": "hi", "background": True}).get_json()
    cancelled = api.client.post(f"/v1/responses/{body['id']}/cancel").get_json()
    assert cancelled["status"] == "cancelled" and cancelled["metrics"]["attempts"] == 0
    gone = api.client.delete(f"/v1/responses/{body['id']}").get_json()
    assert gone == {"id": body["id"], "object": "response.deleted", "deleted": True}
    assert_error(api.client.get(f"/v1/responses/{body['id']}"), 404)
    assert api.store.get_record("seq-" + body["id"].removeprefix("resp_")) is None
