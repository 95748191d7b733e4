"""The paged KV cache of the model worker: every sequence's own tokens, in fixed-size blocks.

One pool of `num_blocks` blocks of `block_size` token slots per layer (vLLM's PagedAttention
layout); each sequence has a block table, the blocks holding its tokens in order. Memory grows
with the sum of the sequences' lengths plus at most one partly filled block each, and a
sequence's attention reads its own tokens only (worker/model/transformers/paged_attention.py). Full prompt blocks
are shared between sequences through the prefix cache (worker/model/transformers/prefix_cache.py).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from .prefix_cache import PrefixCache


class KVCacheFull(RuntimeError):
    """No free block is left in the KV cache's budget."""


class BlockPool:
    """Block ids: the free ones, reference counts, and the prefix cache's parked blocks.

    Free blocks are handed out lowest id first, so the pool's memory that the process has
    touched stays the high-water mark of blocks in use: a long sequence's blocks are reused
    after it leaves, and the process does not keep growing."""

    def __init__(self, num_blocks: int, prefix: PrefixCache):
        self.num_blocks = num_blocks
        self.prefix = prefix
        self.free = list(range(num_blocks))    # a heap
        self.refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks a sequence can get now: free ones plus parked (evictable) prefix blocks."""
        return len(self.free) + self.prefix.num_parked

    def allocate(self) -> int:
        if self.free:
            block = heapq.heappop(self.free)
        else:
            block = self.prefix.evict()
            if block is None:
                raise KVCacheFull(f"all {self.num_blocks} KV cache blocks are in use")
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            self.prefix.unpark(block)
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        # Last block first: a prompt's first blocks become the most recently parked, so
        # eviction eats chains from their tails and never strands later blocks.
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                for b in self.prefix.park(block):
                    heapq.heappush(self.free, b)


@dataclass
class Row:
    """One sequence's part of a forward pass: `num_new` tokens after `num_past` cached ones."""

    seq_id: str
    num_past: int
    num_new: int
    slots: torch.Tensor       # [num_past + num_new] the pool slots of all its tokens, in order
    first_slot: int | None = None   # set when the slots are consecutive: read a view, no gather
    blocks: list[int] = field(default_factory=list)   # the blocks holding its tokens, in order
    _masks: dict = field(default_factory=dict, repr=False, compare=False)   # per pass

    @property
    def length(self) -> int:
        return self.num_past + self.num_new

    def block_ids(self) -> torch.Tensor:
        """`blocks` as a tensor, made once per pass (every layer gathers by it)."""
        if "blocks" not in self._masks:
            self._masks["blocks"] = torch.tensor(self.blocks, device=self.slots.device)
        return self._masks["blocks"]

    def chunk_mask(self, dtype: torch.dtype, rep: int = 1) -> torch.Tensor:
        """[rep x num_new, length] additive mask of the new tokens over all the row's tokens
        (query i, at position num_past + i, sees keys 0..num_past + i), the rows repeated
        `rep` times for query heads grouped by kv head. Made once per pass, not once per
        layer: a boolean mask is converted by SDPA on every call."""
        if (dtype, rep) not in self._masks:
            cols = torch.arange(self.length, device=self.slots.device)
            rows = torch.arange(self.num_past, self.length, device=self.slots.device)
            hidden = cols[None, :] > rows[:, None]
            mask = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
            self._masks[dtype, rep] = mask.masked_fill_(hidden, float("-inf")).repeat(rep, 1)
        return self._masks[dtype, rep]


