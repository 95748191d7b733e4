"""Request bodies, validated by pydantic. Limits come from Settings through the context."""
from __future__ import annotations

import json

from typing import Annotated, Any, ClassVar, Literal

from flask import has_app_context
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from common.protocol import SamplingParams
from common.settings import Settings
from common.tool_calls import ToolRequest, choice_name, detect_format

from .context import settings
from .grammar_check import grammar_error

MAX_LOGPROBS = 20   # vLLM's default --max-logprobs
# logit_bias entries (OpenAI's cap): each is an edit of the logits at every token of the
# sequence, inside the step the whole batch shares.
MAX_LOGIT_BIAS = 300


def max_stop_token_ids() -> int:
    """LLMQ_MAX_STOP_TOKEN_IDS of the serving app (the default outside a request, as in a unit
    test of the schemas)."""
    if has_app_context():
        return settings().max_stop_token_ids
    return Settings().max_stop_token_ids


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionCall(BaseModel):
    """A past call's function: its name and its arguments as a JSON string."""

    model_config = ConfigDict(extra="forbid")
    name: FunctionName
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    """A call an assistant message made (OpenAI's message.tool_calls item)."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    """A function tool: its name, description and JSON-schema parameters."""

    model_config = ConfigDict(extra="forbid")
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None   # arguments always follow the schema under the grammar


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: FunctionName


class NamedToolChoice(BaseModel):
    """tool_choice naming one function; a tool has the same shape with the whole function."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class Tool(NamedToolChoice):
    function: FunctionDef


class Message(BaseModel):
    """A chat message: text content, an assistant's tool_calls, a tool result."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _check(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (an assistant message may give tool_calls "
                             "instead)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return self



class ToolFields(BaseModel):
    """OpenAI's tool fields and the chat template's arguments, for requests with messages
    (chat completions, /v1/jobs): how the messages are rendered (common/tool_calls.py), the
    grammar the calls decode under, and how the calls are read back."""

    model_config = ConfigDict(extra="forbid")
    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset({"parallel_tool_calls"})

    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    _tools: ToolRequest | None = PrivateAttr(None)   # set by chat_input (needs the template)

    def _choice(self) -> Any:
        c = self.tool_choice
        return c.model_dump() if isinstance(c, BaseModel) else c

    def tools_problem(self) -> tuple[str, str] | None:
        """(param, message) for tool fields that do not go together."""
        names = [t.function.name for t in self.tools or []]
        choice = self._choice()
        if len(set(names)) != len(names):
            return "tools", "tool names must be unique"
        if choice_name(choice) is not None and choice_name(choice) not in names:
            return "tool_choice", f"tool_choice names {choice_name(choice)!r}, not in tools"
        if choice == "required" and not names:
            return "tool_choice", "tool_choice 'required' needs tools"
        fmt = getattr(self, "response_format", None)
        if names and choice != "none" and (getattr(self, "structured_outputs", None) is not None
                                           or fmt is not None and fmt.type != "text"):
            return "tools", ("tools cannot be combined with a structured response_format or "
                             "structured_outputs (the tool calls decode under their own grammar)")
        return None

    def chat_input(self, messages: list[dict], template: str | None,
                   default_kwargs: dict) -> dict[str, Any]:
        """One sequence input for the messages (dicts: role, content as text or None,
        tool_calls, tool_call_id), rendered for the call format of the model's chat template
        (its source; None: not known here)."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        self._tools = req = ToolRequest(tools, self._choice() or ("auto" if tools else "none"),
                                        self.parallel_tool_calls, detect_format(template))
        messages = [{**m, "role": "system" if m["role"] == "developer" else m["role"]}
                    for m in messages]
        args = {**default_kwargs, **(self.chat_template_kwargs or {}), **req.template_args()}
        return {"messages": req.messages(messages), "template_args": args or None,
                "call_format": req.shape()}

    def tools_error(self) -> str | None:
        """Why the tools' grammar cannot compile (after chat_input), or None."""
        if self._tools is None or not self._tools.active:
            return None
        spec = self._tools.structured_spec()
        return grammar_error(spec) if spec else None

    def structured_spec(self) -> dict[str, Any] | None:
        if self._tools is not None and self._tools.active:
            return self._tools.structured_spec()
        return super().structured_spec()


