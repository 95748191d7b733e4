"""The paged KV cache: block tables, the budget, memory reuse, paged attention and chunked
prefill.

Unit tests drive PagedKVCache and the attention function with hand-made tensors; the rest
drive a real TransformersBackend over the tiny random model and compare with sequences run alone.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.protocol import SamplingParams
from factories import Driver, compare_to_solo, make_prompts, new_seq, recording, solo_references
from worker.model.transformers.kv_cache import KVCacheFull, PagedKVCache, Row
from worker.messages import StepRequest
from worker.model.transformers.backend import (DECODE_GROUP_BYTES, TransformersBackend, decode_group_slots,
                                 kv_bytes_per_token)
from worker.model.transformers.paged_attention import GROUPED_CHUNK_TOKENS, chunk_attention, paged_attention_forward

BS = 4          # tokens per block in the unit tests
LOGIT_TOL = 1e-4


def grow(cache: PagedKVCache, lengths: dict[str, int]) -> None:
    """Adds the sequences (if new) and computes `n` more tokens of each, without a model."""
    for sid in lengths:
        if sid not in cache.tables:
            cache.add(sid)
    cache.commit(cache.plan(list(lengths.items())))


# --- block tables -------------------------------------------------------------------------------
def test_each_sequence_holds_its_own_tokens_in_blocks():
    cache = PagedKVCache(num_blocks=100, block_size=BS)
    grow(cache, {"short": 3, "long": 30})
    grow(cache, {"short": 1, "long": 1})
    assert cache.lengths == {"short": 4, "long": 31}
    # Memory follows each sequence's own length: 1 block and 8 blocks, not 2 x 8.
    assert [len(cache.tables[s]) for s in ("short", "long")] == [1, 8]
    assert cache.num_free_blocks == 100 - 9
    plan = cache.plan([("short", 1), ("long", 1)])
    long, short = plan.rows                              # decode rows: longest first
    assert (short.num_past, short.length, long.length) == (4, 5, 32)
    # Slots are the blocks' token slots in table order; the new token is the last one.
    table = cache.tables["long"]
    assert long.slots.tolist() == [b * BS + i for b in table for i in range(BS)][:32]
    assert plan.write_slots.tolist() == [long.slots[-1].item(), short.slots[-1].item()]
    # A 5-token row and a 32-token row are not padded into one attention call.
    assert [(g.start, g.slots.shape) for g in plan.decode_groups] == [(0, (1, 32)), (1, (1, 5))]


def test_rows_of_similar_length_share_one_padded_group():
    cache = PagedKVCache(num_blocks=100, block_size=BS)
    grow(cache, {"a": 20, "b": 18, "c": 19})
    plan = cache.plan([("a", 1), ("b", 1), ("c", 1)])
    group, = plan.decode_groups
    assert group.slots.shape == (3, 21) and [r.seq_id for r in plan.rows] == ["a", "c", "b"]
    assert group.mask[:, 0, 0].sum(-1).tolist() == [21, 20, 19]
    # The keys are gathered by whole blocks (6 of 4 slots per row): the rest is masked.
    assert group.blocks.tolist() == [cache.tables[s] + [0] * (6 - len(cache.tables[s]))
                                     for s in ("a", "c", "b")]
    assert group.additive_mask(torch.float32)[:, 0, 0].isinf().sum(-1).tolist() == [3, 4, 5]


def test_the_block_gather_reads_each_rows_slots():
    """Gathering a group by block ids gives, in each row's first `width` places, exactly the
    keys a gather by slot ids gives."""
    cache = PagedKVCache(num_blocks=100, block_size=BS)
    grow(cache, {"a": 20, "b": 18, "c": 19})
    grow(cache, {"b": 3, "a": 1})                    # interleaved blocks
    group, = cache.plan([("a", 1), ("b", 1), ("c", 1)]).decode_groups
    pool = torch.randn(100 * BS, 2, 8)
    by_block = pool.view(100, -1)[group.blocks.flatten()].view(3, -1, 2, 8)[:, :group.width]
    for i, sid in enumerate(("a", "b", "c")):
        n = cache.lengths[sid] + 1
        slots = cache._slots_of(sid, n)
        assert torch.equal(by_block[i, :n], pool[slots]) and torch.equal(group.slots[i, :n], slots)


def test_the_budget_is_all_or_nothing_and_leaves_the_cache_as_it_was():
    cache = PagedKVCache(num_blocks=5, block_size=BS)
    grow(cache, {"a": 8})                                # 2 blocks
    cache.add("b")
    with pytest.raises(KVCacheFull):
        cache.plan([("a", 1), ("b", 9)])                 # 1 + 3 blocks > 3 free
    assert cache.tables == {"a": cache.tables["a"], "b": []} and len(cache.tables["a"]) == 2
    assert cache.num_free_blocks == 3
    grow(cache, {"b": 12})
    assert cache.num_free_blocks == 0


def test_blocks_of_a_sequence_that_left_are_reused_lowest_first():
    """A long sequence's blocks go back to the pool, and later sequences get the lowest free
    blocks first: the pool's touched memory stays at its high-water mark."""
    cache = PagedKVCache(num_blocks=64, block_size=BS)
    grow(cache, {"short": 4, "long": 100})
    high = max(b for t in cache.tables.values() for b in t)
    cache.remove(["long"])
    assert cache.num_free_blocks == 63
    for i in range(3):
        grow(cache, {f"again{i}": 100})
        assert max(cache.tables[f"again{i}"]) <= high
        cache.remove([f"again{i}"])
    assert cache.seq_ids == ["short"]


