"""What real clients send, unchanged, through the official `openai` SDK against the real stack:
logprobs on both routes (streamed and not), echo scoring with max_tokens 0 (evaluation
harnesses), n > 1, best_of, vLLM's continuous usage stats (its benchmark client), structured output (the
SDK's parse(), json_object, vLLM's structured_outputs) beside free sequences in one batch, the
accepted-and-ignored and refused fields, and docs that need no internet.

Runs once per backend, like test_openai_client.py. Greedy runs are deterministic, so a streamed
run's tokens equal a non-streamed one's; logprob values are compared with a tolerance, as a
second run may take its prompt from the prefix cache (other float rounding).
"""
from __future__ import annotations

import json
import re
from typing import Literal

import pytest
import requests
from pydantic import BaseModel, Field

from support import wait_until

import openai  # noqa: E402 - required (requirements-dev.txt): never a skip

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me about foxes."}]
GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


class Pet(BaseModel):
    """Small and bounded, so that even a random model's constrained text ends well within
    max_tokens (a free string or integer could run on)."""
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=20)
    vaccinated: bool


# JSON Schema allows other properties unless told not to (what the SDK's strict parse() does).
PET_FORMAT = {"type": "json_schema", "json_schema": {
    "name": "pet", "schema": {**Pet.model_json_schema(), "additionalProperties": False}}}


def approx(x):
    return pytest.approx(x, abs=1e-3)


def get_job(stack, seq_id: str) -> dict:
    r = requests.get(f"{stack['url']}/v1/jobs/{seq_id}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


# --- logprobs ---------------------------------------------------------------------------------
def _legacy(lp) -> dict:
    return {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
            "top_logprobs": lp.top_logprobs, "text_offset": lp.text_offset}


def test_completion_logprobs_streamed_and_not(client, model):
    resp = client.completions.create(model=model, prompt=PROMPT, logprobs=3, **GREEDY)
    lp = _legacy(resp.choices[0].logprobs)
    assert len(lp["tokens"]) == resp.usage.completion_tokens == 8
    for i, (tok, value, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"],
                                              lp["top_logprobs"])):
        assert value <= 0 and top[tok] == value
        assert max(top.values()) == value   # greedy: the sampled token is the top-1
        assert 3 <= len(top) <= 4           # the 3 most likely, plus the sampled one if not
        if i:
            assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])
    assert lp["text_offset"][0] == 0

    chunks = list(client.completions.create(model=model, prompt=PROMPT, logprobs=3, stream=True,
                                            **GREEDY))
    merged = {k: [] for k in lp}
    for c in chunks:
        if c.choices and c.choices[0].logprobs:
            for k, v in _legacy(c.choices[0].logprobs).items():
                merged[k] += v
    assert merged["tokens"] == lp["tokens"] and merged["text_offset"] == lp["text_offset"]
    assert merged["token_logprobs"] == approx(lp["token_logprobs"])
    assert [sorted(t) for t in merged["top_logprobs"]] == [sorted(t) for t in lp["top_logprobs"]]


