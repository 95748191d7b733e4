"""What the OpenAI routes make of the fields real clients send (no worker: the stored record's
sampling parameters are what a worker would run): supported, accepted and ignored, refused by
name, unknown; n copies with derived seeds; logprobs, echo and structured output settings."""
from __future__ import annotations

import json
import logging

import pytest

from common.store import record_key

from .test_api_unit import Api


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
DONE = (200, 504)   # queued; nobody runs it here, so a waiting route gives up (504)


@pytest.fixture(scope="module")
def _api():
    return Api(wait_timeout_s=0.05)


@pytest.fixture
def api(_api):
    return _api.reset()


def post(api, path: str, body: dict):
    resp = api.client.post(path, json={**body, "stream": False})
    return resp, [json.loads(api.r.hget(record_key(c["args"][0]), "params"))
                  for c in api.celery.calls]


def refused(resp, param: str, code: str | None = "unsupported_parameter") -> None:
    assert resp.status_code == 400, resp.get_data(as_text=True)
    err = resp.get_json()["error"]
    assert err["param"] == param and err["code"] == code and param in err["message"]


def test_chat_logprobs_and_top_logprobs(api):
    resp, [p] = post(api, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2})
    assert resp.status_code in DONE and p["logprobs"] == 2 and p["prompt_logprobs"] is None
    _, [p] = post(api.reset(), "/v1/chat/completions", {**CHAT, "logprobs": True})
    assert p["logprobs"] == 0
    _, [p] = post(api.reset(), "/v1/chat/completions", CHAT)
    assert p["logprobs"] is None
    resp, calls = post(api.reset(), "/v1/chat/completions", {**CHAT, "top_logprobs": 2})
    refused(resp, "top_logprobs", None)
    assert calls == []
    refused(post(api, "/v1/chat/completions", {**CHAT, "logprobs": True,
                                               "top_logprobs": 21})[0], "top_logprobs", None)


def test_completions_echo_scores_the_prompt(api):
    body = {"prompt": "x y", "echo": True, "logprobs": 1, "max_tokens": 0}
    resp, [p] = post(api, "/v1/completions", body)
    assert resp.status_code in DONE
    assert p["max_tokens"] == 0 and p["logprobs"] == 1 and p["prompt_logprobs"] == 1
    resp, calls = post(api.reset(), "/v1/completions", {"prompt": "x", "max_tokens": 0})
    refused(resp, "max_tokens", None)
    assert calls == []


def test_n_makes_n_sequences_with_derived_seeds(api):
    resp, params = post(api, "/v1/completions", {"prompt": ["a", "b"], "n": 3, "seed": 7,
                                                 "max_tokens": 2})
    assert resp.status_code in DONE and len(params) == 6
    seeds = [p["seed"] for p in params]
    assert seeds[:3] == seeds[3:] and seeds[0] == 7 and len(set(seeds[:3])) == 3
    _, params = post(api.reset(), "/v1/chat/completions", {**CHAT, "n": 2})
    assert [p["seed"] for p in params] == [None, None]   # each draws from its own generator
    refused(post(api.reset(), "/v1/chat/completions", {**CHAT, "n": 0})[0], "n", None)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT),
                                       ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                                       ("/v1/jobs", {"prompt": "x", "max_tokens": 2})])
def test_structured_output_settings(api, path, body):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    resp, [p] = post(api, path, {**body, "response_format": fmt})
    assert resp.status_code in DONE + (202,)
    assert p["structured"] == {"type": "json_schema", "value": schema}
    bad = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}}
    resp, calls = post(api.reset(), path, {**body, "response_format": bad})
    assert resp.status_code == 400 and "nope" in resp.get_json()["error"]["message"]
    assert calls == []
    _, [p] = post(api, path, {**body, "structured_outputs": {"regex": "[a-z]+"}})
    assert p["structured"] == {"type": "regex", "value": "[a-z]+"}


