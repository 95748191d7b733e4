"""Request bodies, validated by pydantic. Limits come from Settings through the context."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.protocol import SamplingParams


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class SamplingFields(BaseModel):
    """Sampling and queueing parameters every submitting route accepts (vLLM's names and
    ranges): /v1/jobs, /v1/generate and the OpenAI routes."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)   # ints past 2**63 overflow the sampler
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    timeout: float | None = Field(None, gt=0, le=24 * 3600)   # seconds; then finish "timeout"
    priority: int | None = Field(None, ge=0, le=9)           # 0 runs first; Celery's steps

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    def sampling_params(self, default_max_tokens: int, max_tokens: int | None = None
                        ) -> SamplingParams:
        """The engine's parameters; max_tokens overrides the field (OpenAI's
        max_completion_tokens). top_k -1 and 0 both mean off, as in vLLM and OpenAI clients."""
        return SamplingParams(
            max_tokens=max_tokens or self.max_tokens or default_max_tokens,
            temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k if self.top_k not in (None, -1, 0) else None,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, seed=self.seed,
            stop=list(self.stop), stop_token_ids=list(self.stop_token_ids or []),
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, cache_salt=self.cache_salt)


class WebhookFields(BaseModel):
    """Where to tell the caller about a job's (or a batch's) progress, as Replicate does."""

    model_config = ConfigDict(extra="forbid")

    webhook: str | None = Field(None, min_length=1, max_length=2048)
    webhook_events: list[Literal["started", "completed"]] = Field(
        default_factory=lambda: ["completed"], min_length=1, max_length=2)


class JobRequest(SamplingFields, WebhookFields):
    """Exactly one of prompt, messages or prompts."""

    prompt: str | None = None
    messages: list[Message] | None = None
    prompts: list[str] | None = None
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        given = [n for n in ("prompt", "messages", "prompts") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'prompt', 'messages' or 'prompts'")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("'prompt' must be a non-empty string")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        if self.prompts is not None:
            if not self.prompts:
                raise ValueError("'prompts' must not be empty")
            if any(not p.strip() for p in self.prompts):
                raise ValueError("every prompt in 'prompts' must be a non-empty string")
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("'min_tokens' must not exceed 'max_tokens'")
        return self
