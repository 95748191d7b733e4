"""Shared fixtures: real redis-server, tiny random model, real Celery worker, real HTTP app."""
from __future__ import annotations

import pytest

from support import ApiServer, RedisServer, WorkerProcess, build_tiny_model


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
def tiny_stack(tmp_path_factory, redis_server, tiny_model_dir):
    """Redis + one Celery worker on the tiny model + the HTTP API, shared by integration tests."""
    from common.settings import Settings

    logs = tmp_path_factory.mktemp("logs")
    worker = WorkerProcess(redis_server.url, tiny_model_dir, logs / "worker.log").start()
    api = ApiServer(Settings.from_env(redis_url=redis_server.url, model=tiny_model_dir,
                                      sse_keepalive_s=1.0)).start()
    yield {"redis": redis_server, "worker": worker, "api": api, "url": api.url}
    api.stop()
    worker.stop()
