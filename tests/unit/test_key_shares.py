"""One key's backlog cannot lock another out (issue 48): a key within LLMQ_KEY_QUEUE_FLOOR
gets into a queue that other keys filled, and a key's requests that wait on API threads for
their results are capped (LLMQ_KEY_MAX_WAITING), answered 429 to that key only."""
from __future__ import annotations

from common.keys import Keys
from common.store import queue_lists, record_key

from .test_api_unit import Api, assert_error, auth


def post_jobs(api: Api, key: str, n: int):
    return api.client.post("/v1/jobs", json={"prompts": ["x"] * n, "max_tokens": 1},
                           headers=auth(key))


def owner_of(api: Api, key: str) -> str:
    resp = post_jobs(api, key, 1)
    assert resp.status_code == 202, resp.get_data(as_text=True)
    return api.r.hget(record_key(resp.get_json()["jobs"][0]["id"]), "owner")


def test_a_key_within_its_floor_gets_into_a_queue_that_others_filled():
    api = Api(api_keys=("k1", "k2", "k3"), max_queued=8, key_queue_floor=2)  # share: 4 each
    assert post_jobs(api, "k1", 4).status_code == 202
    assert post_jobs(api, "k3", 4).status_code == 202
    # Queued messages count as the broker holds them (the test's Celery sends none).
    api.r.rpush(queue_lists(api.app.extensions["llmq"]["settings"].queue)[0], *["m"] * 8)
    # Two flooding keys filled the queue: a third key still gets its floor in ...
    assert post_jobs(api, "k2", 2).status_code == 202
    # ... and no more than that, nor do the keys that filled it.
    err = assert_error(post_jobs(api, "k2", 1), 429, "rate_limit_error")
    assert err["code"] == "queue_full"
    assert assert_error(post_jobs(api, "k1", 1), 429, "rate_limit_error")["code"] == "queue_full"


def test_a_keys_waiting_requests_are_capped_and_the_cap_is_its_own():
    api = Api(api_keys=("k1", "k2"), key_max_waiting=2, wait_timeout_s=0.05)
    o1, o2 = owner_of(api, "k1"), owner_of(api, "k2")
    store = api.store
    # k1 already has two requests waiting (on this process or another).
    held = [store.open_stream(o1, 2, 60, waiting=True) for _ in range(2)]
    assert all(held)
    model = api.client.get("/v1/models", headers=auth("k1")).get_json()["data"][0]["id"]
    waiting = [("/v1/generate", {"prompt": "x", "max_tokens": 1}),
               ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1}),
               ("/v1/chat/completions", {"model": model, "max_tokens": 1,
                                         "messages": [{"role": "user", "content": "x"}]}),
               ("/v1/responses", {"model": model, "input": "x", "max_output_tokens": 1})]
    before = api.r.keys("llmq:seq:*")
    for path, body in waiting:
        resp = api.client.post(path, json=body, headers=auth("k1"))
        err = assert_error(resp, 429, "rate_limit_error")
        assert err["code"] == "too_many_waiting" and "LLMQ_KEY_MAX_WAITING" in err["message"]
        assert resp.headers["Retry-After"]
    assert api.r.keys("llmq:seq:*") == before            # refused before any job exists
    # What does not wait on a thread is not capped by it: queued jobs, a background response.
    assert post_jobs(api, "k1", 1).status_code == 202
    assert api.client.post("/v1/responses", headers=auth("k1"), json={
        "model": model, "input": "x", "background": True}).status_code == 200
    # The other key waits as usual (its wait times out here: no worker), and gives its slot
    # back when its response is closed (the server's last write done).
    for path, body in waiting:
        with api.client.post(path, json=body, headers=auth("k2")) as resp:
            assert resp.status_code != 429, resp.get_data(as_text=True)
            assert api.r.zcard(Keys.owner_waiting(o2)) == 1   # still held while it writes
    assert api.r.zcard(Keys.owner_waiting(o2)) == 0
    # One of k1's ends: k1 waits again.
    store.close_stream(o1, held[0], waiting=True)
    with api.client.post("/v1/generate", json=waiting[0][1], headers=auth("k1")) as resp:
        assert resp.status_code != 429, resp.get_data(as_text=True)
    assert api.r.zcard(Keys.owner_waiting(o1)) == 1