@dataclass
class BatchPlan:
    """Where one forward pass reads and writes: the pass's tokens are the rows' new tokens, one
    row after another in `rows` order (a flat [1, tokens] batch, no padding): the decode rows
    first, group after group, then the prefill rows. Built by PagedKVCache.plan()."""

    cache: "PagedKVCache"
    rows: list[Row]
    write_slots: torch.Tensor                          # [tokens]: where each new token goes
    decode_groups: list["DecodeGroup"] = field(default_factory=list)
    prefill_rows: list[tuple[int, Row]] = field(default_factory=list)   # (first token, row)
    new_blocks: torch.Tensor | None = None   # allocated for this pass: zeroed before writing
    _decode_tables: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All decode rows' block tables [decode rows, most blocks] (padding: block 0, never
        read) and lengths [decode rows], int64, in token order: what the CPU decode kernel
        reads the pools by. Made once per pass, not once per layer."""
        if self._decode_tables is None:
            rows = self.rows[:sum(g.blocks.shape[0] for g in self.decode_groups)]
            width = max((len(r.blocks) for r in rows), default=0)
            self._decode_tables = (
                torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in rows],
                             dtype=torch.long, device=self.cache.device).view(len(rows), width),
                torch.tensor([r.length for r in rows], dtype=torch.long, device=self.cache.device))
        return self._decode_tables


@dataclass
class DecodeGroup:
    """Rows of one new token each and similar lengths, attended in one padded SDPA call; their
    tokens are tokens start..start + rows of the pass. Their keys are gathered by whole blocks
    (block ids, not slot ids: 1/block_size as many indices, each a block_size-times longer
    copy); attention reads each row's whole blocks, the slots past its length masked (new
    blocks are zeroed at their first pass, so those slots are never NaN)."""

    start: int
    blocks: torch.Tensor      # [rows, blocks of the longest row] (padding points at block 0)
    width: int                # the longest row's length: the slots attended per row
    block_size: int
    mask: torch.Tensor | None  # [rows, 1, 1, blocks x block_size] True at a row's tokens
    first_slot: int | None = None   # one row whose slots are consecutive from here

    @property
    def slots(self) -> torch.Tensor:
        """[rows, width] the pool slots attended (padding: block 0's), as the gather reads."""
        offsets = torch.arange(self.block_size, device=self.blocks.device)
        return (self.blocks[:, :, None] * self.block_size + offsets).flatten(1)[:, :self.width]

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as SDPA's additive float mask, made once per pass (not once per layer)."""
        if self.mask is not None and self.mask.dtype == torch.bool:
            self.mask = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device
                                    ).masked_fill_(~self.mask, float("-inf"))
        return self.mask


