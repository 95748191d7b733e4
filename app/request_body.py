"""A request's JSON body, parsed and validated, with a 4xx that says what is wrong."""
from __future__ import annotations

import json
import re

from flask import request
from pydantic import ValidationError

from .errors import APIError
from .schemas import JobRequest


def _no_constant(name: str):
    raise APIError(400, f"request body is not valid JSON: {name} is not a JSON number")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _may_hold_a_lone_surrogate(raw: bytes) -> bool:
    """Whether the parsed body may hold a lone surrogate (\\ud800): only through an escape, or
    bytes that are not UTF-8 (json also reads UTF-16 and UTF-32, and surrogates encoded as
    UTF-8). Checking the parsed body itself means encoding it again whole, which costs more
    than parsing it (70 ms for a whole-vocabulary logit_bias), on every body."""
    if json.detect_encoding(raw) != "utf-8":
        return True
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return b"\\u" in raw and _SURROGATE_ESCAPE.search(raw) is not None


def parse_json_body() -> dict:
    """The request body as a JSON object, or a 400 (415 for another media type) that says why
    not."""
    mimetype = request.mimetype
    if mimetype and mimetype != "application/json" and not mimetype.endswith("+json"):
        # As vLLM (FastAPI) refuses it. A cross-site form can post text/plain without a
        # preflight: to a server without keys beyond loopback it would queue jobs.
        raise APIError(415, f"request body must be JSON (Content-Type: application/json), "
                            f"not {mimetype[:100]}", code="unsupported_media_type")
    raw = request.get_data(cache=False)
    try:
        body = json.loads(raw or b"null", parse_constant=_no_constant)
        if _may_hold_a_lone_surrogate(raw):
            # They parse but cannot be stored or tokenized.
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):   # over Python's 4300 digits
            raise APIError(400, "request body has a number too long") from None
        raise APIError(400, "request body is not valid JSON (UTF-8)") from None
    except UnicodeError:
        raise APIError(400, "request body is not valid JSON (UTF-8)") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def parse_job_request() -> JobRequest:
    body = parse_json_body()
    try:
        req = JobRequest.model_validate(body)
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]   # the field, as the OpenAI routes name it
        raise APIError(400, describe(exc), param=str(loc[0]) if loc else None) from None
    return req   # the limits (lengths, counts, the context) are submit()'s check_limits


def describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
