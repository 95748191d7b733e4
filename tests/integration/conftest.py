"""Fixtures of the OpenAI-route tests: the official `openai` client on the shared stack."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def client(stack):
    import openai  # noqa: E402 - required (requirements-dev.txt): never a skip
    return openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(stack) -> str:
    # The public name of a model served from a local folder is the folder's name.
    return stack["model"]
