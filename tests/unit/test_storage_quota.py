"""A key's ended jobs may keep at most LLMQ_KEY_STORAGE_BYTES in Redis (issue 48): past it,
its submissions are 429 `storage_quota_exceeded` before any job exists, until some of its
results expire; other keys are not affected. Without keys every job shares one quota. A
batch's creation is charged the same way, until the batch expires."""
from __future__ import annotations

import pytest

from common.keys import Keys
from common.protocol import FinishReason
from common.store import record_key

from .test_api_unit import Api, assert_error, auth
from .test_batches_api import create, line, upload

RESULT_TTL = 3600


def post_job(api: Api, key: str | None):
    return api.client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 1},
                           headers=auth(key) if key else {})


def end_with(api: Api, key: str | None, text: str) -> str:
    """A job of `key` that ended with `text` (written as the worker writes its end); its
    owner."""
    resp = post_job(api, key)
    assert resp.status_code == 202, resp.get_data(as_text=True)
    seq_id = resp.get_json()["id"]
    api.store.finish(seq_id, FinishReason.STOP, text=text, completion_tokens=len(text) // 100)
    return api.r.hget(record_key(seq_id), "owner")


def expire_all(api: Api, owner: str) -> None:
    """As if the result TTL had passed for every stored job of the owner."""
    key = Keys.owner_stored(owner)
    api.r.zadd(key, {m: 1 for m in api.r.zrange(key, 0, -1)})


@pytest.mark.parametrize("keys", [("k1", "k2"), ()])
def test_a_key_past_its_storage_quota_is_refused_until_its_results_expire(keys):
    api = Api(api_keys=keys, key_storage_bytes=30_000, result_ttl_s=RESULT_TTL)
    k1 = keys[0] if keys else None
    owner = end_with(api, k1, "x" * 4_000)           # under the quota: another is welcome
    used = int(api.r.get(Keys.owner_stored_bytes(owner)))
    assert 12_000 < used < 30_000   # the record, and its text again in the events
    end_with(api, k1, "y" * 12_000)                   # past it now
    before = api.r.keys("llmq:seq:*")
    resp = post_job(api, k1)
    err = assert_error(resp, 429, "rate_limit_error")
    assert err["code"] == "storage_quota_exceeded" and "LLMQ_KEY_STORAGE_BYTES" in err["message"]
    # Retry-After: when the oldest of its results expires
    assert RESULT_TTL - 60 <= int(resp.headers["Retry-After"]) <= RESULT_TTL + 1
    assert api.r.keys("llmq:seq:*") == before        # refused before any job exists
    if keys:   # another key's jobs are its own business
        assert post_job(api, "k2").status_code == 202
    expire_all(api, owner)   # its results expired: their room is free again
    assert post_job(api, k1).status_code == 202
    assert int(api.r.get(Keys.owner_stored_bytes(owner))) == 0
    assert api.r.zcard(Keys.owner_stored(owner)) == 0


def test_no_quota_when_it_is_0():
    api = Api(api_keys=("k1",), key_storage_bytes=0)
    end_with(api, "k1", "x" * 100_000)
    assert post_job(api, "k1").status_code == 202


def test_a_deleted_response_gives_its_room_back():
    api = Api(api_keys=("k1",), key_storage_bytes=30_000, result_ttl_s=RESULT_TTL)
    model = api.client.get("/v1/models", headers=auth("k1")).get_json()["data"][0]["id"]
    resp = api.client.post("/v1/responses", headers=auth("k1"), json={
        "model": model, "input": "x", "background": True})
    assert resp.status_code == 200, resp.get_data(as_text=True)
    resp_id = resp.get_json()["id"]
    seq_id = "seq-" + resp_id.removeprefix("resp_")
    api.store.finish(seq_id, FinishReason.STOP, text="z" * 40_000, completion_tokens=100)
    owner = api.r.hget(record_key(seq_id), "owner")
    assert post_job(api, "k1").status_code == 429   # past its quota
    assert api.client.delete(f"/v1/responses/{resp_id}", headers=auth("k1")).status_code == 200
    assert int(api.r.get(Keys.owner_stored_bytes(owner))) == 0
    assert api.r.zcard(Keys.owner_stored(owner)) == 0
    assert post_job(api, "k1").status_code == 202


def batch_file(api: Api, key: str, lines: int, chars: int) -> str:
    text = "\n".join(line(f"r{i}", {"prompt": "x" * chars, "max_tokens": 1})
                     for i in range(lines))
    return upload(api, text, auth(key))


def test_each_batch_creation_is_charged_to_its_key_until_the_batch_expires():
    """A batch keeps its parsed lines until it expires, and one file may be batched again and
    again: each creation counts toward the key's quota, the 429 comes before a batch exists,
    and another key's batches are unaffected."""
    quota = 100_000
    api = Api(api_keys=("k1", "k2"), key_storage_bytes=quota, result_ttl_s=RESULT_TTL)
    file_id = batch_file(api, "k1", lines=10, chars=1_000)
    owner = None
    used, made = [0], 0
    while True:
        resp = create(api, file_id, auth("k1"))
        if resp.status_code != 200:
            break
        made += 1
        owner = owner or next(iter(api.r.keys("llmq:owner:*:stored-bytes"))).split(":")[2]
        used.append(int(api.r.get(Keys.owner_stored_bytes(owner))))
        assert used[-1] - used[-2] > 10_000   # its ten 1,000-character lines, and more
        assert used[-1] <= quota
    assert made >= 2
    err = assert_error(resp, 429, "rate_limit_error")
    assert err["code"] == "storage_quota_exceeded"
    assert int(resp.headers["Retry-After"]) > RESULT_TTL   # when the oldest batch expires
    listed = api.client.get("/v1/batches?limit=100", headers=auth("k1")).get_json()["data"]
    assert len(listed) == made   # the refused one does not exist
    assert create(api, batch_file(api, "k2", lines=10, chars=1_000), auth("k2")).status_code == 200
    expire_all(api, owner)   # its batches expired: their room is free again
    assert create(api, file_id, auth("k1")).status_code == 200


def test_a_batch_larger_than_the_whole_quota_is_a_400():
    api = Api(api_keys=("k1",), key_storage_bytes=20_000)
    resp = create(api, batch_file(api, "k1", lines=30, chars=1_000), auth("k1"))
    err = assert_error(resp, 400, "invalid_request_error")
    assert err["code"] == "storage_quota_exceeded" and err["param"] == "input_file_id"
