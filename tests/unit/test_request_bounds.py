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


def test_the_counts_are_refused_before_any_entry_is_validated(api):
    """Issue 48's bodies (200,000 stop ids, a whole-vocabulary bias) are refused on their
    count, before pydantic checks each entry: a bad entry deep inside is never reached."""
    ids = list(range(200_000))
    ids[150_000] = -1
    bias = {str(t): 1 for t in range(49_152)}
    bias["40000"] = 1000
    for path, body in routes(api):
        msg = refused(api.reset(), path, {**body, "stop_token_ids": ids}, "stop_token_ids")
        assert "LLMQ_MAX_STOP_TOKEN_IDS" in msg and "150000" not in msg
        msg = refused(api.reset(), path, {**body, "logit_bias": bias}, "logit_bias")
        assert "300" in msg and "40000" not in msg


@pytest.mark.parametrize("path,field,value", [
    ("/v1/jobs", "logprobs", 21), ("/v1/jobs", "prompt_logprobs", 21),
    ("/v1/completions", "logprobs", 21), ("/v1/chat/completions", "top_logprobs", 21)])
def test_logprob_counts_are_bounded_at_20(api, path, field, value):
    body = dict(next(b for p, b in routes(api) if p == path))
    if field == "top_logprobs":
        body["logprobs"] = True
    refused(api, path, {**body, field: value}, field)


# --- structured output: counts capped before compiling, compiles timed and cached -------------
def schema_routes(api, schema: dict) -> list[tuple[str, dict, str]]:
    """(route, body, the param a refusal names) for each way a JSON schema is given."""
    model = model_of(api)
    return [("/v1/chat/completions", {"model": model, **CHAT, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
             "response_format"),
            ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 4,
                                 "structured_outputs": {"json": schema}}, "structured_outputs"),
            ("/v1/jobs", {"prompt": "x", "max_tokens": 4, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
             "response_format")]


@pytest.fixture
def compiles(monkeypatch):
    """The specs llguidance is asked to compile (the real compile still runs)."""
    from common import structured

    asked, real = [], structured.validate

    def recording(spec):
        asked.append(spec)
        return real(spec)

    monkeypatch.setattr(structured, "validate", recording)
    return asked


@pytest.mark.parametrize("schema,key", [
    # issue 48's 87-byte schema: it passed validation and cost the worker seconds
    ({"type": "array", "minItems": 200000, "items": {"type": "integer"}}, "minItems"),
    ({"type": "array", "maxItems": 200000, "items": {"type": "integer"}}, "maxItems"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 10**6}}},
     "maxLength"),
    ({"anyOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "minProperties": 5000}}]}, "minProperties")])
def test_a_schemas_counts_are_capped_before_any_compile(api, compiles, schema, key):
    for path, body, param in schema_routes(api, schema):
        msg = refused(api.reset(), path, body, param)
        assert key in msg and "LLMQ_MAX_SCHEMA_COUNT" in msg and "4096" in msg
    assert compiles == []   # refused on its counts: llguidance never saw it


def test_a_schema_within_the_cap_compiles_once_however_often_it_is_sent(api, compiles):
    schema = {"type": "array", "maxItems": 4096, "items": {"type": "integer"},
              "title": "test_request_bounds: cached"}
    for path, body, _param in schema_routes(api, schema) * 2:
        resp = api.reset().client.post(path, json={**body, "stream": False})
        assert resp.status_code in (200, 202, 504), (path, resp.get_data(as_text=True))
    assert compiles == [{"type": "json_schema", "value": schema}]


def test_a_grammar_slower_than_the_time_limit_is_refused_and_stays_refused(monkeypatch):
    import threading

    from common import structured

    api = Api(wait_timeout_s=0.05, grammar_timeout_s=1.0)   # (a pool thread starts well within it)
    release, started = threading.Event(), []

    def slow(spec):   # a compile that lasts until the test has its first answer
        started.append(spec)
        release.wait(30)
        return None

    monkeypatch.setattr(structured, "validate", slow)
    schema = {"type": "object", "title": "test_request_bounds: slow"}
    path, body, param = schema_routes(api, schema)[0]
    try:
        msg = refused(api, path, body, param)   # answered at the limit, the compile still on
        assert "LLMQ_GRAMMAR_TIMEOUT" in msg and len(started) == 1
    finally:
        release.set()
    # It compiled in the end, in more than the limit: sent again, it is refused at once.
    msg = refused(api.reset(), path, body, param)
    assert "LLMQ_GRAMMAR_TIMEOUT" in msg and len(started) == 1


def test_a_grammar_that_finds_every_check_thread_busy_is_a_503_not_a_400(monkeypatch):
    """Other requests' compiles hold the pool: the waiting one is not at fault (no 400), and
    its verdict, computed once a thread frees, answers its retry."""
    import threading

    from app.errors import APIError
    from app.grammar_check import GrammarCheck
    from common import structured

    check, release = GrammarCheck(threads=1), threading.Event()
    slow = {"type": "json_schema", "value": {"type": "object", "title": "busy: slow"}}
    mine = {"type": "json_schema", "value": {"type": "object", "title": "busy: mine"}}
    monkeypatch.setattr(structured, "validate", lambda spec: release.wait(30) and None
                        if spec is slow else None)
    try:
        assert "LLMQ_GRAMMAR_TIMEOUT" in check.error(slow, timeout_s=0.1)
        with pytest.raises(APIError) as busy:
            check.error(mine, timeout_s=0.1)
        assert busy.value.status == 503 and busy.value.headers["Retry-After"]
        release.set()
        assert check.error(mine, timeout_s=5) is None
    finally:
        release.set()
