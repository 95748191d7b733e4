"""Wire types that cross a process boundary (API <-> Redis <-> worker), serialised in one place."""
from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.SUCCEEDED, SequenceStatus.FAILED, SequenceStatus.CANCELLED)


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"
    TIMEOUT = "timeout"

    @property
    def status(self) -> SequenceStatus:
        """The one place that maps a finish reason onto the final status."""
        return {
            FinishReason.STOP: SequenceStatus.SUCCEEDED,
            FinishReason.LENGTH: SequenceStatus.SUCCEEDED,
            FinishReason.CANCELLED: SequenceStatus.CANCELLED,
            FinishReason.TIMEOUT: SequenceStatus.CANCELLED,
            FinishReason.ERROR: SequenceStatus.FAILED,
        }[self]


# Error codes the worker writes on a record it refused at admission (the prompt itself is bad):
# the caller's fault, so a 400 wherever an answer can still choose its status (a route, a batch
# line's response).
INPUT_ERROR_CODES = ("context_length_exceeded", "invalid_prompt", "invalid_sampling_params")


@dataclass(slots=True)
class SamplingParams:
    """How to sample one sequence. None means "use the model's generation_config default"."""

    max_tokens: int = 256
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    cache_salt: str | None = None   # prompts share cached prefixes only with the same salt
    # OpenAI's penalties over the output so far, and additive biases by token id (vLLM's ranges)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    # Log-probabilities (of the raw distribution, vLLM's default): None off, k >= 0 the k most
    # likely tokens besides the sampled one; prompt_logprobs the same for each prompt token.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: dict[str, Any] | None = None   # what the text must match (common/structured.py)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def copies(self, n: int) -> list["SamplingParams"]:
        """n samples of one prompt (OpenAI's n): the first keeps the seed, the others get
        seeds derived from it, so a seeded request is reproducible and its choices differ.
        Unseeded copies each draw from their own random generator."""
        if self.seed is None:
            return [dataclasses.replace(self) for _ in range(n)]
        return [dataclasses.replace(self, seed=self.seed if i == 0 else
                                    (self.seed + i * 0x9E3779B97F4A7C15) % 2**63)
                for i in range(n)]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        names = {f.name for f in dataclasses.fields(cls)}
        params = cls(**{k: v for k, v in d.items() if k in names})
        if params.logit_bias:   # JSON object keys are strings
            params.logit_bias = {int(k): float(v) for k, v in params.logit_bias.items()}
        return params


@dataclass(slots=True)
class SequenceRequest:
    """What the API stores for one sequence: the input and how to sample it."""

    seq_id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None   # a prompt given as token ids (not tokenized)
    # apply_chat_template's extra arguments for messages: `tools` (a template that renders
    # them, common/tool_calls.py) and chat_template_kwargs (enable_thinking, ...)
    template_args: dict[str, Any] | None = None
    # How tool calls are read from the text (ToolRequest.shape()): the job keeps its calls
    call_format: dict[str, Any] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    owner: str = ""
    created_at: float | None = None   # unix time the API accepted it
    deadline: float | None = None     # unix time after which it ends with finish_reason timeout
    priority: int | None = None       # 0 (first) .. 9, Celery's Redis priority steps


# --- Stream events (Redis Stream entries and pub/sub messages) -------------------------------
EVENT_TOKEN = "token"
EVENT_DONE = "done"
EVENT_RESET = "reset"


def encode_event(kind: str, data: dict[str, Any]) -> dict[str, str]:
    """A stream entry: two flat fields so XADD/XREAD stay cheap."""
    return {"event": kind, "data": json.dumps(data, ensure_ascii=False, separators=(",", ":"))}


def decode_event(fields: dict[str, str]) -> tuple[str, dict[str, Any]]:
    return fields["event"], json.loads(fields["data"])


def encode_pubsub(kind: str, data: dict[str, Any]) -> str:
    """Pub/sub message: {"text": ...} for tokens, {"done": true, "job": {...}} at the end."""
    if kind == EVENT_TOKEN:
        return json.dumps({"text": data["text"]}, ensure_ascii=False)
    if kind == EVENT_DONE:
        return json.dumps({"done": True, "job": data}, ensure_ascii=False)
    return json.dumps({kind: True, **data}, ensure_ascii=False)


# The Celery task the API sends (by name, so the API never imports the worker).
GENERATE_TASK = "llmq.generate"
