"""Many models behind one endpoint, on fakeredis: LLMQ_MODELS and its aliases as settings, and
the API's routing of a request's `model` to its model's queue (404 unknown, 503 unserved)."""
from __future__ import annotations

import fakeredis
import pytest

from common.settings import Settings

from .factories import RecordingCelery, make_settings

MODELS = ("smollm2", "second=smollm2", "a/b c=/models/coder")


def test_models_parse_with_names_queues_and_the_default_first():
    s = make_settings(models=MODELS, model_aliases=("gpt-4o-mini=second",)).validate()
    assert [(m.name, m.source, m.queue) for m in s.served_models()] == [
        ("SmolLM2-135M-Instruct", "smollm2", "llmq"),      # the default keeps today's queue
        ("second", "smollm2", "llmq.second"),
        ("a/b c", "/models/coder", "llmq.a_b_c")]          # a name safe for Celery and Redis
    assert s.resolve_model(None).name == "SmolLM2-135M-Instruct"
    assert s.resolve_model("gpt-4o-mini").name == "second"
    # A source and the default's hub id name the first model that has them.
    assert s.resolve_model("smollm2").name == "SmolLM2-135M-Instruct"
    assert s.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").queue == "llmq"
    assert s.resolve_model("nope") is None
    worker = s.replace(serve_model="a/b c").validate().for_served_model()
    assert (worker.model, worker.served_model.queue) == ("/models/coder", "llmq.a_b_c")


def test_unset_is_the_one_model_of_llmq_model():
    s = make_settings(model="/models/mine").validate()
    assert [(m.name, m.source, m.queue) for m in s.served_models()] == [
        ("mine", "/models/mine", "llmq")]
    assert s.served_model.name == "mine" and s.for_served_model().model == "/models/mine"


@pytest.mark.parametrize("overrides, says", [
    ({"models": ("a=x", "a=y")}, "names 'a' twice"),
    ({"models": ("=x",)}, "is not `name=source`"),
    ({"models": ("x", "webhooks=y")}, "webhook deliveries"),
    ({"models": ("c=y", "a b=x", "a_b=z")}, "rename it"),
    ({"model_aliases": ("alias",)}, "LLMQ_MODEL_ALIASES"),
    ({"model_aliases": ("alias=nope",)}, "LLMQ_MODEL_ALIASES"),
    ({"models": ("a=x", "b=y"), "model_aliases": ("a=b",)}, "LLMQ_MODEL_ALIASES"),
    ({"models": ("a=x",), "serve_model": "b"}, "LLMQ_SERVE_MODEL"),
])
def test_a_malformed_list_stops_the_process_with_its_reason(overrides, says):
    with pytest.raises(ValueError, match=says):
        make_settings(**overrides).validate()


def test_models_are_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("LLMQ_MODELS", "smollm2, second=smollm2")
    monkeypatch.setenv("LLMQ_SERVE_MODEL", "second")
    s = Settings.from_env()
    assert [m.name for m in s.served_models()] == ["SmolLM2-135M-Instruct", "second"]
    assert s.served_model.queue == "llmq.second"


# --- the API ----------------------------------------------------------------------------------
@pytest.fixture
def api():
    from app import create_app

    r = fakeredis.FakeRedis(decode_responses=True)
    celery = RecordingCelery()
    settings = make_settings(models=("smollm2", "second=smollm2"),
                             model_aliases=("gpt-4o-mini=second",))
    app = create_app(settings, redis_client=r, celery=celery)
    app.testing = True
    store = app.extensions["llmq"]["store"]
    store.heartbeat("w1", {"model_loaded": 1, "max_model_len": 64,
                           "model_name": "SmolLM2-135M-Instruct", "backend": "transformers"}, 60)
    return app.test_client(), celery, store


def test_a_request_goes_to_its_models_queue_and_the_default_without_one(api):
    client, celery, store = api
    store.heartbeat("w2", {"model_loaded": 1, "max_model_len": 32, "model_name": "second",
                           "backend": "llama_cpp"}, 60)
    for body, queue, model in (({}, "llmq", "SmolLM2-135M-Instruct"),
                               ({"model": "second"}, "llmq.second", "second"),
                               ({"model": "gpt-4o-mini"}, "llmq.second", "second")):
        r = client.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2, **body})
        assert r.status_code == 202, r.get_json()
        assert (celery.calls[-1]["queue"], r.get_json()["model"]) == (queue, model)
        assert store.get_record(r.get_json()["id"])["model"] == model
    models = {m["id"]: m for m in client.get("/v1/models").get_json()["data"]}
    assert {k: (m["max_model_len"], m["backend"]) for k, m in models.items()} == {
        "SmolLM2-135M-Instruct": (64, "transformers"), "second": (32, "llama_cpp")}


def test_unknown_is_404_and_a_model_without_a_worker_503(api):
    client, celery, _store = api
    r = client.post("/v1/chat/completions", json={
        "model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert (r.get_json()["error"]["code"], r.get_json()["error"]["param"]) == (
        "model_not_found", "model")
    assert client.post("/v1/jobs", json={"prompt": "hi", "model": "nope"}).status_code == 404
    r = client.post("/v1/jobs", json={"prompt": "hi", "model": "second"})
    assert r.status_code == 503 and r.get_json()["error"]["code"] == "model_not_ready"
    assert int(r.headers["Retry-After"]) > 0
    assert not celery.calls   # nothing queued for a model nobody serves
    assert [m["id"] for m in client.get("/v1/models").get_json()["data"]] == [
        "SmolLM2-135M-Instruct"]
