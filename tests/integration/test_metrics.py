"""GET /metrics (Prometheus text, vLLM's metric names) and the OpenAPI document, on the real stack.

The metrics are read as a scraper reads them (prometheus_client's own parser) before and after
a known set of requests; the counters and histogram counts must have moved by exactly what
those requests did. pytest runs tests one at a time, so the only other traffic is what an
earlier test left finishing: the first scrape waits for the worker to be idle and steady.
"""
from __future__ import annotations

from collections import Counter

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from support import wait_until

pytestmark = pytest.mark.integration

HISTOGRAMS = ("llmq_time_to_first_token_seconds", "llmq_e2e_request_latency_seconds",
              "llmq_request_queue_time_seconds", "llmq_time_per_output_token_seconds")
PROMPT = "The quick brown fox"


def scrape(url: str) -> dict[str, object]:
    """{family name: family} from one GET /metrics."""
    r = requests.get(url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families, family: str, sample: str, **labels) -> float:
    matches = [s.value for s in families[family].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (family, sample, labels, families[family].samples)
    return matches[0]


def figures(families) -> dict:
    """The cumulative figures this test compares: counters and histogram counts and sums."""
    out = {"generation_tokens": value(families, "llmq_generation_tokens",
                                      "llmq_generation_tokens_total"),
           "prompt_tokens": value(families, "llmq_prompt_tokens", "llmq_prompt_tokens_total")}
    for s in families["llmq_request_success"].samples:
        out["success:" + s.labels["finished_reason"]] = s.value
    for h in HISTOGRAMS:
        out[h + "_count"] = value(families, h, h + "_count")
        out[h + "_sum"] = value(families, h, h + "_sum")
    return out


def worker_gauge(families, name: str, worker: str) -> float:
    return value(families, name, name, worker=worker)


def idle_and_steady(url: str, worker: str):
    """A scrape taken once the worker runs nothing, the queue is empty, and the figures no
    longer move (a sequence's figures are recorded just after its result is published)."""
    last = {}

    def check():
        fams = scrape(url)
        idle = (worker_gauge(fams, "llmq_num_requests_running", worker) == 0
                and worker_gauge(fams, "llmq_num_requests_waiting", worker) == 0
                and value(fams, "llmq_queue_depth", "llmq_queue_depth") == 0)
        now = figures(fams)
        steady, last["figures"] = idle and now == last.get("figures"), now
        return fams if steady else None

    return wait_until(check, 60, "the worker to be idle and the metrics steady", interval=0.3)


def delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after.keys() | before.keys()}


