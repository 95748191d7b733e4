"""Without API keys on a loopback bind, the API answers only requests that name it locally
(app/auth.py `_refuse_foreign_names`): a web page on this machine can otherwise read its
jobs through DNS rebinding (Host: attacker.example, resolving to 127.0.0.1) and post jobs with
a cross-site form (an Origin header, no preflight)."""
from __future__ import annotations

import pytest

from .test_api_unit import Api, assert_error


JOB = {"prompt": "private"}


@pytest.fixture(scope="module")
def local():
    return Api()


@pytest.mark.parametrize("headers", [
    {"Host": "attacker.example:8000"},                                   # DNS rebinding
    {"Host": "127.0.0.1:8000", "Origin": "https://attacker.example"},   # a cross-site form
    {"Host": "localhost", "Origin": "null"},                            # a sandboxed page
])
def test_a_foreign_name_gets_403_and_reaches_nothing(local, headers):
    local.reset()
    for method, path in [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/models"),
                         ("GET", "/metrics")]:
        resp = local.client.open(path, method=method, json=JOB, headers=headers)
        assert_error(resp, 403, "permission_error")
        assert resp.get_json()["error"]["code"] == "host_not_allowed"
    assert local.celery.calls == []


@pytest.mark.parametrize("headers", [
    {"Host": "127.0.0.1:8000"}, {"Host": "localhost:8000"}, {"Host": "[::1]:8000"},
    {"Host": "app.localhost"},
    {"Host": "127.0.0.1:8000", "Origin": "http://127.0.0.1:8000"},     # the playground
])
def test_local_names_are_answered(local, headers):
    local.reset()
    assert local.client.post("/v1/jobs", json=JOB, headers=headers).status_code == 202


def test_health_routes_answer_any_name(local):
    """Probes from a container platform name the API by its address."""
    assert local.client.get("/healthz", headers={"Host": "10.0.0.5:8000"}).status_code == 200


@pytest.mark.parametrize("settings", [
    {"allowed_hosts": ("llmq.internal",)}, {"allowed_hosts": ("*",)},
    {"host": "0.0.0.0"},                  # an open API on every interface: the operator's choice
    {"api_keys": ("k1",)},                # a key is what a page cannot send
])
def test_listed_names_an_open_bind_or_keys_lift_the_check(settings):
    api = Api(**settings)
    headers = {"Host": "llmq.internal", "Origin": "http://llmq.internal",
               "Authorization": "Bearer k1"}
    assert api.client.post("/v1/jobs", json=JOB, headers=headers).status_code == 202