def test_prompt_blocks_are_shared_by_reference_and_parked_when_unused():
    cache = PagedKVCache(num_blocks=20, block_size=BS, prefix_blocks=8)
    prompt = list(range(100, 110))                       # 2 full blocks and 2 tokens
    grow(cache, {"a": 10})
    cache.register_prompt("a", prompt, None)
    shared = cache.prefix.match(prompt + [1, 2])
    assert shared == cache.tables["a"][:2]
    cache.add("b", shared)
    assert cache.lengths["b"] == 8
    cache.remove(["a"])                                  # b still uses the shared blocks
    assert cache.prefix.num_parked == 0 and cache.pool.refs[shared[0]] == 1
    cache.remove(["b"])
    assert cache.prefix.num_parked == 2                  # findable, evictable
    assert cache.num_free_blocks == 20
    assert cache.prefix.match(prompt) == shared
    grow(cache, {"big": 20 * BS})                        # needs every block: evicts them
    assert cache.prefix.match(prompt) == [] and cache.num_free_blocks == 0


# --- paged attention --------------------------------------------------------------------------------
class FakeAttention(torch.nn.Module):
    def __init__(self, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx


def reference(q, k, v, past_k, past_v, scale):
    """One row's attention computed directly: all its keys, causal, kv heads repeated."""
    keys, values = torch.cat([past_k, k], 1), torch.cat([past_v, v], 1)   # [kvh, L, d]
    rep = q.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
    n, length = q.shape[1], keys.shape[1]
    mask = torch.arange(length)[None, :] <= (torch.arange(n) + length - n)[:, None]
    return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                          scale=scale)[0].transpose(0, 1)   # [n, heads, d]


def fill(cache, past: dict[str, int], heads: int, kv_heads: int, dim: int, scale: float) -> dict:
    """Adds the sequences and writes `n` random keys and values of each through the attention
    function itself; returns them by sequence."""
    stored = {}
    for sid, n in past.items():
        cache.add(sid)
        plan = cache.plan([(sid, n)])
        k, v = torch.randn(1, kv_heads, n, dim), torch.randn(1, kv_heads, n, dim)
        paged_attention_forward(FakeAttention(), torch.randn(1, heads, n, dim), k, v, None,
                                scaling=scale, kv_plan=plan)
        cache.commit(plan)
        stored[sid] = (k[0], v[0])
    return stored


def check_rows(plan, q, k, v, stored: dict, new: dict[str, int], scale: float) -> None:
    """The pass over `plan` gives each row its own attention (the pass's tokens in plan order)."""
    out, _ = paged_attention_forward(FakeAttention(), q, k, v, None, scaling=scale, kv_plan=plan)
    assert out.shape == (1, q.shape[2], q.shape[1], q.shape[3])
    start = 0
    for row in plan.rows:
        n = new[row.seq_id]
        pk, pv = stored.get(row.seq_id, (torch.zeros(k.shape[1], 0, k.shape[3]),) * 2)
        want = reference(q[0, :, start:start + n], k[0, :, start:start + n],
                         v[0, :, start:start + n], pk, pv, scale)
        torch.testing.assert_close(out[0, start:start + n], want, rtol=1e-5, atol=1e-5)
        start += n


