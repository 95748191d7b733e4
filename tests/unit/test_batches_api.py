"""The Batch API's reading of input files (app/batches_api.py, app/files_api.py) and its
driver's queueing (worker/batch_runner.py), on fakeredis: a line is checked as its route
checks a request, JSON Lines split at newlines only, malformed lines are error lines (never a
500), and ids that are not ids are unknown (404, never a 503)."""
from __future__ import annotations

import io
import json

import pytest

from common.batch_store import BatchStore, line_seq_id
from common.file_store import FileStore, StorageFull, content_key, file_key
from common.protocol import FinishReason
from common.reconcile_store import ReconcileStore
from common.store import SequenceStore
from common.webhook_store import WebhookStore

from .factories import RecordingCelery, make_settings
from .test_api_unit import Api, assert_error


K1, K2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}


@pytest.fixture(scope="module")
def _api():
    return Api(api_keys=("k1", "k2"))


@pytest.fixture
def api(_api):
    return _api.reset()


def upload(api, text: str, headers=K1) -> str:
    resp = api.client.post("/v1/files", headers=headers, data={
        "purpose": "batch", "file": (io.BytesIO(text.encode("utf-8")), "in.jsonl")})
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return resp.get_json()["id"]


def line(custom_id: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "url": "/v1/completions", "body": body},
                      ensure_ascii=False)


def create(api, file_id: str, headers=K1):
    return api.client.post("/v1/batches", headers=headers, json={
        "input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"})


def created(api, text: str) -> dict:
    resp = create(api, upload(api, text))
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return resp.get_json()


@pytest.mark.parametrize("body", [
    {"prompt": "x", "max_tokens": 1_000_000},                  # LLMQ_MAX_TOKENS_LIMIT
    {"prompt": "x", "stop": [f"s{i}" for i in range(40)]},    # LLMQ_MAX_STOP
    {"prompt": "x", "stop": ["y" * 5000]},                    # LLMQ_MAX_STOP_CHARS
    {"prompt": "x" * 200_000},                                # LLMQ_MAX_PROMPT_CHARS
], ids=["max_tokens", "stop_count", "stop_chars", "prompt_chars"])
def test_a_line_past_the_routes_limits_is_an_error_line(api, body):
    """A line is checked as its route checks a request: it was queued (and the stop-string
    bounds, which bound the worker's matching, did not hold in a batch)."""
    assert_error(api.client.post("/v1/completions", headers=K1, json=body), 400)
    batch = created(api, line("a", body) + "\n" + line("b", {"prompt": "ok"}))
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 1}
    assert batch["errors"]["data"][0]["line"] == 1


def test_a_line_over_the_keys_tokens_per_minute_is_an_error_line():
    api = Api(rate_limit_tpm=100)
    batch = created(api, line("a", {"prompt": "x", "max_tokens": 500}) + "\n"
                    + line("b", {"prompt": "x", "max_tokens": 2}))
    assert batch["request_counts"]["failed"] == 1
    assert batch["errors"]["data"][0]["code"] == "request_too_large"


def test_json_lines_split_at_newlines_only(api):
    """U+2028, U+2029 and U+0085 are raw inside JSON strings (ensure_ascii=False); splitlines()
    cut such lines apart and answered good lines as malformed."""
    text = "\n".join([line("a", {"prompt": "Résumé:\u2028second part"}),
                      line("b", {"prompt": "plain"}),
                      line("c", {"prompt": "NEL\x85here"})]) + "\r\n"
    batch = created(api, text)
    assert batch["errors"] is None
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 0}


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("raw", [
    '{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": ' + DEEP + "}}",
    '{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "a\\ud800b"}}',
    '{"custom_id": "a\\ud800", "url": "/v1/completions", "body": {"prompt": 5}}',
], ids=["nested-too-deeply", "lone-surrogate-prompt", "lone-surrogate-custom-id"])
def test_a_line_that_cannot_be_read_or_stored_is_an_error_line_not_a_500(api, raw):
    batch = created(api, raw + "\n" + line("ok", {"prompt": "fine"}))
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 1}


def test_ids_that_are_not_ids_are_unknown_for_every_key(api):
    """"<id>:content" and "<id>:lines" name a file's content and a batch's lines in Redis (a
    string, a list): they answered 503 "retry shortly", and told one key that another's id
    exists."""
    fid = upload(api, line("a", {"prompt": "x"}))
    bid = created(api, line("a", {"prompt": "x"}))["id"]
    for method, path in [("GET", f"/v1/files/{fid}:content"),
                         ("GET", f"/v1/files/{fid}:content/content"),
                         ("DELETE", f"/v1/files/{fid}:content"),
                         ("GET", f"/v1/batches/{bid}:lines"),
                         ("POST", f"/v1/batches/{bid}:lines/cancel")]:
        for headers in (K1, K2):
            assert_error(api.client.open(path, method=method, headers=headers), 404,
                         "not_found_error")
    assert_error(create(api, f"{fid}:content"), 404)


def test_the_driver_answers_a_line_it_can_never_queue_and_goes_on():
    """Settings may differ between API and worker: a line the driver's rate limit refuses
    outright (TooLarge) gets an error line and the lines after it are queued; it was left in
    flight, and every driver after stopped on it until the batch expired."""
    driver, _seqs, bid = a_driver_past_its_first_submit(
        Api(), line("a", {"prompt": "x", "max_tokens": 500}) + "\n"
        + line("b", {"prompt": "x", "max_tokens": 2}), rate_limit_tpm=100)
    svc = driver.svc
    assert [c["args"][0] for c in svc.celery.calls] == [line_seq_id(bid, 1)]
    [err] = [json.loads(x) for x in svc.batches.answered(bid, "err")]
    assert err["custom_id"] == "a" and "LLMQ_RATE_LIMIT_TPM" in err["error"]["message"]
    assert svc.batches.inflight(bid)[0] == {1}


