"""OpenAI's Responses API objects, built from a sequence's job and its response's request
document (common/response_store.py): the Response object, its output message, usage, and the
stream events in OpenAI's shapes (openai-python's types/responses). The API answers with them
(app/responses_api.py numbers the events: app/response_events.py).

A response is a sequence: its id is the sequence's with OpenAI's prefix (resp_<hex> for
seq-<hex>), its output message's id msg_<hex>.
"""
from __future__ import annotations

from typing import Any

from .webhook_store import event_body

RESPONSE_PREFIX, SEQ_PREFIX = "resp_", "seq-"


def response_id(seq_id: str) -> str:
    return RESPONSE_PREFIX + seq_id.removeprefix(SEQ_PREFIX)


def seq_id_of(resp_id: str) -> str:
    """The sequence of a response id ("" for something that is not one)."""
    return SEQ_PREFIX + resp_id[len(RESPONSE_PREFIX):] if resp_id.startswith(RESPONSE_PREFIX) \
        else ""


def message_id(seq_id: str) -> str:
    return "msg_" + seq_id.removeprefix(SEQ_PREFIX)


def status_of(job: dict[str, Any]) -> tuple[str, dict | None, dict | None]:
    """(status, incomplete_details, error) of a response from its sequence's job."""
    status, reason = job.get("status"), job.get("finish_reason")
    if status == "queued":
        return "queued", None, None
    if status == "running":
        return "in_progress", None, None
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if reason == "stop":
        return "completed", None, None
    if reason == "cancelled":
        return "cancelled", None, None
    err = job.get("error") or {}
    if reason == "timeout":
        return "failed", None, {"code": "timeout", "message": "the response's timeout passed"}
    return "failed", None, {"code": err.get("code") or "server_error",
                            "message": err.get("message") or "the response failed"}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_message(seq_id: str, text: str, status: str) -> dict[str, Any]:
    """The response's one output item (status: in_progress, completed or incomplete)."""
    return {"id": message_id(seq_id), "type": "message", "role": "assistant", "status": status,
            "content": [output_text_part(text)] if status != "in_progress" or text else []}


def item_status(status: str) -> str:
    """The output message's status for a response's."""
    return {"completed": "completed", "in_progress": "in_progress"}.get(status, "incomplete")


def response_usage(job: dict[str, Any]) -> dict[str, Any]:
    u = job["usage"]
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def response_object(job: dict[str, Any], doc: dict[str, Any], status: str | None = None
                    ) -> dict[str, Any]:
    """The Response object of a sequence's job and its request document. `status` gives the
    object as it stood at that status with no output yet (the stream's first events)."""
    seq_id = job["id"]
    if status is None:
        status, incomplete, error = status_of(job)
        text = job.get("text") or ""
        finished = status not in ("queued", "in_progress")
        output = ([output_message(seq_id, text, item_status(status))]
                  if text or status in ("completed", "incomplete") else [])
        usage = response_usage(job) if finished else None
        completed_at = job.get("finished_at") if status == "completed" else None
    else:
        incomplete = error = usage = completed_at = None
        output = []
    return {
        "id": response_id(seq_id), "object": "response",
        "created_at": int(job.get("created_at") or 0), "status": status,
        "background": doc.get("background", False), "error": error,
        "incomplete_details": incomplete, "instructions": doc.get("instructions"),
        "max_output_tokens": doc.get("max_output_tokens"), "model": doc.get("model"),
        "output": output, "parallel_tool_calls": True,
        "previous_response_id": doc.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "service_tier": doc.get("service_tier") or "default", "store": doc.get("store", True),
        "temperature": doc.get("temperature"), "text": doc.get("text") or {"format": {"type": "text"}},
        "tool_choice": "auto", "tools": [], "top_p": doc.get("top_p"), "truncation": "disabled",
        "usage": usage, "user": doc.get("user"), "metadata": doc.get("metadata") or {},
        "completed_at": completed_at,
    }


TERMINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                   "failed": "response.failed", "cancelled": "response.cancelled"}


class EventShapes:
    """The stream events of one response's output message (output_index 0, content_index 0),
    without their sequence numbers."""

    def __init__(self, seq_id: str):
        self.seq_id, self.item_id = seq_id, message_id(seq_id)

    def lifecycle(self, kind: str, response: dict[str, Any]) -> dict[str, Any]:
        return {"type": kind, "response": response}

    def item_added(self) -> dict[str, Any]:
        return {"type": "response.output_item.added", "output_index": 0,
                "item": output_message(self.seq_id, "", "in_progress")}

    def part_added(self) -> dict[str, Any]:
        return {"type": "response.content_part.added", "item_id": self.item_id,
                "output_index": 0, "content_index": 0, "part": output_text_part("")}

    def delta(self, text: str) -> dict[str, Any]:
        return {"type": "response.output_text.delta", "item_id": self.item_id,
                "output_index": 0, "content_index": 0, "delta": text, "logprobs": []}

    def text_done(self, text: str) -> dict[str, Any]:
        return {"type": "response.output_text.done", "item_id": self.item_id,
                "output_index": 0, "content_index": 0, "text": text, "logprobs": []}

    def part_done(self, text: str) -> dict[str, Any]:
        return {"type": "response.content_part.done", "item_id": self.item_id,
                "output_index": 0, "content_index": 0, "part": output_text_part(text)}

    def item_done(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "response.output_item.done", "output_index": 0,
                "item": output_message(self.seq_id, text, item_status(status))}

    @staticmethod
    def error(code: str, message: str) -> dict[str, Any]:
        return {"type": "error", "code": code, "message": message, "param": None}


def webhook_event(job: dict[str, Any], event_id: str) -> tuple[str, str]:
    """(type, body) of a finished response's webhook event, as OpenAI sends it (what the
    SDK's `client.webhooks.unwrap` parses): type response.completed (or .incomplete,
    .failed, .cancelled), data {"id": "resp_..."}."""
    kind = TERMINAL_EVENTS[status_of(job)[0]]
    return kind, event_body(kind, {"id": response_id(job["id"])}, event_id)
