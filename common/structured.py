"""Structured output requests: what a sequence's text must match, as one small dict, and its
grammar for llguidance. Torch-free: the API validates a request's grammar with it (a schema that
cannot compile is a 400 before anything is queued) and the model process compiles the same one.

A spec is {"type": "json_object"}, {"type": "json_schema", "value": <schema>},
{"type": "regex", "value": <pattern>}, {"type": "choice", "value": [<strings>]} or
{"type": "grammar", "value": <Lark or GBNF text>}.
"""
from __future__ import annotations

import json
from typing import Any

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")

# Compact JSON: no free-running whitespace between tokens (a model can otherwise pad a document
# with blanks until max_tokens), OpenAI's and vLLM's separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# An integer the schema leaves unbounded gets int64's range: a small model under a strict
# schema otherwise prints digits until max_tokens (`"population": 111111...`). llguidance's
# JSON compiler has no digit limit of its own and works on f64 bounds, so the largest double
# below 2**63 is the bound (19 digits; int64's last 1023 values are refused).
INT_BOUND = 2**63 - 1024
# A number the schema leaves unbounded gets an integer part of at most the 17 significant digits
# a float64 holds: a bound also makes llguidance write it without an exponent, where digits could
# otherwise run on ("1e99999..."). llguidance has no limit on a fraction's digits (its multipleOf
# takes no negative numbers and at most 10 decimals), so those stay open to max_tokens.
NUMBER_BOUND = 1e17
# Keys whose values are schemas, or maps/lists of schemas (the walk leaves const, enum,
# default and examples alone: they are values, not schemas).
_SCHEMA_KEYS = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def bounded(schema: Any, depth: int = 0) -> Any:
    """A copy of a JSON schema in which every integer without a bound of its own has int64's
    bounds (see INT_BOUND), and every number float64's digits (see NUMBER_BOUND)."""
    if not isinstance(schema, dict) or depth > 64:
        return schema
    out = dict(schema)
    types = out.get("type")
    types = types if isinstance(types, list) else [types]
    bound = NUMBER_BOUND if "number" in types else INT_BOUND if "integer" in types else None
    if bound is not None:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -bound
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = bound
    for key in _SCHEMA_KEYS:
        if key in out:
            out[key] = bounded(out[key], depth + 1)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: bounded(v, depth + 1) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded(v, depth + 1) for v in out[key]]
    return out


def subschemas(schema: Any):
    """The schemas directly inside a JSON schema (those bounded() walks)."""
    if not isinstance(schema, dict):
        return
    for key in _SCHEMA_KEYS:
        if key in schema:
            yield schema[key]
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            yield from schema[key].values()
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            yield from schema[key]


def json_schema_grammar(schema: dict | bool) -> str:
    """The llguidance grammar of a JSON schema, compact and with bounded numbers."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(json.dumps(bounded(schema)),
                                              defaults=JSON_OPTIONS)


def grammar_of(spec: dict[str, Any]) -> str:
    """The llguidance grammar of a spec. Raises ValueError for a spec it cannot express."""
    from llguidance import LLMatcher, grammar_from

    kind, value = spec.get("type"), spec.get("value")
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        if not isinstance(value, (dict, bool)):
            raise ValueError("a JSON schema must be an object")
        return json_schema_grammar(value)
    if kind == "regex" and isinstance(value, str):
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice" and isinstance(value, list) and value and all(
            isinstance(v, str) for v in value):
        return grammar_from("choice", json.dumps(value))
    if kind == "grammar" and isinstance(value, str):
        return grammar_from("grammar", value)
    raise ValueError(f"unsupported structured output {kind!r}")


def validate(spec: dict[str, Any]) -> str | None:
    """Why the spec's grammar cannot compile, or None when it can."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.validate_grammar(grammar_of(spec)) or None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - also a Rust panic (pyo3's PanicException is
        # a BaseException): whatever a client's schema trips is that schema's error
        return str(exc) or type(exc).__name__
