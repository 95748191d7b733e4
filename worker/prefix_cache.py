"""Prompt-prefix reuse in the model worker: the keys and values of recently prefilled prompt
blocks, found again by a hash chain over their token ids (vLLM's automatic prefix caching,
without paging: a hit is copied into the batch's cache, then only the rest is prefilled)."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefixMatch:
    """What the cache holds of one prompt: its first `num_tokens` tokens' keys and values."""

    num_tokens: int
    blocks: list[torch.Tensor]   # each [layers, 2 (k, v), kv heads, block_size, head dim]

    def kv(self) -> torch.Tensor | None:
        """[layers, 2, kv heads, num_tokens, head dim], or None for a miss."""
        return torch.cat(self.blocks, dim=3) if self.blocks else None


class PrefixCache:
    """Keys and values of prompt blocks, least recently used first out, within a byte budget.

    A block is `block_size` consecutive prompt tokens starting at a multiple of it. Its key is
    a digest of the previous block's key and its own token ids, so a key names the whole prefix
    up to that block: two prompts share a block only if they agree on every token before it
    (keys and values depend on all of them). Positions match too, since every prompt starts at
    position 0. A request's `cache_salt` starts the chain, so prompts with different salts
    never share (vLLM's cache_salt: one tenant cannot time another's prompts)."""

    def __init__(self, max_bytes: int, block_size: int = 8):
        # 8, not vLLM's 16: without paging a block is only a lookup unit, and the shared part
        # of short chat prompts (the template's system turn, ~27 tokens for SmolLM2) is then
        # mostly reused rather than half.
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.enabled = max_bytes > 0

    def _keys(self, token_ids: list[int], salt: str | None, num_blocks: int) -> list[bytes]:
        keys, prev, b = [], (salt or "").encode(), self.block_size
        for i in range(num_blocks):
            h = hashlib.blake2b(prev, digest_size=16)
            h.update(array("q", token_ids[i * b:(i + 1) * b]).tobytes())
            prev = h.digest()
            keys.append(prev)
        return keys

    def match(self, token_ids: list[int], salt: str | None = None) -> PrefixMatch:
        """The longest cached prefix of whole blocks, leaving at least one token to compute
        (the prefill must still produce the logits of the last prompt token)."""
        if not self.enabled:
            return PrefixMatch(0, [])
        blocks, keys = [], []
        for key in self._keys(token_ids, salt, (len(token_ids) - 1) // self.block_size):
            kv = self.blocks.get(key)
            if kv is None:
                break
            blocks.append(kv)
            keys.append(key)
        self._touch(keys)
        return PrefixMatch(len(blocks) * self.block_size, blocks)

    def _touch(self, keys: list[bytes]) -> None:
        # Last block first, so a prompt's first block is the most recent: eviction takes a
        # chain from its tail, never leaving later blocks that no lookup can reach.
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def insert(self, token_ids: list[int], salt: str | None, kv_of) -> int:
        """Stores the prompt's whole blocks that are not cached yet; `kv_of(start, end)` gives
        the [layers, 2, heads, end - start, dim] keys and values of prompt tokens start..end.
        Returns how many blocks were added."""
        if not self.enabled:
            return 0
        added, b = 0, self.block_size
        keys = self._keys(token_ids, salt, len(token_ids) // b)
        self._touch(keys)   # this prompt's cached blocks are not the ones to evict for it
        for i, key in enumerate(keys):
            if key in self.blocks:
                continue
            kv = kv_of(i * b, (i + 1) * b).clone()
            size = kv.numel() * kv.element_size()
            if size > self.max_bytes:
                break
            while self.num_bytes + size > self.max_bytes:
                _, old = self.blocks.popitem(last=False)
                self.num_bytes -= old.numel() * old.element_size()
            self.blocks[key] = kv
            self.num_bytes += size
            added += 1
        self._touch(keys)
        return added

    def clear(self) -> None:
        self.blocks.clear()
        self.num_bytes = 0
