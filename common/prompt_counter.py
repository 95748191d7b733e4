"""Counting a request's prompt tokens in the API, torch-free, the way the worker tokenizes.

The Rust `tokenizers` library reads the model's tokenizer.json, and the chat template is
rendered with jinja2 as transformers renders it, so a prompt longer than the context is refused
before it queues (vLLM's API process does the same). Only the files are read: no transformers,
no torch. A model whose files the API cannot see (a GGUF file, a hub id not in the local cache)
has no counter; its worker still refuses such a prompt at admission.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("llmq.api")

# LLMQ_MODEL=smollm2 is converted once under LLMQ_MODEL_CACHE_DIR (worker/model_manager.py).
_DEFAULT_NAMES = ("smollm2", "SmolLM2-135M-Instruct")
_DEFAULT_FOLDER = "SmolLM2-135M-Instruct"


def model_folder(model: str, cache_dir: str) -> Path | None:
    """The local folder holding the model's tokenizer files, if the API can see one."""
    if model in _DEFAULT_NAMES:
        folder = Path(os.path.expanduser(cache_dir)) / _DEFAULT_FOLDER
    elif os.path.isdir(model):
        folder = Path(model)
    elif "/" in model and not model.startswith(("/", ".")):   # a hub id: its local snapshot
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "tokenizer.json")
        except Exception:  # noqa: BLE001 - no cache, a malformed id: no counter
            return None
        folder = Path(found).parent if isinstance(found, str) else None
    else:
        return None
    return folder if folder and (folder / "tokenizer.json").is_file() else None


class PromptCounter:
    """Counts prompt tokens: a raw prompt with the tokenizer's special tokens, chat messages
    through the model's chat template (with the generation prompt), as the worker does."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        self.template_source = template if isinstance(template, str) else None
        self.template = _compile(template) if isinstance(template, str) else None
        # bos_token, eos_token, ...: the names templates use (a string, or {"content": ...})
        self.special = {k: v if isinstance(v, str) else v.get("content", "")
                        for k, v in config.items()
                        if k.endswith("_token") and isinstance(v, (str, dict))}

    def count(self, inp: dict[str, Any]) -> int:
        """Tokens of one input ({"prompt": str}, {"prompt_token_ids": [...]} or
        {"messages": [...]})."""
        if inp.get("prompt_token_ids") is not None:
            return len(inp["prompt_token_ids"])
        return len(self.token_ids(inp))

    def token_ids(self, inp: dict[str, Any], add_special_tokens: bool | None = None,
                  add_generation_prompt: bool = True) -> list[int]:
        """The token ids of a prompt, or of messages through the chat template (whose text
        holds its special tokens already: none are added unless asked)."""
        if inp.get("messages") is not None:
            if self.template is None:
                raise ValueError("the model has no chat template; send a raw prompt")
            args = {"tools": None, "documents": None, **self.special,
                    **(inp.get("template_args") or {})}
            text = self.template.render(messages=inp["messages"],
                                        add_generation_prompt=add_generation_prompt, **args)
            return self.tokenizer.encode(text, add_special_tokens=bool(add_special_tokens)).ids
        return self.tokenizer.encode(inp["prompt"], add_special_tokens=add_special_tokens
                                     is not False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


class LazyPromptCounter:
    """Loads the counter on first use (the API starts without reading tokenizer files); a model
    whose files are not there yet (the default is converted by the first worker to start) is
    looked for again every RETRY_S seconds."""

    RETRY_S = 30.0

    def __init__(self, model: str, cache_dir: str):
        self.model, self.cache_dir = model, cache_dir
        self._lock = threading.Lock()
        self._next_try = 0.0
        self._counter: PromptCounter | None = None

    def get(self) -> PromptCounter | None:
        if self._counter is not None or time.monotonic() < self._next_try:
            return self._counter
        with self._lock:
            if self._counter is None and time.monotonic() >= self._next_try:
                self._next_try = time.monotonic() + self.RETRY_S
                folder = model_folder(self.model, self.cache_dir)
                try:
                    self._counter = PromptCounter(folder) if folder else None
                except Exception as exc:  # noqa: BLE001 - unreadable files: the worker checks
                    log.warning("cannot count prompt tokens in the API: %s", exc)
                if self._counter is None:
                    log.warning("no tokenizer for %s in the API (yet): prompts past the "
                                "context are refused by the worker instead", self.model)
            return self._counter


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _compile(template: str):
    """The template as transformers compiles it: a sandbox, its trim settings, loop controls,
    and the helpers templates call (raise_exception, a tojson that does not escape HTML,
    strftime_now)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
