"""Request bodies, validated by pydantic. Limits come from Settings through the context."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class SamplingFields(BaseModel):
    """Sampling parameters accepted by /v1/jobs and /v1/generate (vLLM's names and ranges)."""

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

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v


class JobRequest(SamplingFields):
    """Exactly one of prompt, messages or prompts."""

    prompt: str | None = None
    messages: list[Message] | None = None
    prompts: list[str] | None = None
    stream: bool = False
    timeout: float | None = Field(None, gt=0, le=24 * 3600)   # seconds; then finish "timeout"
    priority: int | None = Field(None, ge=0, le=9)           # 0 runs first; Celery's steps

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
