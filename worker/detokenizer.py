"""Incremental detokenization: token ids in, text deltas out, never half a character."""
from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


# How many tokens before the first unread one are re-decoded for context. Byte-level BPE
# tokenizers merge spaces and multi-byte characters with their neighbours, so a token's text
# depends on what precedes it; a few tokens of context make each new piece exact.
_CONTEXT = 6


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas whose concatenation is the full text.

    Same technique as vLLM and TGI: decode a short window ending at the new tokens and emit only
    what it adds beyond the previously decoded window. A piece ending in U+FFFD is an incomplete
    UTF-8 character; it is held back until the following token completes it. The window, and
    so a token's cost, does not grow with the text.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Adds one token and returns the text it completes (may be empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        if full == prefix and not self._decode([token_id]):
            # A token that adds no text, here or alone (a skipped special token: a decode
            # drops those before it joins the rest), is not kept: the window would widen
            # with each one, and a run of them (EOS after EOS, with ignore_eos) made every
            # later decode longer.
            self.ids.pop()
        return ""

    def flush(self) -> str:
        """What is still held back at the end (a trailing incomplete character, if any)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""
