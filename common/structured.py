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
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(spec: dict[str, Any]) -> str:
    """The llguidance grammar of a spec. Raises ValueError for a spec it cannot express."""
    from llguidance import LLMatcher, grammar_from

    kind, value = spec.get("type"), spec.get("value")
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "json_schema":
        if not isinstance(value, (dict, bool)):
            raise ValueError("a JSON schema must be an object")
        return LLMatcher.grammar_from_json_schema(json.dumps(value), defaults=_JSON_OPTIONS)
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
