"""Prompt-prefix reuse in the model worker: full KV blocks of recent prompts, found again by a
hash chain over their token ids (vLLM's automatic prefix caching: the cached blocks are the
paged KV cache's own blocks, shared by reference, not a second copy)."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def block_keys(token_ids: list[int], salt: str | None, num_blocks: int,
               block_size: int) -> list[bytes]:
    """The chained keys of a prompt's first num_blocks blocks.

    A block's key is a digest of the previous block's key and its own token ids, so a key names
    the whole prefix up to that block: two prompts share a block only if they agree on every
    token before it (keys and values depend on all of them). Positions match too, since every
    prompt starts at position 0. A request's `cache_salt` starts the chain, so prompts with
    different salts never share (vLLM's cache_salt: one tenant cannot time another's prompts).
    The salt is hashed on its own first: raw, a salt whose bytes equal some block's 16-byte key
    made a first block that another prompt's later block (at other positions) took for its own."""
    b = block_size
    keys, prev = [], hashlib.blake2b(b"llmq-cache-salt\0" + (salt or "").encode(),
                                     digest_size=16).digest()
    for i in range(num_blocks):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(array("q", token_ids[i * b:(i + 1) * b]).tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


class PrefixCache:
    """Which KV blocks hold which prompt prefix, and the LRU of those no sequence uses now.

    It owns no memory: blocks belong to the BlockPool. A full prompt block is registered under
    its key once its keys and values are computed; a later prompt with the same prefix takes a
    reference to it. A block whose last user left is "parked": still findable, evicted least
    recently used first when the pool needs a block or more than `max_parked` are parked."""

    def __init__(self, max_parked: int, block_size: int):
        self.block_size = block_size
        self.max_parked = max_parked
        self.enabled = max_parked > 0
        self.block_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.parked: OrderedDict[int, None] = OrderedDict()

    @property
    def num_parked(self) -> int:
        return len(self.parked)

    def keys(self, token_ids: list[int], salt: str | None, num_blocks: int) -> list[bytes]:
        return block_keys(token_ids, salt, num_blocks, self.block_size)

    def match(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """The blocks of the longest cached prefix of whole blocks, leaving at least one token
        to compute (the prefill must still produce the logits of the last prompt token)."""
        if not self.enabled:
            return []
        blocks = []
        for key in self.keys(token_ids, salt, (len(token_ids) - 1) // self.block_size):
            block = self.block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, key: bytes, block: int) -> None:
        """Names a freshly computed full block (a key already taken keeps its first block)."""
        if self.enabled and key not in self.block_of and block not in self.key_of:
            self.block_of[key] = block
            self.key_of[block] = key

    def park(self, block: int) -> list[int]:
        """The block's last user left. Returns the blocks to give back to the free list: this
        one if it holds no prefix, else the least recently used ones beyond `max_parked`."""
        if block not in self.key_of:
            return [block]
        self.parked[block] = None
        freed = []
        while len(self.parked) > self.max_parked:
            freed.append(self.evict())
        return freed

    def unpark(self, block: int) -> None:
        """A sequence took a reference to a parked block: it is not evictable now."""
        self.parked.pop(block, None)

    def evict(self) -> int | None:
        """Forgets the least recently parked block and returns it (None: nothing parked)."""
        if not self.parked:
            return None
        block, _ = self.parked.popitem(last=False)
        del self.block_of[self.key_of.pop(block)]
        return block
