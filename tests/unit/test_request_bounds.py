"""Per-request bounds on what one sequence makes every step cost (issue 48): stop_token_ids,
logit_bias and the logprob counts are refused up front, as a 400 naming the field, on every
submitting route, before anything is queued."""
from __future__ import annotations

import pytest

from .test_api_unit import Api

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def _api():
    return Api(wait_timeout_s=0.05, max_stop_token_ids=8)


@pytest.fixture
def api(_api):
    return _api.reset()


def model_of(api) -> str:
    return api.client.get("/v1/models").get_json()["data"][0]["id"]


def routes(api) -> list[tuple[str, dict]]:
    model = model_of(api)
    return [("/v1/jobs", {"prompt": "x", "max_tokens": 4}),
            ("/v1/generate", {"prompt": "x", "max_tokens": 4}),
            ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 4}),
            ("/v1/chat/completions", {"model": model, **CHAT})]


def refused(api, path: str, body: dict, param: str) -> str:
    resp = api.client.post(path, json=body)
    assert resp.status_code == 400, resp.get_data(as_text=True)
    err = resp.get_json()["error"]
    assert err["param"] == param, err
    assert api.celery.calls == []   # nothing queued
    return err["message"]


def test_stop_token_ids_are_bounded_by_the_setting_on_every_route(api):
    for path, body in routes(api):
        msg = refused(api.reset(), path, {**body, "stop_token_ids": list(range(9))},
                      "stop_token_ids")
        assert "8" in msg and "LLMQ_MAX_STOP_TOKEN_IDS" in msg
        resp = api.reset().client.post(path, json={**body, "stop_token_ids": list(range(8)),
                                                   "stream": False})
        assert resp.status_code in (200, 202, 504), (path, resp.get_data(as_text=True))


def test_the_default_stop_token_id_cap_is_a_handful_with_margin():
    from common.settings import Settings

    assert Settings().max_stop_token_ids == 64
    assert Settings.from_env(max_stop_token_ids=0).max_stop_token_ids == 0   # none allowed


def test_logit_bias_is_bounded_at_300_entries_as_openai(api):
    for path, body in routes(api):
        msg = refused(api.reset(), path,
                      {**body, "logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias")
        assert "300" in msg
        resp = api.reset().client.post(path, json={
            **body, "logit_bias": {str(t): 1 for t in range(300)}, "stream": False})
        assert resp.status_code in (200, 202, 504), (path, resp.get_data(as_text=True))


@pytest.mark.parametrize("path,field,value", [
    ("/v1/jobs", "logprobs", 21), ("/v1/jobs", "prompt_logprobs", 21),
    ("/v1/completions", "logprobs", 21), ("/v1/chat/completions", "top_logprobs", 21)])
def test_logprob_counts_are_bounded_at_20(api, path, field, value):
    body = dict(next(b for p, b in routes(api) if p == path))
    if field == "top_logprobs":
        body["logprobs"] = True
    refused(api, path, {**body, field: value}, field)
