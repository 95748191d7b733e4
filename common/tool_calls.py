"""Tool calling on the chat route: which call format a model's chat template speaks, the
messages and template arguments a request with tools becomes, the grammar that makes a call
valid, and the calls parsed back out of the text. Torch-free (the API, the batch driver and
later the Responses API share it).

Formats:
- "hermes": templates that render `tools` and write `<tool_call>{"name", "arguments"}</tool_call>`
  (Qwen2.5/3, Hermes, SmolLM3): the tools go to the template, the calls are parsed from the tags.
- "llama3_json": Llama 3.1+ templates: a bare `{"name", "parameters"}` object (after an
  optional `<|python_tag|>`).
- "mistral": Mistral templates (`[AVAILABLE_TOOLS]`, `[TOOL_CALLS]`): `[TOOL_CALLS]` and a JSON
  list of `{"name", "arguments"}`; the list is a call without its marker too (the marker is a
  special token, which the detokenizer drops). Past calls' ids are cut to the 9 letters and
  digits Mistral's templates insist on.
- "generic": any other template (SmolLM2, the default, and templates whose tool format is not
  recognised): as llama.cpp's server does, the tools are described in the system prompt and the
  answer is a JSON object, `{"tool_calls": [{"name", "arguments"}]}` or `{"response": text}`.

`required` and a named function decode under a grammar built from the tools' parameter
schemas, so a call's arguments always parse and validate; `auto` does too in the generic
format (the grammar is "a call or a text answer") and in the Hermes one (a lazy grammar: free
text until the model opens `<tool_call>`, the call under the schema); Llama 3.1's and Mistral's `auto`
are free text, their calls parsed after the fact; `none` renders no tools and never calls.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .structured import JSON_OPTIONS, bounded

GENERIC, HERMES, LLAMA3, MISTRAL = "generic", "hermes", "llama3_json", "mistral"
MISTRAL_MARKER = "[TOOL_CALLS]"

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def detect_format(template: str | None) -> str:
    """The call format a chat template's source speaks (GENERIC when it renders no tools)."""
    if not template or "tools" not in template:
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if MISTRAL_MARKER in template:
        return MISTRAL
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3
    return GENERIC


def choice_name(tool_choice: Any) -> str | None:
    """The function a named tool_choice names, else None."""
    if isinstance(tool_choice, dict):
        return (tool_choice.get("function") or {}).get("name")
    return None


