"""app/schemas.py: the request bodies and their validation, without Flask."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.schemas import JobRequest, Message, SamplingFields


def test_prompt_defaults():
    req = JobRequest.model_validate({"prompt": "Hi"})
    assert req.prompt == "Hi" and req.messages is None and req.prompts is None
    assert req.stop == [] and req.max_tokens is None and req.min_tokens == 0
    assert req.stream is False and req.ignore_eos is False


def test_stop_string_becomes_a_list():
    assert JobRequest.model_validate({"prompt": "x", "stop": "\n"}).stop == ["\n"]
    assert JobRequest.model_validate({"prompt": "x", "stop": ["a", "b"]}).stop == ["a", "b"]
    assert SamplingFields().stop == []


def test_messages_and_prompts():
    req = JobRequest.model_validate({"messages": [{"role": "system", "content": "Be brief"},
                                                  {"role": "user", "content": "東京?"}]})
    assert [m.role for m in req.messages] == ["system", "user"]
    req = JobRequest.model_validate({"prompts": ["a", "b"]})
    assert req.prompts == ["a", "b"]


@pytest.mark.parametrize("body", [
    {},
    {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
    {"prompt": "a", "prompts": ["b"]},
    {"messages": [{"role": "user", "content": "b"}], "prompts": ["b"]},
    {"prompt": ""},
    {"prompt": "   \n"},
    {"prompt": 5},
    {"prompt": None},
    {"prompt": ["a"]},
    {"messages": []},
    {"messages": [{"role": "robot", "content": "x"}]},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": "x", "name": "n"}]},
    {"messages": "hi"},
    {"prompts": []},
    {"prompts": ["ok", ""]},
    {"prompts": ["ok", 3]},
    {"prompt": "x", "max_tokens": 0},
    {"prompt": "x", "max_tokens": -1},
    {"prompt": "x", "max_tokens": 1.5},
    {"prompt": "x", "temperature": -0.1},
    {"prompt": "x", "temperature": 2.01},
    {"prompt": "x", "temperature": float("nan")},
    {"prompt": "x", "temperature": float("inf")},
    {"prompt": "x", "top_p": 0},
    {"prompt": "x", "top_p": 1.5},
    {"prompt": "x", "top_k": -2},
    {"prompt": "x", "min_p": 1.1},
    {"prompt": "x", "repetition_penalty": 0},
    {"prompt": "x", "seed": -2**63 - 1},
    {"prompt": "x", "seed": 2**63},
    {"prompt": "x", "stop": ""},
    {"prompt": "x", "stop": ["ok", ""]},
    {"prompt": "x", "stop": [1]},
    {"prompt": "x", "stop_token_ids": ["a"]},
    {"prompt": "x", "stop_token_ids": [-5]},                 # would mask vocab[-5] silently
    {"prompt": "x", "stop_token_ids": [10**30]},             # overflows torch.tensor
    {"prompt": "x", "top_k": 10**30},                        # overflows torch.tensor
    {"prompt": "x", "min_tokens": -1},
    {"prompt": "x", "min_tokens": 5, "max_tokens": 4},
    {"prompt": "x", "unknown_field": 1},
    {"prompt": "x", "priority": 10},
    {"prompt": "x", "priority": -1},
    {"prompt": "x", "timeout": 0},
    {"prompt": "x", "timeout": 24 * 3600 + 1},
])
def test_invalid_bodies(body):
    with pytest.raises(ValidationError):
        JobRequest.model_validate(body)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 1), ("temperature", 0.0), ("temperature", 2.0), ("top_p", 1.0),
    ("top_k", -1), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 2.0), ("seed", 0),
    ("seed", 2**63 - 1), ("stop_token_ids", [0, 1]), ("ignore_eos", True), ("min_tokens", 3),
    ("top_k", 2**31 - 1), ("stop_token_ids", [2**31 - 1]), ("priority", 0), ("priority", 9), ("timeout", 0.5), ("timeout", 24 * 3600),
])
def test_boundary_values_are_accepted(field, value):
    req = JobRequest.model_validate({"prompt": "x", field: value})
    assert getattr(req, field) == value


def test_min_tokens_equal_to_max_tokens_is_fine():
    req = JobRequest.model_validate({"prompt": "x", "min_tokens": 4, "max_tokens": 4})
    assert (req.min_tokens, req.max_tokens) == (4, 4)


def test_message_model_forbids_extra():
    with pytest.raises(ValidationError):
        Message.model_validate({"role": "user", "content": "x", "extra": 1})


def test_a_schema_nested_too_deeply_is_invalid_not_a_crash():
    """json.loads raises RecursionError, which pydantic does not turn into a 400 (it was a
    500)."""
    with pytest.raises(ValidationError):
        JobRequest.model_validate({"prompt": "x", "structured_outputs": {
            "json": "[" * 100_000 + "]" * 100_000}})


@pytest.mark.parametrize("off", [-1, 0])
def test_an_explicit_top_k_off_stays_off_over_the_models_default(off):
    """top_k -1 (or 0) became None, which the worker reads as unset and fills from the model's
    generation_config (Qwen2.5 ships top_k 20): the client's "off" sampled with top-k 20."""
    import types

    from worker.input_processor import InputProcessor

    info = types.SimpleNamespace(generation_defaults={"temperature": 0.7, "top_k": 20},
                                 max_model_len=4096)
    processor = InputProcessor("w", None, None, types.SimpleNamespace(info=info), None)
    assert processor._resolve(SamplingFields(top_k=off).sampling_params(16), 10).top_k == 0
    assert processor._resolve(SamplingFields().sampling_params(16), 10).top_k == 20


def test_min_tokens_is_cut_with_max_tokens_to_the_room_left():
    """An unset max_tokens is cut to the context's room, min_tokens was not: vLLM refuses
    min_tokens past max_tokens, so the sequence failed on the vLLM backend."""
    import types

    from worker.input_processor import InputProcessor

    info = types.SimpleNamespace(generation_defaults={}, max_model_len=100)
    processor = InputProcessor("w", None, None, types.SimpleNamespace(info=info), None)
    p = SamplingFields(min_tokens=50).sampling_params(256)
    resolved = processor._resolve(p, 95)
    assert (resolved.max_tokens, resolved.min_tokens) == (5, 5)
    assert processor._resolve(p, 10).min_tokens == 50
