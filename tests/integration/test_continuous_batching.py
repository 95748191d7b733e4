"""Sequences join a running batch and leave it early: proven from the engine's own counters."""
import redis
import requests

from common.store import worker_key
from support import wait_until


def _worker_stats(stack) -> dict:
    r = redis.Redis.from_url(stack["redis"].url, decode_responses=True)
    return r.hgetall(worker_key(stack["worker"].hostname))


def _job(url, seq_id):
    return requests.get(f"{url}/v1/jobs/{seq_id}", timeout=10).json()


def test_newcomer_joins_running_batch_and_leaves_first(stack):
    url = stack["url"]
    before = int(_worker_stats(stack).get("num_joined_running_batch", 0))
    long = requests.post(f"{url}/v1/jobs", json={"prompt": "a long story", "max_tokens": 400,
                                                 "ignore_eos": True, "temperature": 0},
                         timeout=10).json()
    # Wait (on its own progress) until the long sequence is decoding.
    wait_until(lambda: _job(url, long["id"])["usage"]["completion_tokens"] >= 3, 60,
               "the long sequence to produce tokens")
    short = requests.post(f"{url}/v1/generate", json={"prompt": "hi", "max_tokens": 4,
                                                      "ignore_eos": True, "temperature": 0},
                          timeout=60).json()
    assert short["status"] == "succeeded" and short["usage"]["completion_tokens"] == 4
    # The short one finished while the long one is still being generated: it did not wait
    # for the batch to drain (static batching would have made it wait ~400 steps).
    long_now = _job(url, long["id"])
    assert long_now["status"] == "running", long_now
    assert long_now["usage"]["completion_tokens"] < 400
    # And the engine counted a prefill into a batch that was already decoding.
    wait_until(lambda: int(_worker_stats(stack).get("num_joined_running_batch", 0)) > before,
               10, "the worker's heartbeat to count the join")
    requests.delete(f"{url}/v1/jobs/{long['id']}", timeout=10)
    wait_until(lambda: _job(url, long["id"])["status"] == "cancelled", 30, "the cancel")
