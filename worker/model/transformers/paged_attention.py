"""Attention over the paged KV cache, plugged into transformers' attention interface.

`use_paged_attention(model)` registers the implementation "llmq_paged" and selects it for the
model. A forward pass given `kv_plan=` (a kv_cache.BatchPlan) writes each new token's keys and
values into its pool slots, then attends each row over its own tokens only:

- decode rows (one new token) on a CPU with the kernel (worker/model/transformers/cpu_kernels.py, the cache's
  `decode_kernel`): all of them in one call that reads each row's blocks in place;
- decode rows otherwise (a GPU, or no kernel) in groups of similar length: the group's blocks are gathered into
  one padded [rows, kv heads, whole blocks, head dim] tensor and one SDPA call does the group; the
  query heads sharing a kv head go in as that head's query rows, so nothing is repeated;
- prefill rows (a prompt or a chunk of one) one at a time: SDPA of the chunk's queries over the
  row's gathered past and new keys, causal from the chunk's offset; a small chunk after a long
  past puts the query heads sharing a kv head in as its query rows, as the decode groups do.

Measured on the 2-core build machine (SmolLM2-135M, fp32, 2 threads) before choosing: see the
"Paged KV cache" part of docs/architecture.md. A forward pass without `kv_plan` (a plain
`model(...)` call) is transformers' own SDPA attention, unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "llmq_paged"


def paged_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs):
    """query [1, heads, tokens, dim], key/value [1, kv heads, tokens, dim] of the pass's new
    tokens; returns ([1, tokens, heads, dim], None) like transformers' SDPA attention."""
    plan = kwargs.get("kv_plan")
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    kpool, vpool = plan.cache.layer(module.layer_idx, key)
    if plan.new_blocks is not None:
        for pool in (kpool, vpool):
            pool.view(plan.cache.num_blocks, -1).index_fill_(0, plan.new_blocks, 0)
    # (into the pool's dtype: a float16 cache under a float32 model)
    kpool.index_copy_(0, plan.write_slots, key[0].transpose(0, 1).to(kpool.dtype))
    vpool.index_copy_(0, plan.write_slots, value[0].transpose(0, 1).to(vpool.dtype))
    heads, tokens, dim = query.shape[1:]
    kv_heads = key.shape[1]
    rep = heads // kv_heads
    q = query[0]                                        # [heads, tokens, dim]
    out = query.new_empty(tokens, heads, dim)
    kernel = plan.cache.decode_kernel if q.device.type == "cpu" else None
    if kernel is not None and plan.decode_groups:
        # All decode rows in one call: the kernel reads each row's blocks in place, so there is
        # no gather to keep in L2 and no padding, and groups would only add calls.
        tables, lengths = plan.decode_tables()
        n = tables.shape[0]
        kernel(q[:, :n].transpose(0, 1), kpool, vpool, tables, lengths, plan.cache.block_size,
               dim ** -0.5 if scaling is None else scaling, out[:n])
    for g in plan.decode_groups if kernel is None else ():
        n, width = g.blocks.shape
        k, v = _read(plan.cache, kpool, vpool, g.blocks.flatten(), g.first_slot, q.dtype)
        # Each row's whole blocks, the slots past its length masked (new blocks are zeroed,
        # so an unwritten slot is never NaN).
        k = k.view(n, width * g.block_size, kv_heads, dim).transpose(1, 2)
        v = v.view(n, width * g.block_size, kv_heads, dim).transpose(1, 2)
        qg = q[:, g.start:g.start + n].reshape(kv_heads, rep, n, dim).permute(2, 0, 1, 3)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.additive_mask(q.dtype),
                                           scale=scaling)
        out[g.start:g.start + n] = o.reshape(n, heads, dim)
    for start, r in plan.prefill_rows:
        k, v = _read(plan.cache, kpool, vpool, r.block_ids(), r.first_slot, q.dtype)
        k, v = k[:r.length].transpose(0, 1)[None], v[:r.length].transpose(0, 1)[None]
        qr = q[None, :, start:start + r.num_new]
        # enable_gqa, not repeat_interleave: copying a long row's keys `rep` times per layer
        # made a 4-token chunk at 3,000 tokens of context cost ~15x its attention.
        if r.num_past == 0:
            o = F.scaled_dot_product_attention(qr, k, v, is_causal=True, scale=scaling,
                                               enable_gqa=rep > 1)
        else:
            o = chunk_attention(qr, k, v, r, scaling)
        out[start:start + r.num_new] = o[0].transpose(0, 1)
    return out[None], None


# A chunk of at most this many tokens after a cached past is attended with the query heads that
# share a kv head as that head's query rows: the kernel then reads each kv head's keys once
# instead of once per query head. For a few queries over a long past, reading the keys is the
# whole cost (2-5x faster for 2-8 tokens over 3,000-8,000 keys, bf16 and fp32, one thread);
# from 16 tokens on the per-head layout is as fast or faster.
GROUPED_CHUNK_TOKENS = 8


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row,
                    scale: float | None = None) -> torch.Tensor:
    """q [1, heads, n, dim]: the queries of a row's chunk of n tokens after its cached past;
    k, v [1, kv heads, length, dim]: all the row's keys and values (a kv_cache.Row: its masks
    are made once per pass). Returns [1, heads, n, dim], the same sums either layout."""
    heads, n, dim = q.shape[1:]
    kv_heads = k.shape[1]
    rep = heads // kv_heads
    if rep == 1 or n > GROUPED_CHUNK_TOKENS:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=row.chunk_mask(q.dtype),
                                              scale=scale, enable_gqa=rep > 1)
    # Query head h uses kv head h // rep (repeat_interleave's order): heads [kv, rep] -> rows.
    o = F.scaled_dot_product_attention(q.reshape(1, kv_heads, rep * n, dim), k, v,
                                       attn_mask=row.chunk_mask(q.dtype, rep), scale=scale)
    return o.view(1, heads, n, dim)


def _read(cache, kpool, vpool, blocks: torch.Tensor, first_slot: int | None,
          dtype: torch.dtype):
    """The keys and values of `blocks`, [blocks x block size, kv heads, dim], in `dtype` (the
    queries'): a view of the pool when they are consecutive from first_slot, else gathered
    block by block into the cache's scratch buffers (reused: a fresh multi-MB tensor per layer
    would be fresh pages for the kernel to fault in, every step). A cache of another dtype
    (float16 under a float32 model) is read into a copy: SDPA takes one dtype."""
    n = blocks.numel() * cache.block_size
    if first_slot is not None:
        k, v = kpool.narrow(0, first_slot, n), vpool.narrow(0, first_slot, n)
    else:
        k, v = cache.scratch(n, kpool)
        by_block = (blocks.numel(), -1)
        for pool, buf in ((kpool, k), (vpool, v)):
            torch.index_select(pool.view(-1, buf[0].numel() * cache.block_size), 0, blocks,
                               out=buf.view(by_block))
    return k.to(dtype), v.to(dtype)


def use_paged_attention(model) -> None:
    """Registers the implementation (once per process) and selects it for this model."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, paged_attention_forward)
        # Plain forward passes build the same masks as SDPA; paged ones pass no mask at all.
        AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
