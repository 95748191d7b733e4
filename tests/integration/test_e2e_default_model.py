"""End to end on the real default model (SmolLM2-135M-Instruct): a question it knows."""
from __future__ import annotations

import openai  # noqa: E402 - required (requirements-dev.txt): never a skip
import pytest
from pydantic import BaseModel

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


class City(BaseModel):
    name: str
    population: int


def test_a_strict_schema_and_a_tool_call_close_on_the_default_model(default_stack):
    """The SDK's parse() with a strict model: the model would add a key the schema forbids
    and, refused, printed digits of `population` to max_tokens; bounded to int64's digits,
    the object closes. A named tool call's arguments validate the same way."""
    client = openai.OpenAI(base_url=default_stack["url"] + "/v1", api_key="unused",
                           max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Give the name and population of Paris as JSON."}]
    completion = client.chat.completions.parse(model=model, messages=ask, response_format=City,
                                               max_tokens=200, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
    tool = {"type": "function", "function": {
        "name": "record_city", "parameters": {**City.model_json_schema(),
                                              "additionalProperties": False}}}
    resp = client.chat.completions.create(
        model=model, messages=ask, tools=[tool], max_tokens=200, temperature=0,
        tool_choice={"type": "function", "function": {"name": "record_city"}})
    [call] = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "tool_calls"
    City.model_validate_json(call.function.arguments)
