"""End to end on the real default model (SmolLM2-135M-Instruct): a question it knows."""
from __future__ import annotations

import pytest

from support import ApiServer, WorkerProcess
from llmq_client import generate, get_job
from sse import read_stream

pytestmark = [pytest.mark.slow, pytest.mark.integration]

QUEUE = "llmq-e2e"   # its own queue: the tiny stack's worker must not take these sequences
QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0}


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory, redis_server, default_model_dir):
    from common.settings import Settings

    logs = tmp_path_factory.mktemp("e2e-logs")
    worker = WorkerProcess(redis_server.url, default_model_dir, logs / "worker.log", name="e2e",
                           extra_env={"LLMQ_QUEUE": QUEUE}).start(wait_ready=False)
    try:
        worker.wait_ready(timeout_s=300)
        api = ApiServer(Settings.from_env(redis_url=redis_server.url, model=default_model_dir,
                                          queue=QUEUE, sse_keepalive_s=1.0)).start()
    except BaseException:
        worker.stop()
        raise
    yield {"url": api.url, "worker": worker}
    api.stop()
    worker.stop()


def test_default_model_answers_paris(default_stack):
    url = default_stack["url"]
    job = generate(url, **QUESTION)
    assert job["status"] == "succeeded", job
    assert "Paris" in job["text"], job["text"]
    assert job["finish_reason"] == "stop"   # the model ended its answer itself (EOS)
    assert 0 < job["usage"]["completion_tokens"] < 256

    stream = read_stream(url + "/v1/generate", method="POST", json={**QUESTION, "stream": True},
                         timeout=300)
    texts = [e.json["text"] for e in stream.tokens]
    final = stream.done.json
    assert "".join(texts) == final["text"] == job["text"]
    assert final["finish_reason"] == "stop"
    assert get_job(url, final["id"]) == final