def test_vllm_guided_names_are_structured_outputs(api):
    _, [p] = post(api, "/v1/completions", {"prompt": "x", "guided_choice": ["a", "b"]})
    assert p["structured"] == {"type": "choice", "value": ["a", "b"]}
    resp, _ = post(api.reset(), "/v1/completions", {"prompt": "x", "guided_regex": "[a-"})
    refused(resp, "structured_outputs", None)


def test_ignored_fields_are_accepted_with_a_warning(api, caplog):
    with caplog.at_level(logging.WARNING, logger="llmq.api"):
        resp, [p] = post(api, "/v1/chat/completions", {
            **CHAT, "user": "u", "service_tier": "auto", "chat_template_kwargs": {"x": 1},
            "skip_special_tokens": True, "tools": [], "best_of": 1})
    assert resp.status_code in DONE
    assert "ignored: service_tier, user\n" in caplog.text   # chat_template_kwargs is used


@pytest.mark.parametrize("field,value", [("use_beam_search", True), ("suffix", "z"),
                                         ("include_stop_str_in_output", True),
                                         ("tool_choice", "auto")])
def test_refused_fields_are_named(api, field, value):
    resp, calls = post(api, "/v1/completions", {"prompt": "x", field: value})
    refused(resp, field)
    assert calls == []


def test_best_of_samples_its_candidates_with_the_logprobs_that_rank_them(api):
    _, calls = post(api, "/v1/completions", {"prompt": "x", "n": 2, "best_of": 3, "seed": 1})
    assert len(calls) == 3 and len({p["seed"] for p in calls}) == 3
    assert all(p["logprobs"] == 0 for p in calls)   # the sampled tokens' own, to rank by
    _, calls = post(api.reset(), "/v1/completions", {"prompt": "x", "best_of": 2, "logprobs": 3})
    assert [p["logprobs"] for p in calls] == [3, 3]
    _, [p] = post(api.reset(), "/v1/completions", {"prompt": "x", "best_of": 1})
    assert p["logprobs"] is None   # nothing to rank
    resp, calls = post(api.reset(), "/v1/chat/completions", {**CHAT, "best_of": 2})
    refused(resp, "best_of")   # OpenAI's and vLLM's chat have no best_of
    assert calls == []


def test_unknown_fields_stay_400(api):
    resp, calls = post(api, "/v1/chat/completions", {**CHAT, "frobnicate": 1})
    refused(resp, "frobnicate")
    assert calls == []


def test_penalties_and_logit_bias_reach_the_params(api):
    _, [p] = post(api, "/v1/completions", {"prompt": "x", "presence_penalty": 0.5,
                                           "frequency_penalty": -1, "logit_bias": {"42": 3}})
    assert (p["presence_penalty"], p["frequency_penalty"]) == (0.5, -1)
    assert p["logit_bias"] == {"42": 3}
    refused(post(api.reset(), "/v1/completions",
                 {"prompt": "x", "logit_bias": {"a": 1}})[0], "logit_bias", None)


def test_prompts_of_token_ids(api):
    resp, _ = post(api, "/v1/completions", {"prompt": [[5, 6], [7]], "max_tokens": 1})
    assert resp.status_code in DONE
    assert [json.loads(api.r.hget(record_key(c["args"][0]), "prompt_token_ids"))
            for c in api.celery.calls] == [[5, 6], [7]]
    for bad in ([-1], [], [[]]):
        assert post(api.reset(), "/v1/completions", {"prompt": bad})[0].status_code == 400


def test_jobs_take_logprobs(api):
    resp, [p] = post(api, "/v1/jobs", {"prompt": "x", "logprobs": 3, "prompt_logprobs": 0})
    assert resp.status_code == 202 and p["logprobs"] == 3 and p["prompt_logprobs"] == 0


