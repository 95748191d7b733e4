"""Tool calling and grammar bounds through the official `openai` SDK against the real stack.

The stack's tiny random model has the default model's chat template (SmolLM2: no tools of its
own), so these run the generic format: the tools described in the system prompt, the call a
JSON object decoded under a grammar built from the tools' parameter schemas. A random model
writes noise, so every call validating (20 samples at temperature 1) is the grammar's doing.
"""
from __future__ import annotations

import json
from typing import Literal

import pytest
import requests
from pydantic import BaseModel, ConfigDict, Field

import openai  # noqa: E402 - required (requirements-dev.txt): never a skip

pytestmark = pytest.mark.integration

class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=12)
    unit: Literal["C", "F"]


class Time(BaseModel):
    model_config = ConfigDict(extra="forbid")
    offset: int   # free: bounded by the grammar


def tool(name: str, model: type[BaseModel]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": model.__name__,
        "parameters": {**model.model_json_schema(), "additionalProperties": False}}}


WEATHER, TIME = tool("get_weather", Weather), tool("get_time", Time)
MODELS = {"get_weather": Weather, "get_time": Time}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(call) -> dict:
    """A call's arguments parse and validate against its tool's schema."""
    assert call.type == "function" and call.id
    args = json.loads(call.function.arguments)
    MODELS[call.function.name].model_validate(args, strict=True)
    return args


def test_a_named_tool_choice_always_returns_one_valid_call(client, model):
    for seed in range(20):
        resp = client.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=seed,
            max_tokens=60, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        check_call(call)
        assert choice.message.content is None


def test_required_with_two_tools_calls_one_of_them(client, model):
    names = set()
    for seed in range(8):
        resp = client.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=60)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        check_call(call)
        names.add(call.function.name)
    assert names <= {"get_weather", "get_time"}


def test_a_streamed_call_is_the_non_streamed_one(client, model):
    kw = dict(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
              temperature=1.0, seed=7, max_tokens=60, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert whole
    chunks = list(client.chat.completions.create(**kw, stream=True))
    first = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert first[0].id and first[0].function.name   # index, id and name come first
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The SDK's own stream helper assembles the fragments.
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert streamed[0].id == f"call_{final.id}_0"   # ids are the request's own


def test_a_follow_up_turn_with_the_tool_result_is_answered(client, model, stack):
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60,
        temperature=0)
    msg = first.choices[0].message
    [call] = msg.tool_calls
    follow = ASK + [msg.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    resp = client.chat.completions.create(model=model, messages=follow, tools=[WEATHER],
                                          max_tokens=8, temperature=0, tool_choice="none")
    choice = resp.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    # The model saw its call and the result (the generic format's rendering of them).
    job = requests.get(f"{stack['url']}/v1/jobs/{resp.id}", timeout=10).json()
    assert [m["role"] for m in job["messages"]] == ["user", "assistant", "user"]
    assert json.loads(job["messages"][1]["content"])["tool_calls"][0]["name"] == "get_weather"
    assert json.loads(job["messages"][2]["content"]) == {
        "tool_response": {"tool_call_id": call.id, "content": '{"temp": 21}'}}


def test_auto_answers_text_or_a_valid_call(client, model):
    for seed in range(6):
        resp = client.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER], temperature=1.0, seed=seed,
            max_tokens=60)
        choice = resp.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            check_call(choice.message.tool_calls[0])
        else:
            assert choice.message.content is None or "tool_calls" not in choice.message.content


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"response_format": {"type": "json_object"}, "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, model, body, param):
    body = {"tools": [WEATHER], **body}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4,
                                       extra_body=body)
    assert info.value.param == param


class City(BaseModel):
    name: str = Field(max_length=12)   # a random model never ends a free string
    population: int


def test_parse_with_a_strict_model_closes_the_object(client, model):
    """The SDK's parse() with a strict model (no extra keys) and a free integer returns the
    object. (A random model stops an integer early anyway: the bound's own tests are the
    grammar's, tests/unit/test_structured_bounds.py, and the default model's, which printed
    digits to max_tokens without it: tests/integration/test_e2e_default_model.py.)"""
    for seed in range(5):
        completion = client.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": "Name a city."}],
            response_format=City, temperature=1.0, seed=seed, max_tokens=200)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, City) and abs(parsed.population) < 2**63
