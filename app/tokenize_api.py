"""vLLM's POST /tokenize and POST /detokenize, answered by the API itself with the tokenizer it
counts prompts with (common/prompt_counter.py): no worker, no queue. Shapes as vLLM's: a prompt
or chat messages in; `count`, `max_model_len`, `tokens` (and `token_strs` when asked) out."""
from __future__ import annotations

from typing import Annotated, Any

from flask import Blueprint, Flask, jsonify
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .context import engine, settings
from .request_body import describe, parse_json_body
from .errors import APIError
from .model_routing import routed_model
from .openai_api import ChatMessage, _text_content

bp = Blueprint("tokenize", __name__)

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class TokenizeRequest(BaseModel):
    """A prompt (add_special_tokens defaults on) or messages (through the chat template;
    add_generation_prompt defaults on, add_special_tokens off), as vLLM takes them."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1_000_000)


def _parsed(model_cls):
    try:
        req = model_cls.model_validate(parse_json_body())
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]
        raise APIError(400, describe(exc), param=str(loc[0]) if loc else None) from None
    routed_model(req.model)
    return req


def _counter(model: str | None):
    counter = engine().prompt_counter_for(model).get()
    if counter is None:
        # As /v1/webhooks/secret answers a feature this server lacks: not a 5xx (nothing
        # failed), and no retry will change it while the model's files stay out of sight.
        raise APIError(404, "the API has no tokenizer for this model (its files are not "
                       "visible to the API process)", "not_found_error",
                       code="tokenizer_unavailable")
    return counter


@bp.post("/tokenize")
def tokenize():
    req = _parsed(TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
    if req.prompt is not None and len(req.prompt) > settings().max_prompt_chars:
        raise APIError(400, f"prompt too long (at most {settings().max_prompt_chars} "
                       "characters)", param="prompt")
    inp: dict[str, Any] = ({"prompt": req.prompt} if req.prompt is not None else
                           {"messages": [{"role": "system" if m.role == "developer" else m.role,
                                          "content": _text_content(m.content)}
                                         for m in req.messages]})
    counter = _counter(req.model)
    try:
        ids = counter.token_ids(inp, req.add_special_tokens, req.add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - a template's raise_exception, bad content
        raise APIError(400, f"cannot tokenize: {exc}", param="messages" if req.messages
                       else "prompt", code="invalid_prompt") from None
    body = {"count": len(ids), "max_model_len": engine().context_length(req.model), "tokens": ids,
            "token_strs": ([counter.tokenizer.id_to_token(i) for i in ids]
                           if req.return_token_strs else None)}
    return jsonify(body)


@bp.post("/detokenize")
def detokenize():
    req = _parsed(DetokenizeRequest)
    counter = _counter(req.model)
    if any(t >= counter.tokenizer.get_vocab_size() for t in req.tokens):
        raise APIError(400, f"token ids must be below the vocabulary size "
                       f"({counter.tokenizer.get_vocab_size()})", param="tokens")
    return jsonify({"prompt": counter.decode(req.tokens)})


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)