def test_metrics_move_by_exactly_what_the_requests_did(stack):
    url, worker = stack["url"], stack["worker"].hostname
    before_fams = idle_and_steady(url, worker)
    before = figures(before_fams)

    seqs: list[tuple[str, int]] = []   # (finish reason, completion tokens) per sequence
    prompt_tokens = 0

    def openai_request(path: str, body: dict) -> dict:
        nonlocal prompt_tokens
        r = requests.post(url + path, json={"temperature": 0, "ignore_eos": True, **body},
                          timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        prompt_tokens += out["usage"]["prompt_tokens"]
        return out

    # Two prompts that run to max_tokens, a chat completion, a completion a stop string ends.
    two = openai_request("/v1/completions", {"prompt": [PROMPT, "Hello"], "max_tokens": 5})
    assert [c["finish_reason"] for c in two["choices"]] == ["length", "length"]
    assert two["usage"]["completion_tokens"] == 10
    seqs += [("length", 5), ("length", 5)]
    chat = openai_request("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert chat["choices"][0]["finish_reason"] == "length"
    seqs.append(("length", chat["usage"]["completion_tokens"]))
    stop = two["choices"][0]["text"][1:3]
    stopped = openai_request("/v1/completions", {"prompt": PROMPT, "max_tokens": 5,
                                                 "stop": [stop]})
    assert stopped["choices"][0]["finish_reason"] == "stop", stopped
    seqs.append(("stop", stopped["usage"]["completion_tokens"]))

    # A long job, seen in the running gauge, then cancelled: cancelled sequences count too.
    r = requests.post(url + "/v1/jobs", json={"prompt": PROMPT, "max_tokens": 400,
                                             "temperature": 0, "ignore_eos": True}, timeout=10)
    long_id = r.json()["id"]
    wait_until(lambda: worker_gauge(scrape(url), "llmq_num_requests_running", worker) == 1,
               60, "the running gauge to show the long job")
    wait_until(lambda: requests.get(f"{url}/v1/jobs/{long_id}", timeout=10).json()["usage"]
               ["completion_tokens"] >= 2, 60, "the long job to decode")
    assert requests.delete(f"{url}/v1/jobs/{long_id}", timeout=10).status_code == 200
    cancelled = wait_until(
        lambda: (j := requests.get(f"{url}/v1/jobs/{long_id}", timeout=10).json())["status"]
        == "cancelled" and j, 60, "the long job to be cancelled")
    prompt_tokens += cancelled["usage"]["prompt_tokens"]
    seqs.append(("cancelled", cancelled["usage"]["completion_tokens"]))

    after_fams = idle_and_steady(url, worker)
    d = delta(figures(after_fams), before)
    assert d["generation_tokens"] == sum(n for _, n in seqs)
    assert d["prompt_tokens"] == prompt_tokens
    assert {k.removeprefix("success:"): v for k, v in d.items()
            if k.startswith("success:") and v} == dict(Counter(r for r, _ in seqs))
    # Every sequence waited in the queue and ended; each that produced a token has a
    # first-token time, and each with two or more an inter-token time.
    assert d["llmq_request_queue_time_seconds_count"] == len(seqs)
    assert d["llmq_e2e_request_latency_seconds_count"] == len(seqs)
    assert d["llmq_time_to_first_token_seconds_count"] == sum(1 for _, n in seqs if n >= 1)
    assert d["llmq_time_per_output_token_seconds_count"] == sum(1 for _, n in seqs if n >= 2)
    assert d["llmq_e2e_request_latency_seconds_sum"] > 0
    assert d["llmq_time_to_first_token_seconds_sum"] > 0
    assert d["llmq_time_per_output_token_seconds_sum"] > 0

    # Histograms are well formed: cumulative buckets ending in +Inf == _count.
    for h in HISTOGRAMS:
        buckets = [(s.labels["le"], s.value) for s in after_fams[h].samples
                   if s.name == h + "_bucket"]
        assert buckets[-1][0] == "+Inf"
        assert buckets[-1][1] == value(after_fams, h, h + "_count")
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)
        assert after_fams[h].type == "histogram"


def test_gauges_are_exported(stack):
    url, worker = stack["url"], stack["worker"].hostname
    fams = idle_and_steady(url, worker)
    for name in ("llmq_num_requests_running", "llmq_num_requests_waiting", "llmq_queue_depth",
                 "llmq_workers_ready"):
        assert fams[name].type == "gauge", name
    # One sample per live worker, labelled with its name; this stack's worker is idle.
    assert worker_gauge(fams, "llmq_num_requests_running", worker) == 0
    assert worker_gauge(fams, "llmq_num_requests_waiting", worker) == 0
    assert value(fams, "llmq_queue_depth", "llmq_queue_depth") == 0
    assert value(fams, "llmq_workers_ready", "llmq_workers_ready") >= 1
    for name in ("llmq_generation_tokens", "llmq_prompt_tokens", "llmq_request_success"):
        assert fams[name].type == "counter", name


# --- OpenAPI ----------------------------------------------------------------------------------
ROUTES = {
    "/v1/jobs": {"post"},
    "/v1/jobs/{seq_id}": {"get", "delete"},
    "/v1/jobs/{seq_id}/stream": {"get"},
    "/v1/generate": {"post"},
    "/v1/completions": {"post"},
    "/v1/chat/completions": {"post"},
    "/v1/models": {"get"},
    "/health": {"get"},
    "/healthz": {"get"},
    "/readyz": {"get"},
    "/metrics": {"get"},
    "/v1/responses": {"post"},
    "/v1/responses/{resp_id}": {"get", "delete"},
    "/v1/responses/{resp_id}/cancel": {"post"},
    "/v1/responses/{resp_id}/input_items": {"get"},
    "/tokenize": {"post"},
    "/detokenize": {"post"},
}


@pytest.fixture(scope="module")
def openapi_doc(stack) -> dict:
    r = requests.get(stack["url"] + "/openapi.json", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _resolve(doc: dict, schema: dict) -> dict:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    assert ref.startswith("#/components/schemas/"), ref
    return doc["components"]["schemas"][ref.removeprefix("#/components/schemas/")]


def test_openapi_documents_every_route(openapi_doc):
    assert openapi_doc["openapi"].startswith("3.")
    assert openapi_doc["info"]["title"] == "llmq"
    for path, methods in ROUTES.items():
        assert path in openapi_doc["paths"], (path, sorted(openapi_doc["paths"]))
        assert methods <= set(openapi_doc["paths"][path]), (path, openapi_doc["paths"][path])
        for method in methods:
            responses = openapi_doc["paths"][path][method]["responses"]
            assert "200" in responses or "202" in responses, (path, method)
            # every route but the health checks needs a key when keys are set
            if path not in ("/health", "/healthz", "/readyz"):
                assert {"401", "403"} <= set(responses), (path, method, sorted(responses))


@pytest.mark.parametrize("path,model_path", [
    ("/v1/jobs", "app.schemas:JobRequest"),
    ("/v1/generate", "app.schemas:JobRequest"),
    ("/v1/completions", "app.openai_api:CompletionRequest"),
    ("/v1/chat/completions", "app.openai_api:ChatCompletionRequest"),
])
def test_openapi_request_bodies_come_from_the_pydantic_models(openapi_doc, path, model_path):
    import importlib

    module, name = model_path.split(":")
    model = getattr(importlib.import_module(module), name)
    body = openapi_doc["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    schema = _resolve(openapi_doc, body["content"]["application/json"]["schema"])
    assert set(schema["properties"]) == set(model.model_fields)
    required = {n for n, f in model.model_fields.items() if f.is_required()}
    assert set(schema.get("required", [])) == required
    # Field constraints travel with the schema (e.g. temperature's range).
    temp = schema["properties"]["temperature"]
    bounds = [s for s in temp.get("anyOf", [temp]) if s.get("type") == "number"]
    assert bounds and bounds[0]["minimum"] == 0.0 and bounds[0]["maximum"] == 2.0


def test_openapi_errors_have_the_one_error_shape(openapi_doc):
    """Bad input is a 400 with {"error": {message, type, param, code}}; the document must not
    promise another shape (spectree's default is a 422 with its own body)."""
    for path, ops in openapi_doc["paths"].items():
        for method, op in ops.items():
            for status, resp in op["responses"].items():
                assert status != "422", (method, path)
                if status.startswith(("4", "5")) and path not in ("/readyz", "/health"):
                    schema = _resolve(openapi_doc,
                                      resp["content"]["application/json"]["schema"])
                    error = _resolve(openapi_doc, schema["properties"]["error"])
                    assert set(error["properties"]) == {"message", "type", "param", "code"}


def test_docs_redirect_to_a_page(stack):
    r = requests.get(stack["url"] + "/docs", allow_redirects=False, timeout=10)
    assert r.status_code in (301, 302, 307, 308)
    page = requests.get(stack["url"] + "/docs", timeout=10)
    assert page.status_code == 200
    assert page.headers["Content-Type"].startswith("text/html")
    assert "openapi.json" in page.text or "swagger" in page.text.lower()