def test_paged_attention_equals_each_rows_own_attention():
    """Decode rows of very different lengths, a prefill from scratch and a prefill chunk over
    a cached past, in one pass: each row's output equals its attention computed alone."""
    torch.manual_seed(0)
    heads, kv_heads, dim, scale = 6, 2, 8, 0.3
    cache = PagedKVCache(num_blocks=200, block_size=BS, max_group_padding=0.25)
    past = {"d1": 3, "d2": 50, "d3": 20, "d4": 21, "chunk": 9}
    stored = fill(cache, past, heads, kv_heads, dim, scale)
    cache.add("fresh")
    new = {"d1": 1, "d2": 1, "fresh": 5, "d3": 1, "chunk": 6, "d4": 1}
    plan = cache.plan(list(new.items()))
    total = sum(new.values())
    q = torch.randn(1, heads, total, dim)
    k, v = torch.randn(1, kv_heads, total, dim), torch.randn(1, kv_heads, total, dim)
    check_rows(plan, q, k, v, stored, new, scale)
    assert [len(g.slots) for g in plan.decode_groups] == [1, 2, 1]
    assert len(plan.prefill_rows) == 2
    # Both ways of reading a row's keys were used: a slice of consecutive blocks (d2's, alone
    # in its group; fresh's) and a gather (the others).
    assert plan.decode_groups[0].first_slot == cache.tables["d2"][0] * BS
    assert [r.first_slot is not None for _t, r in plan.prefill_rows] == [True, False]


def test_unwritten_slots_of_whole_blocks_never_reach_the_output():
    """Attention reads rows' whole blocks, past their tokens (masked): a pool that held NaN
    before (it is torch.empty) gives the same outputs, because new blocks are zeroed."""
    torch.manual_seed(2)
    heads, kv_heads, dim, scale = 6, 2, 8, 0.3
    cache = PagedKVCache(num_blocks=50, block_size=BS)
    cache.layer(0, torch.zeros(1, kv_heads, 1, dim))
    cache.k[0].fill_(float("nan"))
    cache.v[0].fill_(float("nan"))
    past = {"a": 9, "b": 7, "c": 10}
    stored = fill(cache, past, heads, kv_heads, dim, scale)
    plan = cache.plan([(sid, 1) for sid in past])
    q = torch.randn(1, heads, 3, dim)
    k, v = torch.randn(1, kv_heads, 3, dim), torch.randn(1, kv_heads, 3, dim)
    check_rows(plan, q, k, v, stored, dict.fromkeys(past, 1), scale)


def test_decode_groups_span_at_most_max_group_slots():
    """Rows of one length are split into groups of at most max_group_slots slots (rows x
    longest: the keys and values one attention call gathers), and each row still gets its own
    attention. Without the limit they are one group."""
    torch.manual_seed(1)
    heads, kv_heads, dim, scale = 4, 2, 8, 0.5
    past = {f"r{i}": 20 for i in range(7)}
    for limit, sizes in ((70, [3, 3, 1]), (None, [7])):
        cache = PagedKVCache(num_blocks=100, block_size=BS, max_group_slots=limit)
        stored = fill(cache, past, heads, kv_heads, dim, scale)
        plan = cache.plan([(sid, 1) for sid in past])
        assert [len(g.slots) for g in plan.decode_groups] == sizes
        assert all(g.slots.numel() <= (limit or 7 * 21) for g in plan.decode_groups)
        q = torch.randn(1, heads, 7, dim)
        k, v = torch.randn(1, kv_heads, 7, dim), torch.randn(1, kv_heads, 7, dim)
        check_rows(plan, q, k, v, stored, dict.fromkeys(past, 1), scale)


def test_a_cpu_worker_limits_decode_groups_to_a_cache_sized_gather(tiny_model):
    """On CPU the worker caps a decode group's gathered keys and values per layer near
    DECODE_GROUP_BYTES; a 1-slot row always fits."""
    model, info = tiny_model
    worker = TransformersBackend(model, info, 4)
    per_layer = kv_bytes_per_token(model) // model.config.num_hidden_layers
    assert worker.cache.max_group_slots == DECODE_GROUP_BYTES // per_layer
    assert decode_group_slots(model, torch.device("meta")) is None   # not a CPU: no limit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 3, GROUPED_CHUNK_TOKENS, GROUPED_CHUNK_TOKENS + 1, 20])
