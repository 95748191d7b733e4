"""Requests that cannot be served as asked, mixed with ones that can: each bad one ends alone,
with a clear error or its documented finish reason, and the batch around it is untouched.

These faults do not harm the worker, so the tests share one world (one redis-server, one worker,
one API) built for this module: a worker start costs ~10 s of CPU.
"""
from __future__ import annotations

import pytest

from support import FAIL_SEED, wait_until

from .factories import SLACK_S, World, assert_all_succeeded_once, stream_kinds, worker_info

pytestmark = [pytest.mark.slow, pytest.mark.integration]

CONTEXT = 512          # the tiny model's max_position_embeddings
OK = {"max_tokens": 20, "ignore_eos": True, "temperature": 0}
MIN_STEP_S = 0.02


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_model_dir):
    w = World(tmp_path_factory.mktemp("bad-requests"), tiny_model_dir)
    try:
        w.start_redis()
        # Each step lasts at least MIN_STEP_S: 400 tokens take >= 8 s, far past a 0.5 s
        # timeout, on any machine.
        worker = w.worker("w1", min_step_s=MIN_STEP_S)
        yield w, worker, w.api()
    finally:
        w.close()


def _model_starts(world, worker) -> str:
    return worker_info(world.client(), worker.hostname).get("model_starts")


def test_prompt_longer_than_the_context_fails_alone_with_a_clear_error(live):
    world, worker, api = live
    r = world.client()
    starts = _model_starts(world, worker)
    poison = " ".join(["hello"] * 700)             # 700 tokens: past the 512 positions
    # The API counts the tokens and refuses the batch before anything is queued ...
    refused = api.request("POST", "/v1/jobs", json={"prompts": ["Short one", poison], **OK})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    # ... and an API that cannot see the model's files (a hub id it has not cached) leaves it
    # to the worker, which refuses it at admission: it fails alone.
    blind = world.api(model="llmq-tests/not-a-local-model")
    jobs = blind.submit_many(["Short one", poison, "Another short one"], **OK)
    bad, good = jobs[1]["id"], [jobs[0]["id"], jobs[2]["id"]]

    failed = api.wait_job(bad, 60)
    assert failed["status"] == "failed" and failed["finish_reason"] == "error", failed
    message = failed["error"]["message"]
    assert "context" in message and str(CONTEXT) in message and "700" in message, message
    assert failed["error"]["code"] == "context_length_exceeded"
    assert failed["text"] == "" and failed["usage"]["completion_tokens"] == 0
    assert stream_kinds(r, bad) == ["done"]        # no tokens, one done event

    assert_all_succeeded_once(api, r, good, OK["max_tokens"])
    assert worker.proc.poll() is None and _model_starts(world, worker) == starts


def test_prompt_that_nearly_fills_the_context_stops_at_its_end(live):
    world, _worker, api = live
    prompt = " ".join(["hello"] * 470)
    # An explicit max_tokens that does not fit beside the prompt is refused (as vLLM does) ...
    refused = api.request("POST", "/v1/jobs", json={"prompt": prompt, "max_tokens": 200})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    job = api.submit(prompt=prompt, ignore_eos=True)
    final = api.wait_job(job["id"], 60)
    used = final["usage"]
    assert used["prompt_tokens"] == 470, final
    # ... an unset one (the default, 256) is cut to the room left: it ends at the last position.
    assert final["status"] == "succeeded" and final["finish_reason"] == "length", final
    assert used["completion_tokens"] == CONTEXT - 470 and used["total_tokens"] == CONTEXT


def test_input_that_breaks_sampling_in_the_model_process_fails_alone(live):
    world, worker, api = live
    r = world.client()
    starts = _model_starts(world, worker)
    good = [j["id"] for j in api.submit_many(["One", "Two", "Three"], max_tokens=40,
                                             ignore_eos=True, temperature=0)]
    # The test workers' sampling fails on this seed (LLMQ_TEST_FAIL_SEED): no input breaks it
    # any more (a stop id past the vocabulary did; it is now a 400 at admission, below).
    bad = api.submit(prompt="Four", max_tokens=40, seed=FAIL_SEED, temperature=1.0)
    failed = api.wait_job(bad["id"], 60)
    assert failed["status"] == "failed" and failed["finish_reason"] == "error", failed
    assert "injected" in failed["error"]["message"], failed["error"]
    assert stream_kinds(r, bad["id"])[-1] == "done"
    assert_all_succeeded_once(api, r, good, 40)
    # The model process reported the error for that sequence; it did not crash or restart.
    assert _model_starts(world, worker) == starts and worker.proc.poll() is None
    again = api.wait_job(api.submit(prompt="Five", **OK)["id"], 60)
    assert again["status"] == "succeeded"
    # A stop token id past the vocabulary made the sampler index outside the logits while
    # min_tokens masked it (a 500): now the worker refuses it as bad input, as vLLM does.
    oov = api.submit(prompt="Six", max_tokens=40, min_tokens=5, stop_token_ids=[2**31 - 1])
    refused = api.wait_job(oov["id"], 60)
    assert refused["error"]["code"] == "invalid_sampling_params", refused


TIMEOUT_S = 0.5


def test_request_timeout_ends_a_long_sequence_with_finish_reason_timeout(live):
    world, _worker, api = live
    r = world.client()
    job = api.submit(prompt="Go on and on", max_tokens=400, ignore_eos=True, temperature=0,
                     timeout=TIMEOUT_S)
    reader = api.stream(job["id"])
    final = api.wait_job(job["id"], 60)
    assert final["status"] == "cancelled" and final["finish_reason"] == "timeout", final
    assert final["error"] is None
    # It stopped at its deadline, far from its 400 tokens, keeping what it had streamed.
    took = final["finished_at"] - final["created_at"]
    assert TIMEOUT_S <= took <= TIMEOUT_S + SLACK_S, took
    assert final["usage"]["completion_tokens"] < 400
    stream = reader.result(30)
    assert stream.kinds.count("done") == 1 and stream.done == final
    assert stream.texts_after_last_reset() == final["text"]
    # The worker is free again: its batch is empty.
    wait_until(lambda: worker_info(r, _worker.hostname).get("running") == "0", 30,
               "the timed-out sequence to leave the batch")