class PagedKVCache:
    """Block tables of the running sequences over one pool of KV blocks per layer.

    The pool tensors are created empty (not zeroed) at the first forward pass, after its key
    shapes: the operating system backs their pages only once blocks are written, so the
    process grows with the blocks in use, not with the budget."""

    def __init__(self, num_blocks: int, block_size: int = 8, max_rows: int = 64,
                 prefix_blocks: int = 0, max_group_padding: float = 0.25,
                 max_group_slots: int | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None):
        self.block_size = block_size
        self.device = torch.device(device)
        # The pools' dtype: None keeps the model's (the first keys'); float16 under a float32
        # model halves what decode attention reads (llama.cpp's default cache type).
        self.dtype = dtype
        self.max_rows = max_rows
        self.max_group_padding = max_group_padding
        self.max_group_slots = max_group_slots or float("inf")
        self.prefix = PrefixCache(prefix_blocks, block_size)
        self.pool = BlockPool(num_blocks, self.prefix)
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}       # tokens whose keys and values are stored
        self._slots: dict[str, torch.Tensor] = {}   # cached slot list per sequence
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        # worker/model/transformers/cpu_kernels.py's function when decode rows are attended by it (CPU), else
        # None. The function, not its module: a builtin function deep-copies as itself.
        self.decode_kernel = None

    # --- sequences --------------------------------------------------------------------------
    @property
    def seq_ids(self) -> list[str]:
        return list(self.tables)

    @property
    def num_rows(self) -> int:
        return len(self.tables)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def add(self, seq_id: str, prefix_blocks: list[int] = ()) -> None:
        """A new sequence, starting with shared prefix blocks (from PrefixCache.match)."""
        if seq_id in self.tables:
            raise RuntimeError(f"sequence {seq_id} is already in the KV cache")
        if self.num_rows >= self.max_rows:
            raise RuntimeError("batch is full")
        for b in prefix_blocks:
            self.pool.share(b)
        self.tables[seq_id] = list(prefix_blocks)
        self.lengths[seq_id] = len(prefix_blocks) * self.block_size

    def remove(self, seq_ids) -> None:
        for sid in seq_ids:
            blocks = self.tables.pop(sid, None)
            if blocks is not None:
                self.pool.release(blocks)
                del self.lengths[sid]
                self._slots.pop(sid, None)

    def register_prompt(self, seq_id: str, token_ids: list[int], salt: str | None) -> None:
        """Offers the sequence's full prompt blocks to the prefix cache."""
        if not self.prefix.enabled:
            return
        n = min(len(token_ids), self.lengths[seq_id]) // self.block_size
        for key, block in zip(self.prefix.keys(token_ids, salt, n), self.tables[seq_id]):
            self.prefix.register(key, block)

    # --- one forward pass -------------------------------------------------------------------
    def plan(self, new_tokens: list[tuple[str, int]]) -> BatchPlan:
        """Reserves slots for each (seq_id, number of new tokens) and lays out the pass. Blocks
        are allocated here (all or none: KVCacheFull leaves the cache as it was); lengths move
        only in commit(), after the pass succeeded."""
        got: list[tuple[str, int]] = []
        try:
            for sid, n in new_tokens:
                table = self.tables[sid]
                while len(table) * self.block_size < self.lengths[sid] + n:
                    table.append(self.pool.allocate())
                    got.append((sid, table[-1]))
        except KVCacheFull:
            for sid, block in reversed(got):
                self.tables[sid].remove(block)
                self.pool.release([block])
            raise
        rows = [self._row(sid, n) for sid, n in new_tokens]
        groups = self._group([r for r in rows if r.num_new == 1])
        prefills = [r for r in rows if r.num_new > 1]
        rows = [r for g in groups for r in g] + prefills
        plan = BatchPlan(self, rows, torch.cat([r.slots[r.num_past:] for r in rows]))
        if got:
            plan.new_blocks = torch.tensor([b for _s, b in got], device=self.device)
        start = 0
        for g in groups:
            plan.decode_groups.append(self._decode_group(start, g))
            start += len(g)
        for r in prefills:
            plan.prefill_rows.append((start, r))
            start += r.num_new
        return plan

    def commit(self, plan: BatchPlan) -> None:
        for r in plan.rows:
            if r.seq_id in self.lengths:
                self.lengths[r.seq_id] = r.length

    def _row(self, sid: str, num_new: int) -> Row:
        past = self.lengths[sid]
        row = Row(sid, past, num_new, self._slots_of(sid, past + num_new))
        row.blocks = self.tables[sid][:self.blocks_for(row.length)]
        # Blocks taken one after another from the free list (a long prompt's, mostly) are
        # consecutive: attention then reads a slice of the pool instead of gathering it.
        table = self.tables[sid]
        if len(table) > 1 and table[-1] - table[0] == len(table) - 1 and table == sorted(table):
            row.first_slot = table[0] * self.block_size
        return row

    def _slots_of(self, sid: str, length: int) -> torch.Tensor:
        """Slot ids of a sequence's first `length` tokens, extended from the last call's."""
        have = self._slots.get(sid)
        if have is None or have.numel() < length:
            table = torch.tensor(self.tables[sid], dtype=torch.long, device=self.device)
            offsets = torch.arange(self.block_size, dtype=torch.long, device=self.device)
            have = (table[:, None] * self.block_size + offsets).flatten()
            self._slots[sid] = have
        return have[:length]

    def _group(self, decodes: list[Row]) -> list[list[Row]]:
        """Decode rows in groups of similar length (padding at most max_group_padding of the
        real tokens), longest first: each group is one padded attention call, so a row's cost
        follows its own length, not the batch's longest. A group also spans at most
        max_group_slots slots (rows x longest), so that its gathered keys and values are still
        in the CPU's cache when its attention reads them (see TransformersBackend)."""
        groups: list[list[Row]] = []
        for row in sorted(decodes, key=lambda r: -r.length):
            g = groups[-1] if groups else None
            if g is not None and g[0].length * (len(g) + 1) <= self.max_group_slots:
                real = sum(r.length for r in g) + row.length
                if g[0].length * (len(g) + 1) <= (1 + self.max_group_padding) * real:
                    g.append(row)
                    continue
            groups.append([row])
        return groups

    def _decode_group(self, start: int, rows: list[Row]) -> DecodeGroup:
        longest = rows[0].length
        width = len(rows[0].blocks)
        blocks = torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in rows],
                              dtype=torch.long, device=self.device)
        mask = None
        if rows[-1].length < width * self.block_size:   # (sorted longest first)
            lengths = torch.tensor([r.length for r in rows], device=self.device)
            cols = torch.arange(width * self.block_size, device=self.device)
            mask = (cols[None, :] < lengths[:, None])[:, None, None, :]
        return DecodeGroup(start, blocks, longest, self.block_size, mask,
                           rows[0].first_slot if len(rows) == 1 else None)

    # --- the pool tensors -------------------------------------------------------------------
    def layer(self, idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer idx's (keys, values) pools, [slots, kv heads, head dim], created at first use
        after `like` ([1, kv heads, tokens, head dim]: the layer's new keys), in the cache's
        dtype if it has one."""
        while len(self.k) <= idx:
            self.k.append(None)
            self.v.append(None)
        if self.k[idx] is None:
            shape = (self.num_blocks * self.block_size, like.shape[1], like.shape[3])
            dtype = self.dtype or like.dtype
            self.k[idx] = torch.empty(shape, dtype=dtype, device=like.device)
            self.v[idx] = torch.empty(shape, dtype=dtype, device=like.device)
        return self.k[idx], self.v[idx]

    def scratch(self, num_slots: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [num_slots, kv heads, head dim] buffers for gathered keys and values, views of
        the same two tensors every time (grown, doubling, when a pass needs more)."""
        if self._scratch is None or self._scratch[0].shape[0] < num_slots:
            have = 0 if self._scratch is None else self._scratch[0].shape[0]
            size = max(num_slots, 2 * have, 1024)
            self._scratch = (like.new_empty(size, *like.shape[1:]),
                             like.new_empty(size, *like.shape[1:]))
        return self._scratch[0][:num_slots], self._scratch[1][:num_slots]
