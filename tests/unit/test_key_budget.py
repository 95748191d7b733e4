"""What a key's requests cost the API itself is charged to that key (issue 48): past its
budget of refused bodies a minute, its requests with a body are a 429 before the body is read;
past its budget of grammar compile seconds, its new grammars are a 429 before they compile.
Neither touches another key."""
from __future__ import annotations

import uuid

import pytest

from .test_api_unit import Api
from .test_request_bounds import compiles  # noqa: F401 - a fixture

A, B = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
JOB = {"prompt": "x", "max_tokens": 4}
BAD = {**JOB, "stop_token_ids": list(range(9))}   # past the cap of 8


class UnreadableBody:
    """A 1.4 MB request body that fails the test if anything reads it."""

    SIZE = 1_400_000

    def __init__(self):
        self.pos = 0

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = self.SIZE if whence == 2 else offset
        return self.pos

    def read(self, *_args):
        raise AssertionError("the body was read")

    readline = read


@pytest.fixture(scope="module")
def _api():
    return Api(api_keys=("ka", "kb"), key_max_refusals=3, max_stop_token_ids=8)


@pytest.fixture
def api(_api):
    return _api.reset()


def unread_post(api, headers, path="/v1/jobs"):
    return api.client.post(path, input_stream=UnreadableBody(),
                           content_type="application/json", headers=headers)


def test_a_key_past_its_refusals_gets_429_before_its_body_is_read(api):
    for _ in range(3):
        resp = api.client.post("/v1/jobs", json=BAD, headers=A)
        assert resp.status_code == 400, resp.get_data(as_text=True)
    resp = unread_post(api, A)
    assert resp.status_code == 429, resp.get_data(as_text=True)
    err = resp.get_json()["error"]
    assert err["code"] == "too_many_invalid_requests" and "LLMQ_KEY_MAX_REFUSALS" in err["message"]
    assert 1 <= int(resp.headers["Retry-After"]) <= 61
    assert resp.headers["Connection"] == "close"   # the server does not read the body either
    # A valid request of that key too (its body is not read, so nothing tells them apart) ...
    assert api.client.post("/v1/jobs", json=JOB, headers=A).status_code == 429
    assert api.celery.calls == []
    # ... but its reads and cancels, without a body, still answer.
    assert api.client.get("/v1/models", headers=A).status_code == 200
    assert api.client.get("/v1/jobs", headers=A).status_code == 200
    # The other key is untouched.
    assert api.client.post("/v1/jobs", json=JOB, headers=B).status_code == 202
    assert api.client.post("/v1/jobs", json=BAD, headers=B).status_code == 400


def test_only_bad_input_with_a_body_is_charged(api):
    for _ in range(5):
        assert api.client.get("/v1/jobs?limit=0", headers=A).status_code == 400   # no body
        assert api.client.post("/v1/jobs", json=BAD,
                               headers={"Authorization": "Bearer nope"}).status_code == 401
        assert api.client.get(f"/v1/jobs/seq-{'0' * 32}", headers=A).status_code == 404
    assert api.client.post("/v1/jobs", json=JOB, headers=A).status_code == 202
    for status in (413, 415):   # too large, not JSON: bad input too
        data = b"x" * 3_000_000 if status == 413 else b"prompt=x"
        ctype = "application/json" if status == 413 else "application/x-www-form-urlencoded"
        resp = api.client.post("/v1/jobs", data=data, content_type=ctype, headers=A)
        assert resp.status_code == status, resp.get_data(as_text=True)
    assert api.client.post("/v1/jobs", json=BAD, headers=A).status_code == 400
    assert unread_post(api, A).status_code == 429


def test_the_count_is_in_redis_so_every_api_process_sees_it():
    from app import create_app

    from .factories import make_settings
    from .test_api_unit import RecordingCelery

    api = Api(api_keys=("ka",), key_max_refusals=3, max_stop_token_ids=8, owner_secret="s")
    other = create_app(api.app.extensions["llmq"]["settings"], redis_client=api.r,
                       celery=RecordingCelery()).test_client()
    for client in (api.client, other, api.client):
        assert client.post("/v1/jobs", json=BAD, headers=A).status_code == 400
    assert other.post("/v1/jobs", json=JOB, headers=A).status_code == 429


def test_no_budget_when_off_or_without_keys():
    for api in (Api(api_keys=("ka",), key_max_refusals=0, max_stop_token_ids=8),
                Api(key_max_refusals=1, max_stop_token_ids=8)):
        headers = A if api.app.extensions["llmq"]["settings"].api_keys else {}
        for _ in range(4):
            assert api.client.post("/v1/jobs", json=BAD, headers=headers).status_code == 400
        assert api.client.post("/v1/jobs", json=JOB, headers=headers).status_code == 202


def test_a_key_past_its_grammar_seconds_gets_429_before_another_compile(compiles):
    api = Api(api_keys=("ka", "kb"), key_grammar_s=0.001)   # one compile spends it (>= 1 ms)
    run = uuid.uuid4().hex   # the verdicts are kept process-wide: schemas new to this run

    def post(title: str, headers: dict):
        schema = {"type": "object", "title": run + title}
        return api.client.post("/v1/jobs", headers=headers, json={**JOB, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})

    assert post("first", A).status_code == 202
    resp = post("second", A)
    assert resp.status_code == 429, resp.get_data(as_text=True)
    err = resp.get_json()["error"]
    assert err["code"] == "grammar_budget_exceeded" and "LLMQ_KEY_GRAMMAR_SECONDS" in err["message"]
    assert 1 <= int(resp.headers["Retry-After"]) <= 61
    assert post("first", A).status_code == 202    # a kept verdict costs nothing
    assert post("second", B).status_code == 202   # the other key's budget is its own
    assert [spec["value"]["title"] for spec in compiles] == [run + "first", run + "second"]
