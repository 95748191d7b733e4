"""A batch of 1,000 lines survives its worker's death: the worker that drives the batch (and runs
its lines) is killed mid-batch (SIGKILL, with its model process) and started again under its
name; the batch completes with every line answered exactly once, none lost, none repeated.
"""
from __future__ import annotations

import json

import pytest

from common.batch_store import line_seq_id
from support import wait_until

from .factories import kill_hard

import openai  # noqa: E402 - required (requirements-dev.txt): never a skip

pytestmark = [pytest.mark.slow, pytest.mark.integration]

N = 1000


def test_a_1000_line_batch_loses_and_repeats_nothing_when_its_worker_is_killed(world):
    w1 = world.worker("w1", LLMQ_MAX_NUM_SEQS="32")
    api = world.api()
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Number {i} is", "max_tokens": 3, "temperature": 0}}
             for i in range(N)]
    f = client.files.create(file=("big.jsonl", "".join(json.dumps(x) + "\n" for x in lines)
                                  .encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                  completion_window="24h")

    # request_counts is live: kill once a good part is answered and the rest is not.
    def partly_done():
        counts = client.batches.retrieve(batch.id).request_counts
        return counts if N // 4 <= counts.completed < N // 2 else None

    before = wait_until(partly_done, 300, "a quarter of the batch answered", interval=0.05)
    kill_hard(w1)
    assert client.batches.retrieve(batch.id).status == "in_progress"

    world.worker("w1", LLMQ_MAX_NUM_SEQS="32")   # the same name comes back
    def ended():
        b = client.batches.retrieve(batch.id)
        return b if b.status not in ("validating", "in_progress", "finalizing") else None
    done = wait_until(ended, 600, "the batch to end", interval=0.5)

    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (N, N, 0)
    assert done.error_file_id is None
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
    for x in out:
        index = int(x["custom_id"].split("-")[1])
        # Each line ran as its own sequence, the one derived from its index: never a second.
        assert x["response"]["status_code"] == 200
        assert x["response"]["request_id"] == line_seq_id(batch.id, index)
        assert x["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert before.completed >= N // 4
