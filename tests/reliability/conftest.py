"""Fixtures of the fault tests: one fresh world (redis-server, workers, API) per test."""
from __future__ import annotations

import pytest

from .factories import World


@pytest.fixture
def world(tmp_path, tiny_model_dir):
    """A World with its own redis-server already running; everything it started is stopped
    afterwards, whatever the test did to it."""
    w = World(tmp_path, tiny_model_dir)
    try:
        w.start_redis()
        yield w
    finally:
        w.close()


@pytest.fixture
def aof_world(tmp_path, tiny_model_dir):
    """A World whose redis-server writes an append-only file (survives a restart)."""
    w = World(tmp_path, tiny_model_dir)
    try:
        w.start_redis(appendonly=True)
        yield w
    finally:
        w.close()