def test_a_chunk_over_a_long_past_attends_as_each_head_alone(n, dtype):
    """Both layouts of a chunk's attention (query heads grouped by kv head for small chunks,
    per head for bigger ones) give each head's own causal attention over past and chunk."""
    torch.manual_seed(1)
    heads, kv_heads, dim, past, scale = 9, 3, 16, 300, 0.25
    q = torch.randn(1, heads, n, dim, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, past + n, dim, dtype=dtype) for _ in range(2))
    got = chunk_attention(q, k, v, Row("r", past, n, torch.arange(past + n)), scale)
    want = reference(q[0].float(), k[0, :, past:].float(), v[0, :, past:].float(),
                     k[0, :, :past].float(), v[0, :, :past].float(), scale)
    assert got.shape == (1, heads, n, dim) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[0].transpose(0, 1).float(), want, rtol=tol, atol=tol)


# --- through a real TransformersBackend ------------------------------------------------------------------
def worker_with_blocks(model, info, num_blocks: int, max_num_seqs: int = 8, **kw) -> TransformersBackend:
    """A worker whose cache holds num_blocks blocks of 8 tokens (in the model's dtype)."""
    block_bytes = kv_bytes_per_token(model) * 8
    return TransformersBackend(model, info, max_num_seqs, kv_cache_bytes=num_blocks * block_bytes,
                       kv_cache_dtype="model", **kw)


def test_the_budget_caps_the_context_and_a_longer_prompt_fails_alone(sharp_device_model):
    model, info = sharp_device_model
    worker = worker_with_blocks(model, info, num_blocks=10)
    assert worker.kv_capacity == (10, 8) and worker.info.max_model_len == 80
    ok, too_long = make_prompts(2, lengths=[20, 81], vocab=info.vocab_size)
    res = worker.step(StepRequest(prefill=[new_seq("ok", ok), new_seq("long", too_long)]))
    assert set(res.token_ids) == {"ok"} and "exceeds" in res.errors["long"]
    assert worker.cache.seq_ids == ["ok"] and worker.cache.num_free_blocks == 7


def test_a_preempted_sequence_recomputed_from_its_tokens_continues_the_same(sharp_device_model):
    """Preemption by recompute, as the scheduler does it: the sequence is freed mid-decode
    and later prefilled again with its prompt and output so far; it goes on with exactly the
    tokens (and logits) it would have produced had it never left."""
    model, info = sharp_device_model
    prompts = dict(zip(["a", "b"], make_prompts(2, lengths=[30, 17], vocab=info.vocab_size)))
    solo = solo_references(model, info, prompts, 16, kv_cache_dtype="model")
    worker = worker_with_blocks(model, info, num_blocks=12)
    rec = recording(worker)
    d = Driver(worker)
    d.step(prefill=[new_seq("a", prompts["a"]), new_seq("b", prompts["b"])])
    for _ in range(4):
        d.step()
    d.step(free=["b"])                                   # preempted: its blocks go back
    assert worker.cache.num_free_blocks == 12 - 5        # a: 35 tokens
    so_far = d.outputs.pop("b")
    seq = new_seq("b", prompts["b"] + so_far)
    seq.num_output_tokens = len(so_far)
    d.step(prefill=[seq])
    d.outputs["b"] = so_far + d.outputs["b"]
    while len(d.outputs["b"]) < 12:
        d.step()
    for sid in prompts:   # tokens and logits, before and after the recompute
        assert compare_to_solo(sid, solo[sid], d.outputs[sid], rec.steps[sid], LOGIT_TOL) is None
    d.finish()
    assert worker.cache.num_free_blocks == 12