def test_chat_logprobs_streamed_and_not(client, model):
    def flat(content):
        return [(e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs])
                for e in content]

    resp = client.chat.completions.create(model=model, messages=MESSAGES, logprobs=True,
                                          top_logprobs=2, **GREEDY)
    content = flat(resp.choices[0].logprobs.content)
    assert len(content) == resp.usage.completion_tokens == 8
    for token, value, raw, top in content:
        assert raw == list(token.encode("utf-8"))
        assert len(top) == 2 and top[0] == (token, value)   # greedy: top-1
        assert top[1][1] <= value

    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, logprobs=True,
                                                 top_logprobs=2, stream=True, **GREEDY))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs
                for x in flat(c.choices[0].logprobs.content)]
    assert [x[0] for x in streamed] == [x[0] for x in content]
    assert [x[1] for x in streamed] == approx([x[1] for x in content])
    # Without logprobs asked for there are none.
    plain = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_echo_with_max_tokens_0_scores_the_prompt(client, model):
    """What evaluation harnesses send to score a text: the prompt back, with each token's
    logprob given the ones before it (the first has none), and nothing generated."""
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True,
                                     logprobs=1, temperature=0)
    choice = resp.choices[0]
    assert choice.text == PROMPT
    assert resp.usage.completion_tokens == 0 and choice.finish_reason == "length"
    lp = _legacy(choice.logprobs)
    assert len(lp["tokens"]) == resp.usage.prompt_tokens > 1
    assert "".join(lp["tokens"]) == PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])

    # With tokens too: the prompt's part is the same, and the first generated token's logprob
    # is the one a plain run reports.
    more = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, echo=True,
                                     logprobs=1, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, logprobs=1,
                                      temperature=0, extra_body={"ignore_eos": True})
    n = len(lp["tokens"])
    both = _legacy(more.choices[0].logprobs)
    assert both["tokens"][:n] == lp["tokens"]
    assert both["token_logprobs"][1:n] == approx(lp["token_logprobs"][1:])
    assert both["tokens"][n:] == plain.choices[0].logprobs.tokens
    assert both["token_logprobs"][n:] == approx(plain.choices[0].logprobs.token_logprobs)
    assert more.choices[0].text == PROMPT + plain.choices[0].text
    assert both["text_offset"][n] == len(PROMPT)


