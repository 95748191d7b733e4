"""A full Redis (its maxmemory reached, noeviction: how scripts/redis.sh and docker-compose.yml
start it) is answered as what it is: a 503 `redis_full` with Retry-After, nothing queued, and
the API takes work again once Redis has room (issue 48). Real redis-server, real HTTP app with
its real Celery client."""
from __future__ import annotations

import pytest
import redis

pytestmark = pytest.mark.integration


def fill(r: redis.Redis, room_bytes: int) -> None:
    """Leaves Redis room_bytes of memory, then fills that."""
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) + room_bytes))
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        for i in range(10_000):
            r.set(f"fill:{i}", "x" * 10_000)


def test_a_full_redis_is_a_503_with_retry_after_and_nothing_queued(world):
    api, r = world.api(), world.client()
    model = api.request("GET", "/v1/models").json()["data"][0]["id"]
    fill(r, 1024 * 1024)
    seqs_before = r.keys("llmq:seq:*")
    for path, body in (("/v1/jobs", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": model, "max_tokens": 2, "messages": [
                           {"role": "user", "content": "hi"}]})):
        resp = api.request("POST", path, json=body)
        assert resp.status_code == 503, resp.text
        assert resp.headers["Retry-After"] == "30"
        err = resp.json()["error"]
        assert err["code"] == "redis_full" and "maxmemory" in err["message"], err
    upload = api.request("POST", "/v1/files", data={"purpose": "batch"},
                         files={"file": ("x.jsonl", b'{"custom_id": "a"}\n' * 200)})
    assert upload.status_code == 503 and upload.json()["error"]["code"] == "redis_full"
    assert r.keys("llmq:seq:*") == seqs_before
    assert r.llen("llmq") == 0                       # no message queued

    r.config_set("maxmemory", "0")                   # room again: work is taken
    assert api.request("POST", "/v1/jobs", json={"prompt": "hi", "max_tokens": 2}
                       ).status_code == 202