def test_null_means_the_default_where_openai_and_vllm_allow_it(api):
    """A wrapper that forwards `n=kwargs.get("n")` sends null: n, stream, echo, min_tokens,
    ignore_eos and return_tokens_as_token_ids then take their defaults (they were 400s)."""
    nulls = {"n": None, "stream": None, "min_tokens": None, "ignore_eos": None,
             "return_tokens_as_token_ids": None}
    resp = api.client.post("/v1/chat/completions", json={**CHAT, **nulls})
    assert resp.status_code in DONE, resp.get_data(as_text=True)
    [call] = api.celery.calls
    p = json.loads(api.r.hget(record_key(call["args"][0]), "params"))
    assert p["min_tokens"] == 0 and p["ignore_eos"] is False
    resp = api.reset().client.post("/v1/completions", json={"prompt": "x", "echo": None,
                                                            **nulls})
    assert resp.status_code in DONE, resp.get_data(as_text=True)
    resp = api.reset().client.post("/v1/jobs", json={"prompt": "x", "stream": None,
                                                     "min_tokens": None})
    assert resp.status_code == 202, resp.get_data(as_text=True)
    # null stays refused where no default stands behind it
    resp, calls = post(api.reset(), "/v1/chat/completions", {**CHAT, "messages": None})
    assert resp.status_code == 400 and calls == []


def test_a_negative_seed_is_a_seed(api):
    _, [p] = post(api, "/v1/completions", {"prompt": "x", "seed": -1})
    assert p["seed"] == -1
    _, params = post(api.reset(), "/v1/completions", {"prompt": "x", "seed": -1, "n": 2})
    assert params[0]["seed"] == -1 != params[1]["seed"]   # the first keeps it, as with n 1
    resp, calls = post(api.reset(), "/v1/completions", {"prompt": "x", "seed": -2**63 - 1})
    assert resp.status_code == 400 and calls == []


def test_current_openai_fields_that_change_nothing_are_accepted(api, caplog):
    with caplog.at_level(logging.WARNING, logger="llmq.api"):
        resp, [p] = post(api, "/v1/chat/completions", {
            **CHAT, "prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "low"})
    assert resp.status_code in DONE, resp.get_data(as_text=True)
    assert "prompt_cache_key, safety_identifier, verbosity" in caplog.text
    # (stream_options go with stream only, as OpenAI and vLLM have it)
    resp = api.client.post("/v1/chat/completions", json={
        **CHAT, "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert resp.status_code == 200, resp.get_data(as_text=True)


def test_prompt_logprobs_are_refused_when_streamed_as_vllm_refuses_them(api):
    resp = api.client.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 1,
                                                    "stream": True})
    refused(resp, "prompt_logprobs", None)
    assert api.celery.calls == []


def test_a_model_is_retrieved_by_any_name_a_request_may_give(api):
    listed = api.client.get("/v1/models").get_json()["data"][0]
    for name in (listed["id"], "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        resp = api.client.get(f"/v1/models/{name}")
        assert resp.status_code == 200 and resp.get_json() == listed, name
    resp = api.client.get("/v1/models/gpt-4o")
    assert resp.status_code == 404 and resp.get_json()["error"]["code"] == "model_not_found"
    # vLLM's default served name for the default model is accepted in requests too
    resp, [p] = post(api, "/v1/chat/completions",
                     {**CHAT, "model": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    assert resp.status_code in DONE


@pytest.mark.parametrize("text", [5, None, ["a"]])
def test_a_text_part_without_a_string_is_400_not_500(api, text):
    resp, sent = post(api, "/v1/chat/completions", {
        **CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]})
    assert resp.status_code == 400 and resp.get_json()["error"]["param"] == "messages", resp.json
    assert sent == []


def test_chat_n_counts_against_the_sequences_a_request_may_make():
    """Completions counted prompts x n against LLMQ_MAX_PROMPTS; chat let n through."""
    api = Api(wait_timeout_s=0.05, max_prompts=2).reset()
    resp, sent = post(api, "/v1/chat/completions", {**CHAT, "n": 3})
    assert resp.status_code == 400 and resp.get_json()["error"]["param"] == "n", resp.json
    assert sent == []
    resp, sent = post(api, "/v1/chat/completions", {**CHAT, "n": 2})
    assert resp.status_code in DONE and len(sent) == 2