def test_vllms_prompt_logprobs_agree_with_echo(client, model):
    """vLLM's own way to score a prompt (extra_body prompt_logprobs, what lm-eval's vLLM
    client reads): per prompt token None first, then {token id: {logprob, rank,
    decoded_token}}, the same numbers echo gives; on chat beside the choices."""
    echo = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True,
                                     logprobs=1, temperature=0).choices[0].logprobs
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 1})
    plp = resp.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == resp.usage.prompt_tokens == len(echo.tokens) and plp[0] is None
    for tok, lp, entry in zip(echo.tokens[1:], echo.token_logprobs[1:], plp[1:]):
        mine = [v for v in entry.values() if v["decoded_token"] == tok][0]
        assert mine["logprob"] == approx(lp) and mine["rank"] >= 1
        assert any(v["rank"] == 1 for v in entry.values())
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_models_are_retrieved_by_name(client, model):
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_a_prompt_of_token_ids_is_scored_like_its_text(client, model, default_model_dir):
    """Harnesses send pre-tokenized prompts (lists of token ids, or lists of those)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_dir)(PROMPT)["input_ids"]
    kw = dict(model=model, max_tokens=0, echo=True, logprobs=1, temperature=0)
    text = client.completions.create(prompt=PROMPT, **kw).choices[0]
    tokens = client.completions.create(prompt=ids, **kw).choices[0]
    assert tokens.text == PROMPT
    assert tokens.logprobs.tokens == text.logprobs.tokens
    assert tokens.logprobs.token_logprobs[1:] == approx(text.logprobs.token_logprobs[1:])
    both = client.completions.create(model=model, prompt=[ids, ids[:2]], max_tokens=3,
                                     temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert both.choices[0].text == plain.choices[0].text
    assert both.usage.prompt_tokens == len(ids) + 2


def test_jobs_keep_logprobs(stack):
    r = requests.post(stack["url"] + "/v1/generate", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    job = r.json()
    assert len(job["logprobs"]) == job["usage"]["completion_tokens"] == 5
    for e in job["logprobs"]:
        assert e["rank"] == 1 and e["top_logprobs"][0]["token_id"] == e["token_id"]
        assert len(e["top_logprobs"]) == 2
    assert get_job(stack, job["id"])["logprobs"] == job["logprobs"]
    r = requests.post(stack["url"] + "/v1/generate", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 2})
    assert "logprobs" not in r.json()   # only for sequences that asked


# --- n > 1 ------------------------------------------------------------------------------------
def test_n_gives_n_choices_with_summed_usage(client, model, stack):
    kw = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3,
              extra_body={"ignore_eos": True})
    # On llama_cpp a seed repeats only in the same company and the same KV cells (docs/api.md,
    # `seed`): a later request's texts may part at a near tie, so there the texts are
    # compared within one response only.
    same = stack["backend"] != "llama_cpp"
    resp = client.completions.create(n=2, **kw)
    assert [c.index for c in resp.choices] == [0, 1]
    texts = [c.text for c in resp.choices]
    assert texts[0] != texts[1]   # derived seeds: different samples
    one = client.completions.create(**kw)
    assert texts[0] == one.choices[0].text or not same   # the first keeps the request's seed
    assert resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens == one.usage.prompt_tokens   # one prompt, counted once
    again = [c.text for c in client.completions.create(n=2, **kw).choices]
    assert again == texts or (not same and again[0] != again[1])

    chat = client.chat.completions.create(model=model, messages=MESSAGES, n=2, max_tokens=4,
                                          temperature=1.0, seed=3,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens == 8

    # Streamed: the choices' chunks carry their index; each adds up to the same text.
    chunks = list(client.completions.create(n=2, stream=True, **kw))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == texts[i] or not same
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
        assert sum(1 for c in mine if c.text) >= 1


def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob(client, model,
                                                                            stack):
    kw = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    if stack["backend"] == "llama_cpp":
        # There a seed repeats only in the same company and KV cells (docs/api.md, `seed`), so
        # another request's candidates may differ from these: within one response, the two
        # chosen of 4 come best first, with their own logprobs.
        best = client.completions.create(n=2, best_of=4, logprobs=0, **kw)
        sums = [sum(c.logprobs.token_logprobs) for c in best.choices]
        assert [c.index for c in best.choices] == [0, 1]
        assert sums[0] >= sums[1] - 1e-3, sums
        assert best.usage.completion_tokens == 4 * 6
        return
    # best_of 4 samples the same 4 candidates as n=4 (the same derived seeds): score those.
    four = client.completions.create(n=4, logprobs=0, **kw)
    score = {c.text: sum(c.logprobs.token_logprobs) for c in four.choices}
    assert len(score) == 4, "two candidates sampled the same text; pick another seed"

    best = client.completions.create(n=2, best_of=4, **kw)
    chosen = [c.text for c in best.choices]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)   # ranked by them, not asked for
    rest = [score[t] for t in score if t not in chosen]
    assert min(score[t] for t in chosen) >= max(rest) - 1e-3   # the two best ...
    assert score[chosen[0]] >= score[chosen[1]] - 1e-3       # ... best first, as vLLM
    assert best.usage.completion_tokens == 4 * 6   # every candidate's tokens were spent
    assert best.usage.prompt_tokens == four.usage.prompt_tokens

    # Asked for, the logprobs are the chosen candidates' own.
    with_lp = client.completions.create(n=1, best_of=4, logprobs=1, **kw)
    top = with_lp.choices[0]
    assert top.text == chosen[0]
    assert sum(top.logprobs.token_logprobs) == pytest.approx(score[top.text], abs=1e-3)


@pytest.mark.parametrize("extra, message", [
    ({"n": 2, "best_of": 1}, "must be at least n"),
    ({"best_of": 2, "stream": True}, "cannot be streamed"),
])
def test_best_of_below_n_or_streamed_is_a_400(stack, extra, message):
    r = requests.post(stack["url"] + "/v1/completions", timeout=30,
                      json={"prompt": PROMPT, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "best_of" and message in err["message"]


# --- streaming usage --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuous_usage_stats_put_usage_in_every_chunk(client, model, kind):
    """vLLM's benchmark client sends this with every stream."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model=model, max_tokens=5, temperature=0, stream=True, stream_options=opts,
              extra_body={"ignore_eos": True})
    if kind == "completions":
        chunks = list(client.completions.create(prompt=PROMPT, **kw))
    else:
        chunks = list(client.chat.completions.create(messages=MESSAGES, **kw))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    prompt = {c.usage.prompt_tokens for c in chunks}
    assert len(prompt) == 1 and prompt.pop() > 0
    assert chunks[-1].choices == []
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)


# --- structured output ------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sdk_parse_returns_a_parsed_object(client, model, temperature):
    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        response_format=Pet, max_tokens=64, temperature=temperature, seed=11)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)


