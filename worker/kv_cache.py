"""The running batch's KV cache, kept in the model-worker process across decode steps."""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _SlotLayer(CacheLayerMixin):
    """One layer's view of BatchKVCache: writes the step's keys/values in place (no torch.cat)."""

    is_compileable = False

    def __init__(self, owner: "BatchKVCache", idx: int):
        super().__init__()
        self.owner, self.idx = owner, idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist already
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        o, q = self.owner, key_states.shape[-2]
        rows = key_states.shape[0]
        o.k[self.idx][:rows, :, o.end:o.end + q] = key_states
        o.v[self.idx][:rows, :, o.end:o.end + q] = value_states
        return (o.k[self.idx][:rows, :, o.start:o.end + q],
                o.v[self.idx][:rows, :, o.start:o.end + q])

    def get_seq_length(self) -> int:
        return self.owner.end - self.owner.start

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class BatchKVCache:
    """Keys and values of every running sequence, one preallocated buffer per layer.

    Rows are sequences (kept compact: a leaving row is replaced by the last one). Columns are a
    shared time axis; each row is right-aligned to the write column `end`, and the attention
    mask hides the columns before a row's first token (left padding). A decode step writes one
    column for all rows in place; nothing is re-copied per step, unlike DynamicCache's concat.
    """

    def __init__(self, max_rows: int, initial_cols: int = 256):
        self.max_rows = max_rows
        self.cap = initial_cols
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.mask: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None
        self.seq_ids: list[str] = []
        self.start = self.end = 0
        self.cache = Cache(layers=[])

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)

    def _allocate_like(self, layers) -> None:
        """Buffers shaped after the first prefill's cache, so any attention layout works."""
        k0 = layers[0].keys
        dev, dt = k0.device, k0.dtype
        self.k = [torch.zeros(self.max_rows, l.keys.shape[1], self.cap, l.keys.shape[3], dtype=dt, device=dev) for l in layers]
        self.v = [torch.zeros(self.max_rows, l.values.shape[1], self.cap, l.values.shape[3], dtype=dt, device=dev) for l in layers]
        self.mask = torch.zeros(self.max_rows, self.cap, dtype=torch.long, device=dev)
        self.pos = torch.zeros(self.max_rows, dtype=torch.long, device=dev)
        self.cache = Cache(layers=[_SlotLayer(self, i) for i in range(len(layers))])

    def _relocate(self, new_start: int, min_cap: int) -> None:
        """Moves the window to begin at new_start, in place while the buffers are big enough;
        grows them (doubling) only when they are not. Zeroing fresh buffers costs ~0.3 s for
        64 rows of SmolLM2 on a CPU, so it must not happen on every prefill."""
        b, w = self.num_rows, self.end - self.start
        src, dst = slice(self.start, self.end), slice(new_start, new_start + w)
        if min_cap > self.cap:
            cap = self.cap
            while cap < min_cap:
                cap *= 2
            for bufs in (self.k, self.v):
                for i, old in enumerate(bufs):
                    new = old.new_zeros(old.shape[0], old.shape[1], cap, old.shape[3])
                    new[:b, :, dst] = old[:b, :, src]
                    bufs[i] = new
            mask = self.mask.new_zeros(self.max_rows, cap)
            mask[:b, dst] = self.mask[:b, src]
            self.mask, self.cap = mask, cap
        elif b and w and new_start != self.start:
            # Columns outside a row's mask are never attended, so stale values there are fine;
            # the window's data moves (clone: source and target may overlap).
            for bufs in (self.k, self.v):
                for buf in bufs:
                    buf[:b, :, dst] = buf[:b, :, src].clone()
            window = self.mask[:b, src].clone()
            self.mask[:b] = 0
            self.mask[:b, dst] = window
        self.start, self.end = new_start, new_start + w

    def add(self, seq_ids: list[str], layers, mask2d: torch.Tensor, next_pos: torch.Tensor) -> None:
        """Appends newly prefilled sequences (their left-padded prefill cache) as new rows."""
        n, length = mask2d.shape
        if not self.k:
            self._allocate_like(layers)
        if self.num_rows + n > self.max_rows:
            raise RuntimeError("batch is full")
        if self.num_rows == 0:
            self.start = self.end = 0
        if self.end < length:
            w = self.end - self.start
            new_end = max(self.end, length)
            self._relocate(new_end - w, min_cap=new_end + 64)
        b = self.num_rows
        new_start = min(self.start, self.end - length)
        self.mask[:b, new_start:self.start] = 0
        self.start = new_start
        rows, cols = slice(b, b + n), slice(self.end - length, self.end)
        for i, layer in enumerate(layers):
            self.k[i][rows, :, cols] = layer.keys
            self.v[i][rows, :, cols] = layer.values
        self.mask[rows] = 0
        self.mask[rows, cols] = mask2d
        self.pos[rows] = next_pos
        self.seq_ids.extend(seq_ids)

    def remove(self, seq_ids) -> None:
        """Drops rows (the last row moves into each hole) and trims all-padding columns."""
        for sid in seq_ids:
            if sid not in self.seq_ids:
                continue
            i, last = self.seq_ids.index(sid), self.num_rows - 1
            if i != last:
                win = slice(self.start, self.end)
                for bufs in (self.k, self.v):
                    for buf in bufs:
                        buf[i, :, win] = buf[last, :, win]
                self.mask[i] = self.mask[last]
                self.pos[i] = self.pos[last]
                self.seq_ids[i] = self.seq_ids[last]
            self.seq_ids.pop()
        if self.num_rows == 0:
            self.start = self.end = 0
        elif self.end > self.start:
            used = self.mask[:self.num_rows, self.start:self.end].any(0)
            self.start += int(torch.argmax(used.to(torch.int8)))

    def begin_decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Opens the next column; returns (attention_mask, position_ids) for a one-token step."""
        if self.end + 1 > self.cap:
            w = self.end - self.start
            self._relocate(0, min_cap=w + 64)   # compacts; doubles only if still short
        b = self.num_rows
        self.mask[:b, self.end] = 1
        return self.mask[:b, self.start:self.end + 1], self.pos[:b, None].clone()

    def end_decode(self) -> None:
        self.end += 1
        self.pos[:self.num_rows] += 1
