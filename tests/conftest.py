"""Shared fixtures: real redis-server, tiny random model, real Celery worker, real HTTP app."""
from __future__ import annotations

import os

# The harness installs the test hooks (common/test_hooks.py: LLMQ_TEST_STEP_DELAY, _STALL_AT,
# _FAIL_SEED) for every process a test starts; a product process never reads them.
os.environ["LLMQ_TEST_HOOKS"] = "1"

import lupa  # noqa: F401 - fakeredis's Lua (requirements-dev.txt): missing, it fails, not skips
import pytest

from support import (FAIL_ENV, ApiServer, RedisServer, WorkerProcess, backend_params,
                     backend_worker, build_tiny_model, min_step_env, public_model_name)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server):
    import redis

    # db 1: the shared stack (worker queue, heartbeats) lives in db 0 and must not be flushed.
    client = redis.Redis(port=redis_server.port, db=1, decode_responses=True)
    client.flushdb()
    return client


# --- models -----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The converted default model (SmolLM2-135M-Instruct); converts it once if needed."""
    from worker.model_manager import ModelManager

    return ModelManager().resolve()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_vllm_model_dir(tmp_path_factory, default_model_dir) -> str:
    """The tiny random model with 64-wide heads (vLLM's CPU attention has no kernel for 16)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-vllm-model"), default_model_dir,
                            head_dim=64)


@pytest.fixture(scope="session", params=backend_params())
def stack(request, tmp_path_factory, redis_server):
    """Redis + one real Celery worker + the HTTP API, once per backend present, shared by the
    integration and browser tests. `transformers` runs the tiny random model (fast);
    `llama_cpp` runs the default model's own GGUF (llama.cpp cannot load a transformers
    checkpoint) and is skipped, with the reason shown, without llama-cpp-python."""
    from common.settings import Settings

    backend = request.param
    logs = tmp_path_factory.mktemp(f"logs-{backend}")
    model, env = backend_worker(backend, request)
    # Tests act on "long" jobs (400 tokens) while they run: steps of at least 5 ms make one
    # last >= 2 s on any machine, far longer than the few requests a test makes meanwhile.
    env = {**min_step_env(0.005), **FAIL_ENV, **env}
    worker = WorkerProcess(redis_server.url, model, logs / "worker.log", extra_env=env).start()
    api = ApiServer(Settings.from_env(redis_url=redis_server.url, model=model,
                                      sse_keepalive_s=1.0)).start()
    yield {"redis": redis_server, "worker": worker, "api": api, "url": api.url,
           "backend": backend, "model": public_model_name(model)}
    api.stop()
    worker.stop()
