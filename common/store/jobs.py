"""The public job object, as the API answers it, built from a sequence's record hash."""
from __future__ import annotations

import json
from typing import Any, NotRequired, TypedDict

from ..protocol import SequenceStatus
from ..tool_calls import parse_calls
from .base import num


class Usage(TypedDict):
    """A job's token counts, as OpenAI's usage object."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]   # {"cached_tokens": n}


class Job(TypedDict):
    """The job object the API answers (GET /v1/jobs/<id>), typed: the keys and their types a
    reader may rely on. A dict at run time, so the JSON is exactly what job_from_record builds."""
    id: str
    object: str                 # "job"
    status: str                 # a SequenceStatus value
    prompt: str | None
    messages: list[dict[str, Any]] | None
    text: str
    finish_reason: str | None
    usage: Usage
    error: dict[str, str] | None          # {"message": ..., "code": ...}
    model: str | None
    created_at: float | None
    started_at: float | None
    finished_at: float | None
    # only when there are some
    prompt_token_ids: NotRequired[list[int]]
    logprobs: NotRequired[list]
    prompt_logprobs: NotRequired[list]
    tool_calls: NotRequired[list[dict[str, Any]]]   # a succeeded job asked for tools


def job_from_record(rec: dict[str, str]) -> Job:
    """The public job object, built from a record hash."""
    prompt_tokens = num(rec.get("prompt_tokens"), int) or 0
    completion_tokens = num(rec.get("completion_tokens"), int) or 0
    error = rec.get("error") or None
    error_code = rec.get("error_code") or None
    job: Job = {
        "id": rec["id"],
        "object": "job",
        "status": rec.get("status"),
        "prompt": rec.get("prompt") or None,
        "messages": json.loads(rec["messages"]) if rec.get("messages") else None,
        "text": rec.get("text", ""),
        "finish_reason": rec.get("finish_reason") or None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num(rec.get("cached_tokens"), int) or 0},
        },
        "error": ({"message": error, **({"code": error_code} if error_code else {})}
                  if error else None),
        "model": rec.get("model") or None,
        "created_at": num(rec.get("created_at")),
        "started_at": num(rec.get("started_at")),
        "finished_at": num(rec.get("finished_at")),
    }
    for name in ("prompt_token_ids", "logprobs", "prompt_logprobs"):   # only when there are some
        if rec.get(name):
            job[name] = json.loads(rec[name])   # type: ignore[literal-required]
    if rec.get("call_format") and job["status"] == SequenceStatus.SUCCEEDED.value:
        _, calls = parse_calls(job["text"], json.loads(rec["call_format"]), job["id"])
        job["tool_calls"] = calls
    return job