def test_a_long_prompt_is_prefilled_in_chunks_while_the_batch_decodes(sharp_device_model):
    model, info = sharp_device_model
    prompts = dict(zip(["run", "long"], make_prompts(2, lengths=[10, 70], vocab=info.vocab_size)))
    solo = solo_references(model, info, prompts, 6)
    worker = TransformersBackend(model, info, 4, prefill_chunk=16)
    rec = recording(worker)
    first = worker.step(StepRequest(prefill=[new_seq("run", prompts["run"])]))
    outputs = {"run": [first.token_ids["run"]], "long": []}
    res = worker.step(StepRequest(prefill=[new_seq("long", prompts["long"])],
                                  decode_seq_ids=["run"]))
    steps = 1
    while not res.token_ids.get("long"):
        assert set(res.token_ids) == {"run"} and not res.errors   # the batch keeps decoding
        outputs["run"].append(res.token_ids["run"])
        res = worker.step(StepRequest(decode_seq_ids=["run", "long"]))
        steps += 1
    assert steps == 5                                    # 70 tokens = 4 chunks of 16 + 6
    for sid, tok in res.token_ids.items():
        outputs[sid].append(tok)
    while len(outputs["long"]) < 6:
        res = worker.step(StepRequest(decode_seq_ids=["run", "long"]))
        for sid, tok in res.token_ids.items():
            outputs[sid].append(tok)
    assert compare_to_solo("long", solo["long"], outputs["long"], rec.steps["long"],
                           LOGIT_TOL) is None
    assert outputs["run"][:6] == solo["run"].tokens