def a_driver_past_its_first_submit(api: Api, text: str, **settings):
    """The batch of `text` created through the API, and a driver of it (the worker's part,
    with `settings`, on the same fakeredis) that has queued what it could of its lines."""
    from worker.batch_runner import BatchDriver
    from worker.services import Services

    bid = created(api, text)["id"]
    token = api.celery.calls[0]["args"][1]   # the driver the API dispatched
    s, celery = make_settings(**settings), RecordingCelery()
    seqs = SequenceStore(api.r)
    svc = Services(s, celery, seqs, seqs.beside(FileStore, s.file_ttl_s),
                   seqs.beside(BatchStore, s.file_ttl_s),
                   seqs.beside(WebhookStore, s.pending_ttl_s),
                   seqs.beside(ReconcileStore, ["llmq"]))
    driver = BatchDriver(svc, bid, token)
    driver.keep_lease(force=True)
    svc.batches.set_fields(bid, status="in_progress")
    driver.h = svc.batches.record(bid)
    assert driver.submit_more()
    return driver, seqs, bid


def test_a_line_whose_prompt_the_worker_refused_answers_400_as_the_route_does(api):
    """The worker refuses a prompt it cannot run (longer than its context, token ids outside
    its vocabulary): the route answers 400 with the code; the batch line said 500
    server_error, as if the server had failed."""
    driver, seqs, bid = a_driver_past_its_first_submit(
        api, line("a", {"prompt": "x"}) + "\n" + line("b", {"prompt": "y"}))
    seqs.finish(line_seq_id(bid, 0), FinishReason.ERROR, error="prompt is 9000 tokens",
                error_code="context_length_exceeded")
    seqs.finish(line_seq_id(bid, 1), FinishReason.ERROR, error="the model process died")
    driver.collect()
    a, b = sorted((json.loads(x) for x in driver.svc.batches.answered(bid, "err")),
                  key=lambda x: x["custom_id"])
    assert a["response"]["status_code"] == 400
    assert a["response"]["body"]["error"] == {
        "message": "prompt is 9000 tokens", "type": "invalid_request_error", "param": None,
        "code": "context_length_exceeded"}
    assert b["response"]["status_code"] == 500
    assert b["response"]["body"]["error"]["type"] == "server_error"


# --- a key's storage --------------------------------------------------------------------------
def post_file(api, text: str, headers=K1):
    return api.client.post("/v1/files", headers=headers, data={
        "purpose": "batch", "file": (io.BytesIO(text.encode("utf-8")), "in.jsonl")})


def test_a_keys_files_are_capped_and_only_its_live_files_count():
    """Files live in the Redis memory every key shares, 30 days each: one key could upload
    until Redis was full. A file deleted, or expired, gives its room back."""
    text = line("a", {"prompt": "x" * 200})
    size = len(text.encode())
    api = Api(api_keys=("k1", "k2"), file_max_bytes_per_key=3 * size)
    fids = [upload(api, text) for _ in range(3)]
    err = assert_error(post_file(api, text), 400, "invalid_request_error")
    assert err["code"] == "storage_limit_exceeded" and err["param"] == "file"
    assert "LLMQ_FILE_MAX_BYTES_PER_KEY" in err["message"]
    upload(api, text, K2)                                 # another key's room is its own
    assert api.client.delete(f"/v1/files/{fids[0]}", headers=K1).status_code == 200
    upload(api, text)
    # Expired: Redis drops the file's keys; its entry in the key's index stays until pruned.
    api.r.delete(file_key(fids[1]), content_key(fids[1]))
    upload(api, text)
    assert_error(post_file(api, text), 400)
    few = Api(api_keys=("k1",), file_max_files_per_key=2)
    upload(few, "x"), upload(few, "y")
    err = assert_error(post_file(few, "z"), 400)
    assert err["code"] == "storage_limit_exceeded"
    assert "LLMQ_FILE_MAX_FILES_PER_KEY" in err["message"]


def test_a_batchs_output_files_count_toward_its_key_but_are_never_refused():
    text = line("a", {"prompt": "x"})
    size = len(text.encode())
    api = Api(api_keys=("k1",), file_max_bytes_per_key=2 * size)
    driver, seqs, bid = a_driver_past_its_first_submit(api, text)
    seqs.finish(line_seq_id(bid, 0), FinishReason.STOP, text="y" * (4 * size))
    driver.collect()
    assert driver.finalize("completed") == "completed"    # past the cap: written all the same
    batch = api.client.get(f"/v1/batches/{bid}", headers=K1).get_json()
    out = api.client.get(f"/v1/files/{batch['output_file_id']}/content", headers=K1)
    assert out.status_code == 200 and "y" * (4 * size) in out.get_data(as_text=True)
    err = assert_error(post_file(api, text), 400)        # 1 input + the output: no room left
    assert err["code"] == "storage_limit_exceeded"


def test_uploads_at_once_cannot_each_take_the_same_room(monkeypatch):
    """Another replica's upload lands between this one's count and its write: the write is
    refused (the owner's index is watched) and the count taken again."""
    import fakeredis

    files = FileStore(fakeredis.FakeRedis(decode_responses=True), 3600)
    usage = files.usage

    def another_upload_lands(owner):
        counted = usage(owner)
        monkeypatch.setattr(files, "usage", usage)    # once
        files.put(owner, "batch", "b.jsonl", "b" * 10)
        return counted

    monkeypatch.setattr(files, "usage", another_upload_lands)
    with pytest.raises(StorageFull):
        files.put("o", "batch", "a.jsonl", "a" * 10, max_bytes=15)
    assert files.usage("o") == (1, 10)