class JsonSchemaSpec(BaseModel):
    """OpenAI's response_format.json_schema (what the SDK's parse() sends)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


def _compiled(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec, once its grammar is known to compile (else a 400 that says why)."""
    error = grammar_error(spec)
    if error:
        raise ValueError(f"cannot compile the {spec['type'].replace('_', ' ')}: {error}")
    return spec


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (free), any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema")
        if self.spec() is not None:
            _compiled(self.spec())
        return self

    def spec(self) -> dict[str, Any] | None:
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.type == "json_schema":
            return {"type": "json_schema", "value": self.json_schema.schema_}
        return None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice, grammar or
    json_object. vLLM's whitespace and fallback options are accepted and have no effect."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _check(self):
        given = [n for n in ("json_", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar or json_object")
        _compiled(self.spec())
        return self

    def spec(self) -> dict[str, Any]:
        if self.json_object:
            return {"type": "json_object"}
        if self.json_ is not None:
            try:
                schema = json.loads(self.json_) if isinstance(self.json_, str) else self.json_
            except RecursionError:   # (pydantic turns a ValueError into a 400; not this)
                raise ValueError("json: the schema is nested too deeply") from None
            return {"type": "json_schema", "value": schema}
        kind = next(n for n in ("regex", "choice", "grammar") if getattr(self, n) is not None)
        return {"type": kind, "value": getattr(self, kind)}


class SamplingFields(BaseModel):
    """Sampling and queueing parameters every submitting route accepts (vLLM's names and
    ranges): /v1/jobs, /v1/generate and the OpenAI routes."""

    model_config = ConfigDict(extra="forbid")
    # Fields with a default that a client may also send as null, meaning that default (OpenAI's
    # spec makes n, stream and echo nullable, vLLM all of these): a wrapper that forwards
    # `n=kwargs.get("n")` sends null. Subclasses add their own.
    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset({"min_tokens", "ignore_eos"})

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)   # ints past 2**63 overflow the sampler
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)   # vLLM: any int64 (some UIs send -1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    timeout: float | None = Field(None, gt=0, le=24 * 3600)   # seconds; then finish "timeout"
    priority: int | None = Field(None, ge=0, le=9)           # 0 runs first; Celery's steps
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)   # the k most likely, per token
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.NULL_IS_DEFAULT}
        return data

    # The counts are checked on the raw input, before pydantic validates each item: a refused
    # whole-vocabulary logit_bias or 200,000 stop ids would otherwise cost ~10 ms of checking
    # every entry (issue 48: four clients sending them back to back kept an API core busy).
    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _few_stop_ids(cls, v):
        cap = max_stop_token_ids()
        if isinstance(v, list) and len(v) > cap:
            # Looked up at every token, and blocked at every token while min_tokens applies,
            # inside the step every tenant's sequences share.
            raise ValueError(f"at most {cap} stop_token_ids (LLMQ_MAX_STOP_TOKEN_IDS)")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _few_biases(cls, v):
        if isinstance(v, dict) and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries (as OpenAI)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v):
        if v and any(not k.isdigit() or int(k) >= 2**31 for k in v):
            raise ValueError("keys must be token ids")
        return v

    def num_logprobs(self) -> int | None:
        """How many top logprobs each sampled token gets (None: no logprobs)."""
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def structured_spec(self) -> dict[str, Any] | None:
        if self.structured_outputs is not None:
            return self.structured_outputs.spec()
        return self.response_format.spec() if self.response_format is not None else None

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
        max_completion_tokens). top_k -1 and 0 both mean off, as in vLLM and OpenAI clients:
        0, which the worker keeps (None would take the model's generation_config top_k)."""
        return SamplingParams(
            max_tokens=next(m for m in (max_tokens, self.max_tokens, default_max_tokens)
                            if m is not None),   # 0 is a value (echo with max_tokens 0)
            temperature=self.temperature, top_p=self.top_p,
            top_k=0 if self.top_k in (-1, 0) else self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, seed=self.seed,
            stop=list(self.stop), stop_token_ids=list(self.stop_token_ids or []),
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, cache_salt=self.cache_salt,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            logprobs=self.num_logprobs(), prompt_logprobs=self.num_prompt_logprobs(),
            structured=self.structured_spec())


class WebhookFields(BaseModel):
    """Where to tell the caller about a job's (or a batch's) progress, as Replicate does."""

    model_config = ConfigDict(extra="forbid")

    webhook: str | None = Field(None, min_length=1, max_length=2048)
    webhook_events: list[Literal["started", "completed"]] = Field(
        default_factory=lambda: ["completed"], min_length=1, max_length=2)


class JobRequest(ToolFields, SamplingFields, WebhookFields):
    """Exactly one of prompt, messages or prompts; tools go with messages."""

    NULL_IS_DEFAULT = SamplingFields.NULL_IS_DEFAULT | ToolFields.NULL_IS_DEFAULT | {"stream"}

    # a name of /v1/models (an alias too); unset: the default model
    model: str | None = None
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
        if self.messages is None and (self.tools or self.chat_template_kwargs):
            raise ValueError("'tools' and 'chat_template_kwargs' go with 'messages'")
        if problem := self.tools_problem():
            raise ValueError(problem[1])
        if self.prompts is not None:
            if not self.prompts:
                raise ValueError("'prompts' must not be empty")
            if any(not p.strip() for p in self.prompts):
                raise ValueError("every prompt in 'prompts' must be a non-empty string")
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("'min_tokens' must not exceed 'max_tokens'")
        return self