def test_the_worker_computes_the_chunk_the_step_names(sharp_model):
    """The scheduler caps a long prompt's chunk while the batch decodes (StepRequest.chunks);
    the worker computes exactly that much per step, and the tokens are the solo run's."""
    from common.protocol import SamplingParams
    from worker.messages import NewSequence
    from worker.output_processor import end_on_token
    from worker.sequence import Sequence
    from worker.workload_manager import WorkloadManager

    model, info = sharp_model
    prompts = dict(zip(["run", "long"], make_prompts(2, lengths=[6, 45], vocab=info.vocab_size)))
    solo = solo_references(model, info, prompts, 20)
    worker = TransformersBackend(model, info, 4, prefill_chunk=64)
    wm = WorkloadManager(max_num_seqs=4, max_num_batched_tokens=64, long_prefill_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    seqs = {sid: Sequence(sid, ids, params) for sid, ids in prompts.items()}
    wm.add(seqs["run"])
    lengths = []
    for i in range(100):
        if not wm.num_unfinished:
            break
        if i == 1:
            wm.add(seqs["long"])
        out = wm.schedule()
        res = worker.step(StepRequest(
            prefill=[NewSequence(s.seq_id, s.all_token_ids, s.params) for s in out.prefill],
            decode_seq_ids=[s.seq_id for s in out.decode], free_seq_ids=out.freed_seq_ids,
            chunks=out.prompt_chunks))
        assert not res.errors, res.errors
        if "long" in worker.cache.lengths and not seqs["long"].output_token_ids:
            lengths.append(worker.cache.lengths["long"])
        for seq in wm.update(out, res.token_ids):   # the output processor's part: the ends
            if (reason := end_on_token(seq)) is not None:
                wm.abort(seq, reason)
    assert lengths == [8, 16, 24, 32, 40, 45]       # 8 per step beside the decode, then 5
    for sid, seq in seqs.items():
        assert seq.output_token_ids == solo[sid].tokens, sid


def test_a_running_prompts_chunk_rides_in_the_decodes_forward_pass(sharp_device_model):
    model, info = sharp_device_model
    run, long = make_prompts(2, lengths=[5, 40], vocab=info.vocab_size)
    worker = TransformersBackend(model, info, 4, prefill_chunk=16)
    worker.step(StepRequest(prefill=[new_seq("run", run)]))
    worker.step(StepRequest(prefill=[new_seq("long", long)], decode_seq_ids=["run"]))
    passes = []
    forward = worker.llama   # (the model's forward pass: tokens in, kept logits out)
    worker.llama = lambda ids, *rest: passes.append(len(ids)) or forward(ids, *rest)
    res = worker.step(StepRequest(decode_seq_ids=["run", "long"], chunks={"long": 8}))
    assert passes == [1 + 8] and set(res.token_ids) == {"run"}   # one pass: a decode + 8
    assert worker.cache.lengths["long"] == 16 + 8


def test_newcomers_beyond_the_free_rows_fail_alone(sharp_model):
    model, info = sharp_model
    worker = TransformersBackend(model, info, max_num_seqs=3)
    long1, long2, short1, short2 = make_prompts(4, lengths=[40, 41, 4, 5], vocab=info.vocab_size)
    res = worker.step(StepRequest(prefill=[new_seq("l1", long1), new_seq("l2", long2),
                                           new_seq("s1", short1), new_seq("s2", short2)]))
    assert len(res.errors) == 1 and "full" in next(iter(res.errors.values()))
    assert sorted(worker.cache.seq_ids) == sorted(res.token_ids) and len(res.token_ids) == 3
    assert set(worker.states) == set(res.token_ids)


def test_the_scheduler_keeps_the_worker_within_a_tight_budget_by_preemption(sharp_model):
    """The workload manager and a model worker with room for 14 blocks (112 tokens) run six
    sequences that need 181 tokens together, the way the engine drives them: the running
    batch outgrows the cache, the newest sequences are preempted and recomputed later, the
    worker never runs out of blocks, and every sequence still gets its solo tokens."""
    from common.protocol import SamplingParams
    from worker.messages import NewSequence
    from worker.output_processor import end_on_token
    from worker.sequence import Sequence
    from worker.workload_manager import WorkloadManager

    model, info = sharp_model
    lengths = [20, 9, 30, 14, 25, 11]
    prompts = {f"q{i}": ids for i, ids in
               enumerate(make_prompts(6, lengths=lengths, vocab=info.vocab_size, seed=5))}
    solo = solo_references(model, info, prompts, 12, kv_cache_dtype="model")
    worker = worker_with_blocks(model, info, num_blocks=14, max_num_seqs=6)
    wm = WorkloadManager(max_num_seqs=6)
    wm.set_kv_budget(*worker.kv_capacity)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seqs = [Sequence(sid, ids, params) for sid, ids in prompts.items()]
    for s in seqs:
        wm.add(s)
    for _ in range(200):
        if not wm.num_unfinished:
            break
        out = wm.schedule()
        res = worker.step(StepRequest(
            prefill=[NewSequence(s.seq_id, s.all_token_ids, s.params, s.num_output_tokens)
                     for s in out.prefill],
            decode_seq_ids=[s.seq_id for s in out.decode], free_seq_ids=out.freed_seq_ids))
        assert not res.errors, res.errors
        for seq in wm.update(out, res.token_ids):   # the output processor's part: the ends
            if (reason := end_on_token(seq)) is not None:
                wm.abort(seq, reason)
    assert not wm.num_unfinished and wm.stats.num_preemptions >= 1
    assert sum(s.num_preemptions for s in seqs) == wm.stats.num_preemptions
    for s in seqs:
        assert s.output_token_ids == solo[s.seq_id].tokens, s.seq_id


def test_only_this_steps_newcomers_go_ahead_of_the_decode(sharp_model):
    """The engine takes a partial result as the newcomers' part of the step: the first token
    of a chunked prompt that finishes in a later step must come with the decode's tokens."""
    model, info = sharp_model
    run, long, short = make_prompts(3, lengths=[5, 20, 6], vocab=info.vocab_size)
    worker = TransformersBackend(model, info, 4, prefill_chunk=16)
    worker.step(StepRequest(prefill=[new_seq("run", run)]))
    ahead = []
    res = worker.step(StepRequest(prefill=[new_seq("long", long)], decode_seq_ids=["run"]),
                      early=ahead.append)
    assert ahead == [] and set(res.token_ids) == {"run"}      # long: first chunk only
    res = worker.step(StepRequest(prefill=[new_seq("short", short)],
                                  decode_seq_ids=["run", "long"]), early=ahead.append)
    assert [set(p.token_ids) for p in ahead] == [{"short"}] and ahead[0].partial
    assert set(res.token_ids) == {"run", "long"} and not res.partial


def test_a_wave_of_newcomers_gets_its_first_tokens_pass_by_pass(sharp_model):
    """Newcomers over LLMQ_PREFILL_PASS_TOKENS are prefilled in even passes, each pass's first
    tokens sent as it ends while anything is left to run (the running batch's decode, or
    another pass); the tokens are those of one pass for them all."""
    model, info = sharp_model
    prompts = make_prompts(6, lengths=[10] * 6, vocab=info.vocab_size, seed=7)
    news = [new_seq(f"n{i}", p) for i, p in enumerate(prompts)]
    whole = TransformersBackend(model, info, 8).step(StepRequest(prefill=news))

    worker = TransformersBackend(model, info, 8, prefill_pass_tokens=25)   # 60 tokens: 3 passes of 20
    ahead = []
    res = worker.step(StepRequest(prefill=news), early=ahead.append)
    assert [sorted(p.token_ids) for p in ahead] == [["n0", "n1"], ["n2", "n3"]]
    assert all(p.partial for p in ahead) and sorted(res.token_ids) == ["n4", "n5"]
    got = {k: v for p in ahead + [res] for k, v in p.token_ids.items()}
    assert got == whole.token_ids

    # Beside a running batch the last pass goes ahead too; the decode's tokens come last.
    run = make_prompts(1, lengths=[5], vocab=info.vocab_size, seed=8)[0]
    worker = TransformersBackend(model, info, 8, prefill_pass_tokens=25)
    worker.step(StepRequest(prefill=[new_seq("run", run)]))
    ahead = []
    res = worker.step(StepRequest(prefill=news, decode_seq_ids=["run"]), early=ahead.append)
    assert [sorted(p.token_ids) for p in ahead] == [["n0", "n1"], ["n2", "n3"], ["n4", "n5"]]
    assert set(res.token_ids) == {"run"} and not res.partial
    assert {k: v for p in ahead for k, v in p.token_ids.items()} == whole.token_ids


def test_prefill_passes_are_even_and_keep_the_order():
    from worker.model.transformers.backend import _passes

    seqs = [new_seq(f"s{i}", [1] * n) for i, n in enumerate([14] * 64)]
    chunks = {s.seq_id: len(s.token_ids) for s in seqs}
    groups = _passes(seqs, chunks, 512)
    assert [len(g) for g in groups] == [32, 32] and [s for g in groups for s in g] == seqs
    assert _passes(seqs, chunks, 0) == [seqs] and _passes(seqs, chunks, 896) == [seqs]
    sizes = [len(g) for g in _passes(seqs, chunks, 300)]   # 896 tokens: 3 passes, even
    assert len(sizes) == 3 and sum(sizes) == 64 and max(sizes) - min(sizes) <= 1
    assert _passes([], chunks, 512) == []


def test_each_newcomer_is_answered_once_across_the_passes(sharp_model):
    """Partials split every per-sequence field by the newcomers they answer: a newcomer with a
    cached prefix in a later pass keeps its cached-token count for that pass's answer, and one
    that cannot join is answered once, in the first; prompt logprobs go with their own
    newcomer's answer."""
    model, info = sharp_model
    cached, *rest = make_prompts(4, lengths=[24, 10, 10, 10], vocab=info.vocab_size, seed=9)
    worker = TransformersBackend(model, info, 8, prefix_cache_bytes=64 << 20, prefill_pass_tokens=20)
    worker.step(StepRequest(prefill=[new_seq("old", cached)]))
    worker.step(StepRequest(free_seq_ids=["old"]))   # its prompt's blocks parked for reuse
    scored = SamplingParams(temperature=0.0, prompt_logprobs=1)
    news = [new_seq("n0", rest[0]), new_seq("n1", rest[1]), new_seq("late", cached),
            new_seq("bad", [1] * (info.max_model_len + 1)), new_seq("lp", rest[2], scored)]
    ahead = []
    res = worker.step(StepRequest(prefill=news), early=ahead.append)
    pieces = ahead + [res]
    answers = [sid for p in pieces for sid in [*p.token_ids, *p.errors]]
    assert sorted(answers) == ["bad", "late", "lp", "n0", "n1"]   # each once
    assert [p.cached_tokens for p in pieces if "late" in p.token_ids] == [{"late": 16}]
    assert sum(len(p.cached_tokens) for p in pieces) == 1
    assert "bad" in pieces[0].errors
    [lp] = [p for p in pieces if "lp" in p.token_ids]
    assert list(lp.prompt_logprobs) == ["lp"] and len(lp.prompt_logprobs["lp"]) == 9


def test_a_scored_prompt_is_sized_by_its_chunk_in_the_passes(sharp_model):
    """A prompt with prompt logprobs is computed chunk by chunk like any other: the passes
    are cut by its chunk's size (here 10 + 4 tokens under a cap of 15: one pass, which
    answers the short prompt; the scored one waits for its last chunk)."""
    model, info = sharp_model
    a, b = make_prompts(2, lengths=[10, 10], vocab=info.vocab_size, seed=11)
    scored = SamplingParams(temperature=0.0, prompt_logprobs=1)
    worker = TransformersBackend(model, info, 4, prefill_pass_tokens=15)
    ahead = []
    res = worker.step(StepRequest(prefill=[new_seq("a", a), new_seq("lp", b, scored)],
                                  chunks={"lp": 4}), early=ahead.append)
    assert not ahead and list(res.token_ids) == ["a"] and not res.prompt_logprobs
