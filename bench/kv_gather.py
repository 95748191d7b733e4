"""The decode groups' two kernels alone (`python -m bench.kv_gather`), one thread, interleaved.

1. Gathering a group's keys (1,024 slots of SmolLM2-135M's 3 kv heads x 64 dims, bf16) from a
   pool by slot ids (as worker/model/transformers/paged_attention.py did) against by block ids (what it does now:
   1/8 as many indices, 3 KB copies instead of 384 B) and against a plain copy of as many
   bytes, for a pool that fits in L2, one in L3 and one in memory (at c=64 a step reads ~370
   MB of keys and values).
2. One decode group's attention (4 rows x 3 kv heads x 3 queries over 256 keys, padded rows
   masked): SDPA against an explicit matmul + fp32 softmax + matmul.

Conclusions (issue 17's notes): the gather runs near copy speed either way; the explicit
attention is 3x slower than SDPA.
"""
from __future__ import annotations

import random
import statistics
import time

import torch
import torch.nn.functional as F

BLOCK, KV_HEADS, DIM, REP = 8, 3, 64, 3
DTYPE = torch.bfloat16


def median_us(fns: dict, calls: int = 200, rounds: int = 7) -> dict[str, float]:
    """Median microseconds per call of each function, the functions alternated each round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def gather(num_blocks: int, picked: int = 128) -> None:
    """Each call gathers the next `picked` blocks of a shuffled order of the whole pool, as
    the decode groups of a step (and then the next layer's pool) do: a pool larger than the
    caches is read from memory."""
    pool = torch.randn(num_blocks * BLOCK, KV_HEADS, DIM, dtype=DTYPE)
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)
    block_sets = [torch.tensor(order[i:i + picked])
                  for i in range(0, num_blocks - picked + 1, picked)]
    slot_sets = [(b[:, None] * BLOCK + torch.arange(BLOCK)).flatten() for b in block_sets]
    out = torch.empty(picked * BLOCK, KV_HEADS, DIM, dtype=DTYPE)
    by_block = pool.view(num_blocks, -1)
    assert torch.equal(torch.index_select(by_block, 0, block_sets[0]).view_as(out),
                       pool[slot_sets[0]])

    def cycling(sets, fn):
        state = {"i": 0}

        def call():
            state["i"] = (state["i"] + 1) % len(sets)
            fn(sets[state["i"]])
        return call

    us = median_us({
        "by slot": cycling(slot_sets, lambda s: torch.index_select(pool, 0, s, out=out)),
        "by block": cycling(block_sets, lambda b: torch.index_select(
            by_block, 0, b, out=out.view(picked, -1))),
        "copy": cycling(range(0, num_blocks - picked + 1, picked), lambda first: out.view(
            picked, -1).copy_(by_block[first:first + picked])),
    })
    mb = out.numel() * out.element_size() / 1e6
    print(f"gather {mb:.2f} MB from a {pool.numel() * 2 / 1e6:.0f} MB pool: "
          + ", ".join(f"{k} {v:.0f} us ({mb / v * 1e3:.1f} GB/s)" for k, v in us.items()))


def attention(rows: int = 4, keys: int = 256) -> None:
    q = torch.randn(rows, KV_HEADS, REP, DIM, dtype=DTYPE)
    k, v = (torch.randn(rows, keys, KV_HEADS, DIM, dtype=DTYPE).transpose(1, 2) for _ in "kv")
    mask = torch.zeros(rows, 1, 1, keys, dtype=DTYPE)
    mask[1:, ..., keys - keys // 8:] = float("-inf")

    def explicit():
        scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(DIM ** -0.5).add_(mask)
        return torch.matmul(torch.softmax(scores, -1).to(DTYPE), v)

    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)   # noqa: E731
    diff = (explicit().float() - sdpa().float()).abs().max().item()
    us = median_us({"SDPA": sdpa, "matmul + softmax": explicit})
    print(f"attention of {rows} rows x {keys} keys: "
          + ", ".join(f"{k} {v:.0f} us" for k, v in us.items()) + f" (max difference {diff:.4f})")


def main() -> None:
    torch.set_num_threads(1)
    for num_blocks in (160, 2_560, 40_000):      # ~0.5 MB, ~8 MB, ~120 MB pools
        gather(num_blocks)
    attention()


if __name__ == "__main__":
    main()
