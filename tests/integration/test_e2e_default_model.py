"""End to end on the real default model (SmolLM2-135M-Instruct): a question it knows."""
from __future__ import annotations

import pytest

from support import VLLM_TEST_ENV, ApiServer, WorkerProcess, backend_params
from llmq_client import generate, get_job
from sse import read_stream

pytestmark = [pytest.mark.slow, pytest.mark.integration]

QUEUE = "llmq-e2e"   # its own queue: the tiny stack's worker must not take these sequences

def question(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0}


# llama.cpp runs the Q4_1 weights with 8-bit activations; on "What is the capital of France?"
# that small model drifts into French and never stops (llama.cpp's own Llama.generate gives the
# same tokens), while "Which city is the capital of France?" it answers as transformers does.
QUESTIONS = {"transformers": question("What is the capital of France?"),
             "llama_cpp": question("Which city is the capital of France?"),
             "vllm": question("What is the capital of France?")}


@pytest.fixture(scope="module", params=backend_params())
def default_stack(request, tmp_path_factory, redis_server, default_model_dir):
    """The default model: its converted checkpoint on transformers and vLLM (float32), its GGUF
    on llama.cpp."""
    from common.settings import Settings

    logs = tmp_path_factory.mktemp("e2e-logs")
    env = {"LLMQ_QUEUE": QUEUE, "LLMQ_BACKEND": request.param,
           **(VLLM_TEST_ENV if request.param == "vllm" else {})}
    model = default_model_dir if request.param == "transformers" else "smollm2"
    worker = WorkerProcess(redis_server.url, model, logs / "worker.log", name="e2e",
                           extra_env=env).start(wait_ready=False)
    try:
        # vLLM compiles the model at each start: minutes on a busy 2-core machine
        worker.wait_ready(timeout_s=600 if request.param == "vllm" else 300)
        api = ApiServer(Settings.from_env(redis_url=redis_server.url, model=model,
                                          queue=QUEUE, sse_keepalive_s=1.0)).start()
    except BaseException:
        worker.stop()
        raise
    yield {"url": api.url, "worker": worker, "question": QUESTIONS[request.param]}
    api.stop()
    worker.stop()


def test_default_model_answers_paris(default_stack):
    url, q = default_stack["url"], default_stack["question"]
    job = generate(url, **q)
    assert job["status"] == "succeeded", job
    assert "Paris" in job["text"], job["text"]
    assert job["finish_reason"] == "stop"   # the model ended its answer itself (EOS)
    assert 0 < job["usage"]["completion_tokens"] < 256

    stream = read_stream(url + "/v1/generate", method="POST", json={**q, "stream": True},
                         timeout=300)
    texts = [e.json["text"] for e in stream.tokens]
    final = stream.done.json
    assert "".join(texts) == final["text"] == job["text"]
    assert final["finish_reason"] == "stop"
    assert get_job(url, final["id"]) == final