def test_structured_outputs_on_completions(client, model):
    def text(extra, **kw):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, seed=2, extra_body=extra,
                                         **kw).choices[0].text

    assert re.fullmatch(r"[0-9]{4}", text({"structured_outputs": {"regex": "[0-9]{4}"}}))
    assert text({"structured_outputs": {"choice": ["yes", "no"]}}) in ("yes", "no")
    assert text({"guided_choice": ["left", "right"]}) in ("left", "right")   # vLLM's old name
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=64, temperature=0,
                                     extra_body={"response_format": PET_FORMAT})
    Pet.model_validate_json(resp.choices[0].text)


def test_running_out_of_max_tokens_mid_object_is_length(client, model):
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3,
                                          temperature=0, response_format=PET_FORMAT)
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content.startswith("{")


def test_a_schema_that_cannot_compile_is_a_400(client, model, stack):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4,
                                       response_format=bad)
    assert info.value.param == "response_format"
    assert "objectx" in info.value.response.json()["error"]["message"]
    r = requests.post(stack["url"] + "/v1/jobs", json={"prompt": PROMPT, "response_format": bad},
                      timeout=10)
    assert r.status_code == 400 and "objectx" in r.json()["error"]["message"]


def test_structured_and_free_sequences_share_a_batch(stack):
    """Free sequences run; a structured one joins their batch, parses, and ends while they are
    still running (the worker runs one batch); the free ones carry on."""
    url = stack["url"]
    free = []
    for i in range(3):
        r = requests.post(url + "/v1/jobs", timeout=10, json={
            "prompt": f"{PROMPT} {i}", "max_tokens": 400, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 202, r.text
        free.append(r.json()["id"])
    wait_until(lambda: all(get_job(stack, s)["usage"]["completion_tokens"] > 0 for s in free),
               60, "the free sequences to be decoding")
    r = requests.post(url + "/v1/generate", timeout=120, json={
        "messages": [{"role": "user", "content": "A pet, as JSON."}], "max_tokens": 64,
        "temperature": 0, "response_format": PET_FORMAT})
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["status"] == "succeeded" and job["finish_reason"] == "stop"
    Pet.model_validate_json(job["text"])
    states = [get_job(stack, s) for s in free]
    assert all(j["status"] == "running" for j in states), states
    for s in free:
        requests.delete(f"{url}/v1/jobs/{s}", timeout=10)
    wait_until(lambda: all(get_job(stack, s)["status"] == "cancelled" for s in free), 60,
               "the free sequences to stop")


# --- fields -----------------------------------------------------------------------------------
def test_fields_that_change_nothing_are_accepted(client, model):
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, user="u-1", store=False,
        metadata={"run": "x"}, parallel_tool_calls=False,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "length_penalty": 1.0,
                    "skip_special_tokens": True, "add_generation_prompt": True})
    assert resp.usage.completion_tokens <= 2


@pytest.mark.parametrize("field,value", [("include_stop_str_in_output", True),
                                         ("skip_special_tokens", False),
                                         ("echo", True), ("best_of", 3)])
def test_fields_that_would_change_the_output_are_refused_by_name(client, model, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                       extra_body={field: value})
    assert info.value.param == field and info.value.code == "unsupported_parameter"


# --- docs -------------------------------------------------------------------------------------
def test_docs_need_no_internet(stack):
    page = requests.get(stack["url"] + "/docs/swagger/", timeout=10)
    assert page.status_code == 200
    remote = re.findall(r'(?:src|href)="(https?://[^"]+)"', page.text)
    assert remote == [], remote
    local = re.findall(r'(?:src|href)="(/docs/assets/[^"]+)"', page.text)
    assert len(local) == 3, page.text
    for path in local:
        r = requests.get(stack["url"] + path, timeout=10)
        assert r.status_code == 200 and len(r.content) > 1000, path
    assert requests.get(stack["url"] + "/docs/assets/nope.js", timeout=10).status_code == 404
    doc = requests.get(stack["url"] + "/openapi.json", timeout=10).json()
    assert "/v1/chat/completions" in doc["paths"]   # still generated
