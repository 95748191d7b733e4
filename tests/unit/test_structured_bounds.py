"""The grammar bounds of structured output: what JSON lets a small model run on forever (digits
of an integer or of a number's integer part, an exponent, whitespace) is bounded by default, so
a strict schema's object always closes."""
from __future__ import annotations

import json

import pytest

from common.structured import INT_BOUND, NUMBER_BOUND, bounded, grammar_of


@pytest.fixture(scope="module")
def lltok(default_model_dir):
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return tok, llguidance.hf.from_tokenizer(tok)


def accepts(lltok, spec: dict, text: str) -> bool:
    """Whether the grammar of `spec` takes the whole of `text`."""
    from llguidance import LLMatcher

    tok, lt = lltok
    m = LLMatcher(lt, grammar_of(spec), log_level=0)
    assert not m.is_error(), m.get_error()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return m.validate_tokens(ids) == len(ids)


CITY = {"type": "object", "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["name", "population"]}


def test_an_integer_is_bounded_to_int64_digits(lltok):
    spec = {"type": "json_schema", "value": CITY}
    assert accepts(lltok, spec, '{"name": "Paris", "population": 2102650}')
    assert accepts(lltok, spec, '{"name": "Paris", "population": -' + "9" * 18 + "}")
    assert not accepts(lltok, spec, '{"name": "Paris", "population": ' + "1" * 30)
    assert not accepts(lltok, spec, '{"name": "Paris", "population": ' + "1" * 20)


def test_integers_nested_anywhere_are_bounded(lltok):
    schema = {"$defs": {"n": {"type": "integer"}},
              "type": "object", "properties": {
                  "a": {"type": "array", "items": {"$ref": "#/$defs/n"}},
                  "b": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}
    spec = {"type": "json_schema", "value": schema}
    assert accepts(lltok, spec, '{"a": [1, 22], "b": 3}')
    assert not accepts(lltok, spec, '{"a": [' + "1" * 30)
    assert not accepts(lltok, spec, '{"a": [], "b": ' + "1" * 30)


def test_the_schemas_own_bounds_are_kept():
    s = bounded({"type": "integer", "minimum": 0, "enum": [{"type": "integer"}]})
    assert s["minimum"] == 0 and s["maximum"] == INT_BOUND
    assert s["enum"] == [{"type": "integer"}]   # a value, not a schema
    assert bounded({"type": ["integer", "null"]})["minimum"] == -INT_BOUND
    assert bounded({"type": "number", "exclusiveMinimum": 0})["maximum"] == NUMBER_BOUND
    assert "minimum" not in bounded({"type": "number", "exclusiveMinimum": 0})
    assert bounded({"type": ["integer", "number"]})["maximum"] == NUMBER_BOUND
    assert "minimum" not in bounded({"type": "string"})


AREA = {"type": "object", "additionalProperties": False,
        "properties": {"km2": {"type": "number"}}, "required": ["km2"]}


def test_a_number_is_bounded_to_float64_digits(lltok):
    spec = {"type": "json_schema", "value": AREA}
    for value in ("105.4", "-0.25", "0", "12345678901234567.5", "-" + "9" * 16):
        assert accepts(lltok, spec, '{"km2": ' + value + "}"), value
    assert not accepts(lltok, spec, '{"km2": ' + "1" * 30)
    assert not accepts(lltok, spec, '{"km2": ' + "1" * 19)
    # An exponent's digits are where a bounded integer part could run on.
    assert not accepts(lltok, spec, '{"km2": 1e9999')


def test_no_whitespace_runs_between_tokens(lltok):
    spec = {"type": "json_schema", "value": CITY}
    assert accepts(lltok, spec, '{"name": "a", "population": 1}')
    assert not accepts(lltok, spec, '{"name":   ')
    assert not accepts(lltok, spec, '{\n\n\n')


def test_a_json_object_takes_no_free_whitespace(lltok):
    spec = {"type": "json_object"}
    assert accepts(lltok, spec, json.dumps({"a": [1, 2]}))
    assert not accepts(lltok, spec, '{   ')
