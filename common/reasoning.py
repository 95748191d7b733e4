"""Reasoning models' thinking, split out of the answer: `<think>...</think>` becomes
`reasoning_content` beside `content`, as vLLM's reasoning parsers return it. Applied when the
model's chat template names the markers (Qwen3, SmolLM3) and the answer opens with `<think>`
(an answer without it, as with `enable_thinking: false`, is all content)."""
from __future__ import annotations

START, END = "<think>", "</think>"


def template_reasons(template: str | None) -> bool:
    """Whether a chat template's source names the thinking markers."""
    return bool(template) and END in template


def split(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a whole answer; reasoning None when there was none. An answer
    cut short inside its thinking is all reasoning."""
    body = text.lstrip()
    if not body.startswith(START):
        return None, text
    reasoning, _, content = body[len(START):].partition(END)
    return reasoning.lstrip(), content.lstrip()


def thinking(text: str) -> str:
    """The thinking part of an answer as the model wrote it, markers included ("" if none):
    what its reasoning tokens are counted from."""
    body = text.lstrip()
    if not body.startswith(START):
        return ""
    at = body.find(END)
    return body if at < 0 else body[:at + len(END)]


def add_reasoning_tokens(usage: dict, texts: list[str], count_tokens) -> dict:
    """usage with OpenAI's completion_tokens_details.reasoning_tokens: the answers' thinking
    counted with `count_tokens(text)` (the tokenizer's count of the text, re-tokenized)."""
    n = sum(count_tokens(t) for t in map(thinking, texts) if t)
    usage["completion_tokens_details"] = {"reasoning_tokens": n}
    return usage


class ReasoningSplitter:
    """Splits a streamed answer piece by piece: text that may be the start of a marker is held
    until the next piece says whether it is."""

    def __init__(self):
        # start (nothing decisive yet) | thinking | answer; `blank`: leading blanks of the
        # current part are still dropped (split() drops them too)
        self.state, self.blank = "start", False
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) to send for this piece."""
        text, self.held = self.held + piece, ""
        reasoning = content = ""
        while text:
            if self.blank:
                text = text.lstrip()
                self.blank = not text
                continue
            if self.state == "answer":
                return reasoning, content + text
            if self.state == "start":
                stripped = text.lstrip()
                if not stripped or START.startswith(stripped):
                    self.held = text   # blank or a marker's beginning: wait for more
                    return reasoning, content
                if stripped.startswith(START):
                    self.state, self.blank, text = "thinking", True, stripped[len(START):]
                else:
                    self.state = "answer"
                continue
            # thinking: until END (an answer cut short inside it stays reasoning)
            at = text.find(END)
            if at >= 0:
                reasoning += text[:at]
                text, self.state, self.blank = text[at + len(END):], "answer", True
                continue
            keep = _partial_suffix(text, END)
            reasoning += text[:len(text) - keep]
            self.held = text[len(text) - keep:]
            return reasoning, content
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is still held at the end."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            return held, ""
        return ("", held)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