class ToolRequest:
    """One request's tools, as the route sees them: `tools` (OpenAI's function tools, as
    dicts), `tool_choice` ("none", "auto", "required" or {"type": "function", "function":
    {"name"}}), `parallel_tool_calls`, and the format of the model's template."""

    def __init__(self, tools: list[dict], tool_choice: Any, parallel: bool, fmt: str):
        name = choice_name(tool_choice)
        self.choice = "named" if name else (tool_choice or "auto")
        # A named function is called once (the request asked for that call).
        self.fmt, self.parallel = fmt, parallel and not name
        self.tools = [t for t in tools if name is None or t["function"]["name"] == name]
        self.names = [t["function"]["name"] for t in tools]

    @property
    def active(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    # --- rendering -----------------------------------------------------------------------
    def messages(self, messages: list[dict]) -> list[dict]:
        """The conversation as the template gets it: native formats keep tool messages (with
        a call's arguments as an object, as transformers' templates read them); the generic
        one writes past calls as the JSON the model answers with and results as user turns,
        and describes the tools in the system prompt."""
        out = [self._message(m) for m in messages]
        if self.fmt == GENERIC and self.active:
            prompt = self._system_prompt()
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    def template_args(self) -> dict[str, Any]:
        """apply_chat_template's extra arguments: the tools, for a native format."""
        return {"tools": self.tools} if self.active and self.fmt != GENERIC else {}

    def _message(self, m: dict) -> dict:
        calls = m.get("tool_calls") or []
        if self.fmt == GENERIC:
            if calls:
                body = {"tool_calls": [{"name": c["function"]["name"],
                                        "arguments": _arguments(c["function"])} for c in calls]}
                return {"role": "assistant", "content": json.dumps(body, ensure_ascii=False)}
            if m["role"] == "tool":
                result = {"tool_call_id": m.get("tool_call_id"), "content": m["content"]}
                return {"role": "user", "content": json.dumps({"tool_response": result},
                                                              ensure_ascii=False)}
            return {"role": m["role"], "content": m["content"] or ""}
        call_id = _mistral_id if self.fmt == MISTRAL else (lambda x: x)
        out = {"role": m["role"], "content": m["content"] or ""}
        if calls:
            out["tool_calls"] = [{"id": call_id(c.get("id")), "type": "function", "function": {
                "name": c["function"]["name"], "arguments": _arguments(c["function"])}}
                for c in calls]
        if m["role"] == "tool":
            out["tool_call_id"] = call_id(m.get("tool_call_id"))
        return out

    def _system_prompt(self) -> str:
        described = [{"name": t["function"]["name"],
                      "description": t["function"].get("description") or "",
                      "parameters": t["function"].get("parameters") or {"type": "object"}}
                     for t in self.tools]
        lines = ["You can call the following tools to answer the user:",
                 json.dumps(described, ensure_ascii=False), "",
                 'To call tools, answer with only this JSON object: {"tool_calls": '
                 '[{"name": "<tool name>", "arguments": {<its arguments>}}]}']
        if self.choice == "auto":
            lines.append('To answer without a tool, answer with: {"response": "<your answer>"}')
        return "\n".join(lines)

    # --- enforcement ---------------------------------------------------------------------
    def structured_spec(self) -> dict[str, Any] | None:
        """The grammar the answer decodes under (common/structured.py's spec), or None."""
        if not self.active:
            return None
        if self.fmt == GENERIC:
            calls = {"type": "array", "items": self._any_call("arguments"), "minItems": 1}
            if not self.parallel:
                calls["maxItems"] = 1
            schema = {"type": "object", "properties": {"tool_calls": calls},
                      "required": ["tool_calls"], "additionalProperties": False}
            if not self.forced:
                text = {"type": "object", "properties": {"response": {"type": "string"}},
                        "required": ["response"], "additionalProperties": False}
                schema = {"anyOf": [schema, text]}
            return {"type": "json_schema", "value": schema}
        if self.fmt == LLAMA3:
            # auto: free text, a call parsed after the fact (its opening is no fixed string)
            return ({"type": "json_schema", "value": self._any_call("parameters")}
                    if self.forced else None)
        if self.fmt == MISTRAL:
            # Forced: the list without its marker (a special token, not text a grammar
            # matches); auto: free text, the calls parsed after the fact.
            calls = {"type": "array", "items": self._any_call("arguments"), "minItems": 1}
            if not self.parallel:
                calls["maxItems"] = 1
            return {"type": "json_schema", "value": calls} if self.forced else None
        call_schema = {**bounded(self._any_call("arguments")), "x-guidance": JSON_OPTIONS}
        if not self.forced:
            # A lazy grammar: free text until the model opens a call, the call under the
            # tools' schema, then free text again.
            from llguidance import StructTag

            tag = StructTag(trigger="<tool_call>", begin="<tool_call>\n", grammar=call_schema,
                            end="\n</tool_call>")
            return {"type": "grammar", "value": StructTag.to_grammar([tag],
                                                                     assume_special=False)}
        call = json.dumps(call_schema)
        repeat = ' ("\\n" call)*' if self.parallel else ""
        lark = (f'start: call{repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
                f"body: %json {call}\n")
        return {"type": "grammar", "value": lark}

    def _any_call(self, args_key: str) -> dict:
        options = [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]},
            args_key: t["function"].get("parameters") or {"type": "object"}},
            "required": ["name", args_key], "additionalProperties": False} for t in self.tools]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def shape(self) -> dict[str, Any] | None:
        """What the answer's shaper needs to parse calls (kept with a batch line)."""
        return {"format": self.fmt, "names": self.names} if self.active else None


def _arguments(function: dict) -> Any:
    """A call's arguments as an object (OpenAI sends them as a JSON string)."""
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except ValueError:
            return args
    return args if args is not None else {}


def parse_calls(text: str, tools: dict, call_id: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer; `tools` is ToolRequest.shape(). A call is kept only
    when it names one of the request's tools with an object of arguments; text that is not a
    call stays content."""
    fmt, names = tools["format"], set(tools["names"])
    found: list[dict] = []
    content: str | None = text
    if fmt == GENERIC:
        obj = _json(text)
        if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
            found, content = obj["tool_calls"], None
        elif isinstance(obj, dict) and isinstance(obj.get("response"), str):
            content = obj["response"]
    elif fmt == HERMES:
        found = [c for c in (_json(m) for m in _HERMES_CALL.findall(text)) if c is not None]
        content = _HERMES_CALL.sub("", text).strip() if found else text
    elif fmt == MISTRAL:
        before, marker, after = text.partition(MISTRAL_MARKER)
        obj = _json(after if marker else text)
        if isinstance(obj, list) and obj:
            found, content = obj, before.strip() if marker else None
    elif fmt == LLAMA3:
        obj = _json(text.strip().removeprefix("<|python_tag|>"))
        if isinstance(obj, dict) and "name" in obj:
            found, content = [{"name": obj["name"], "arguments": obj.get(
                "parameters", obj.get("arguments"))}], None
    calls = []
    for c in found:
        if not (isinstance(c, dict) and c.get("name") in names
                and isinstance(c.get("arguments"), dict)):
            return text, []
        calls.append({"id": f"call_{call_id}_{len(calls)}", "type": "function",
                      "function": {"name": c["name"],
                                   "arguments": json.dumps(c["arguments"], ensure_ascii=False)}})
    return (content or None) if calls else content, calls


def _mistral_id(call_id: str | None) -> str:
    """A call id as Mistral's templates take it: 9 letters and digits (its last ones, as vLLM
    cuts them)."""
    kept = re.sub(r"[^A-Za-z0-9]", "", call_id or "")
    return kept[-9:].rjust(9, "0")


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
