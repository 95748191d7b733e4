"""A background Responses API response outlives its worker (SIGKILL, with its model process)
and the API that accepted it (stopped; another one, with nothing in memory, answers): it
completes exactly once, and its event stream, read again from the new API, starts with the
very events a client saw before the crash, numbered the same."""
from __future__ import annotations

import openai
import pytest

from support import wait_until

from .factories import kill_hard, record, running_with_tokens, stream_kinds

pytestmark = [pytest.mark.slow, pytest.mark.integration]

MIN_STEP_S = 0.05   # 60 tokens last >= 3 s: the kill lands mid-run on any machine


def sdk(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_background_response_survives_its_worker_and_its_api(world):
    w1 = world.worker("w1", min_step_s=MIN_STEP_S)
    api, r = world.api(), world.client()
    client = sdk(api)
    resp = client.responses.create(input="Once upon a time", background=True,
                                   max_output_tokens=60, temperature=0)
    seq_id = "seq-" + resp.id.removeprefix("resp_")
    wait_until(lambda: running_with_tokens(r, [seq_id], 5), 60, "the response to be running")
    seen = []
    stream = client.responses.retrieve(resp.id, stream=True)
    for event in stream:
        seen.append(event.to_dict())
        if len(seen) == 8:
            break
    stream.close()

    kill_hard(w1)
    world.apis[-1].stop()
    client = sdk(world.api())                # another API process's app: only Redis remembers
    world.worker("w1")                        # the same name comes back, takes its leftovers

    def finished():
        got = client.responses.retrieve(resp.id)
        return got if got.status not in ("queued", "in_progress") else None

    final = wait_until(finished, 120, "the response to finish", interval=0.1)
    assert final.status in ("completed", "incomplete"), final
    assert record(r, seq_id)["attempts"] == "2"
    kinds = stream_kinds(r, seq_id)
    assert kinds.count("reset") == 1 and kinds.count("done") == 1, kinds
    full = [e.to_dict() for e in client.responses.retrieve(resp.id, stream=True)]
    assert full[:len(seen)] == seen
    assert [e["sequence_number"] for e in full] == list(range(len(full)))
    assert "error" not in [e["type"] for e in full]   # greedy: the re-run repeats the text
    deltas = "".join(e["delta"] for e in full if e["type"] == "response.output_text.delta")
    assert deltas == final.output_text
