"""Sequences join a running batch and leave it early: proven from the engine's own counters."""
import re

import pytest
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


def test_step_timing_accounts_for_the_steps(stack):
    """The engine's StepTiming totals (what `make bench` splits a level's time with) move with
    the work: each step adds its wall time, of which the model's own compute is a part."""
    url = stack["url"]
    start = _worker_stats(stack)
    job = requests.post(f"{url}/v1/generate", json={"prompt": "count with me", "max_tokens": 6,
                                                    "ignore_eos": True, "temperature": 0},
                        timeout=120).json()
    assert job["usage"]["completion_tokens"] == 6

    # Not "one step per token": multi-step decode runs several passes in one step where a pass
    # is short (llama.cpp at one sequence on a fast CPU: 6 tokens in 3 steps). The job took a
    # prefill step and at least one decode step; a heartbeat can carry its finish a moment
    # before its last step's timing, so it waits for both.
    def moved():
        now = _worker_stats(stack)
        done = int(now["num_finished"]) > int(start["num_finished"])
        return now if done and int(now["timing_steps"]) >= int(start["timing_steps"]) + 2 else None

    now = wait_until(moved, 10, "the heartbeat to carry the step timing")
    d = {k: float(now[k]) - float(start[k]) for k in now if k.startswith("timing_")}
    compute = d["timing_model_prefill_s"] + d["timing_model_decode_s"]
    assert d["timing_model_decode_s"] > 0 and compute > 0
    assert d["timing_step_s"] >= compute * 0.99   # a step's wall time includes its compute
    assert d["timing_host_s"] >= 0 and d["timing_publish_s"] >= 0


def test_a_repeated_prompt_reuses_its_cached_prefix(stack):
    """The second run of a prompt takes its whole blocks from the model process's prefix
    cache (the worker's counters say how many tokens), gives the same greedy text, and shows
    in /metrics; a request with its own cache_salt reuses nothing."""
    if stack["backend"] != "transformers":   # vllm: tests/worker/test_vllm_backend.py
        pytest.skip("llmq's own prefix cache (8-token blocks) is the transformers backend's")
    url = stack["url"]
    body = {"prompt": "Once upon a time, in a quiet village by the sea, there lived an old "
                      "clockmaker who", "max_tokens": 5, "ignore_eos": True, "temperature": 0}

    def run(**extra):
        before = _worker_stats(stack)
        job = requests.post(f"{url}/v1/generate", json={**body, **extra}, timeout=120).json()
        assert job["status"] == "succeeded", job
        # The heartbeat writes every counter at once: once it counts this sequence finished,
        # its prefill counts are in too.
        now = wait_until(lambda: (s := _worker_stats(stack)) and int(s["num_finished"]) > int(
            before["num_finished"]) and s, 10, "the heartbeat to count the sequence")
        cached = int(now["prefix_cached_tokens"]) - int(before["prefix_cached_tokens"])
        prefilled = int(now["prefill_tokens"]) - int(before["prefill_tokens"])
        return job, cached, prefilled

    first, _cached, n = run(cache_salt="first")     # a salt of its own: a cold start
    assert n == first["usage"]["prompt_tokens"] >= 17
    second, cached, n2 = run(cache_salt="first")
    assert n2 == n and cached == (n - 1) // 8 * 8 > 0   # whole 8-token blocks, one token left
    assert second["text"] == first["text"]
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}   # OpenAI's field
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    _job3, cached3, _n3 = run(cache_salt="someone else")
    assert cached3 == 0
    metrics = requests.get(f"{url}/metrics", timeout=10).text
    counted = re.search(r"^llmq_prompt_tokens_cached_total (\S+)$", metrics, re.M)
    assert counted and float(counted.group(1)) >= cached
