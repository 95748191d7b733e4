"""BatchKVCache invariants: compact rows, right-aligned windows, trimming, relocation and growth.

The unit tests feed the cache fake "prefill caches" whose keys are labelled (row tag, token
index), so after any sequence of adds, removes and decode steps each row's unmasked keys must
read back exactly as that sequence's tokens, in order. The last test drives a real ModelWorker
whose cache starts tiny (8 columns) through every relocation path and compares with solo runs.
"""
from __future__ import annotations

import sys

import pytest
import torch

from factories import Driver, compare_to_solo, make_prompts, new_seq, recording, solo_references
from worker.kv_cache import BatchKVCache
from worker.messages import StepRequest
from worker.model_worker import ModelWorker

H, D, LAYERS = 2, 3, 2


class FakeLayer:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values


def label(tag: int, index: int) -> float:
    """The key written for token `index` of the sequence tagged `tag` (values are its negation)."""
    return tag * 1000.0 + index


class Model:
    """What the cache should hold: for each sequence, the labels of its tokens so far."""

    def __init__(self):
        self.tokens: dict[str, list[float]] = {}
        self.tags: dict[str, int] = {}

    def prefill(self, cache: BatchKVCache, seqs: dict[str, int]) -> None:
        """One prefill group: left-padded to the longest, like ModelWorker._prefill_group."""
        longest = max(seqs.values())
        n = len(seqs)
        keys = torch.zeros(n, H, longest, D)
        mask = torch.zeros(n, longest, dtype=torch.long)
        for r, (sid, length) in enumerate(seqs.items()):
            tag = self.tags.setdefault(sid, len(self.tags) + 1)
            self.tokens[sid] = [label(tag, j) for j in range(length)]
            keys[r, :, longest - length:, :] = torch.tensor(self.tokens[sid])[None, :, None]
            mask[r, longest - length:] = 1
        layers = [FakeLayer(keys + 0.5 * li, -(keys + 0.5 * li)) for li in range(LAYERS)]
        cache.add(list(seqs), layers, mask, mask.sum(-1))

    def decode(self, cache: BatchKVCache) -> None:
        """One decode step as the model does it: open a column, write every row, close it."""
        n = cache.num_rows
        attn, pos = cache.begin_decode()
        assert attn.shape == (n, cache.end - cache.start + 1)
        assert bool(attn[:, -1].all()), "the new column is visible to every row"
        assert pos[:, 0].tolist() == [len(self.tokens[s]) for s in cache.seq_ids]
        step = torch.zeros(n, H, 1, D)
        for r, sid in enumerate(cache.seq_ids):
            self.tokens[sid].append(label(self.tags[sid], len(self.tokens[sid])))
            step[r] = self.tokens[sid][-1]
        for li, layer in enumerate(cache.cache.layers):
            k, v = layer.update(step + 0.5 * li, -(step + 0.5 * li))
            assert k.shape == (n, H, cache.end - cache.start + 1, D)
            assert torch.equal(k[:, :, -1:], step + 0.5 * li)
        cache.end_decode()

    def remove(self, cache: BatchKVCache, seq_ids) -> None:
        cache.remove(seq_ids)
        for sid in seq_ids:
            self.tokens.pop(sid, None)

    def check(self, cache: BatchKVCache) -> None:
        """Every invariant of the cache against what it should hold."""
        n, s, e = cache.num_rows, cache.start, cache.end
        assert sorted(cache.seq_ids) == sorted(self.tokens)
        assert len(set(cache.seq_ids)) == n
        assert 0 <= s <= e <= cache.cap
        for buf in cache.k + cache.v:
            assert buf.shape[0] == cache.max_rows and buf.shape[2] == cache.cap
        if n == 0:
            assert s == e == 0
            return
        mask = cache.mask[:n]
        assert not mask[:, :s].any() and not mask[:, e:].any(), "mask outside the window"
        assert bool(mask[:, s].any()), "leading all-padding column not trimmed"
        assert bool(mask[:, e - 1].all()), "a row is not right-aligned to the write column"
        for r, sid in enumerate(cache.seq_ids):
            want = self.tokens[sid]
            row = mask[r, s:e]
            assert row.sum() == len(want)
            assert not row[:e - s - len(want)].any(), "left padding must be a prefix"
            assert int(cache.pos[r]) == len(want)
            for li in range(LAYERS):
                k = cache.k[li][r, :, s:e][:, row.bool()]
                v = cache.v[li][r, :, s:e][:, row.bool()]
                expect = (torch.tensor(want) + 0.5 * li)[None, :, None].expand(H, -1, D)
                assert torch.equal(k, expect), f"{sid}: keys of layer {li} lost or moved"
                assert torch.equal(v, -expect)


@pytest.fixture
def cache_and_model():
    return BatchKVCache(max_rows=4, initial_cols=8), Model()


def test_add_right_aligns_and_masks_left_padding(cache_and_model):
    cache, m = cache_and_model
    m.prefill(cache, {"a": 5, "b": 3})
    m.check(cache)
    assert cache.seq_ids == ["a", "b"]
    assert (cache.start, cache.end) == (0, 5)
    assert cache.cap == 128                             # 8 doubled until 5 + 64 columns fit
    m.decode(cache)
    m.prefill(cache, {"c": 2})                          # shorter: fits the window
    m.check(cache)
    assert cache.seq_ids == ["a", "b", "c"] and (cache.start, cache.end) == (0, 6)


def test_remove_moves_the_last_row_into_the_hole(cache_and_model):
    cache, m = cache_and_model
    m.prefill(cache, {"a": 4, "b": 6, "c": 2, "d": 5})
    m.decode(cache)
    m.remove(cache, ["b"])
    assert cache.seq_ids == ["a", "d", "c"]            # d (last) took b's row
    m.check(cache)
    m.decode(cache)
    m.remove(cache, ["c"])                             # the last row: nothing moves
    assert cache.seq_ids == ["a", "d"]
    m.check(cache)
    m.remove(cache, ["zz"])                            # unknown ids are ignored
    assert cache.seq_ids == ["a", "d"]
    m.prefill(cache, {"e": 3, "f": 1})
    m.remove(cache, ["a", "e"])                        # several at once
    assert cache.seq_ids == ["f", "d"]
    m.check(cache)
    m.decode(cache)
    m.check(cache)


def test_remove_trims_leading_padding_columns(cache_and_model):
    cache, m = cache_and_model
    m.prefill(cache, {"long": 10, "short": 3})
    m.decode(cache)
    assert (cache.start, cache.end) == (0, 11)
    m.remove(cache, ["long"])
    assert (cache.start, cache.end) == (7, 11)         # the short row's 4 tokens remain
    m.check(cache)
    m.prefill(cache, {"mid": 6})                       # the window widens to the left again
    assert (cache.start, cache.end) == (5, 11)
    m.check(cache)
    m.remove(cache, ["short", "mid"])
    assert cache.num_rows == 0 and (cache.start, cache.end) == (0, 0)
    m.check(cache)
    m.prefill(cache, {"again": 4})                     # an emptied cache starts over
    m.check(cache)


def test_full_batch_raises_and_keeps_the_rows(cache_and_model):
    cache, m = cache_and_model
    m.prefill(cache, {"a": 3, "b": 3, "c": 3})
    with pytest.raises(RuntimeError, match="full"):
        m.prefill(cache, {"d": 2, "e": 2})
    for sid in ("d", "e"):
        m.tokens.pop(sid)
    assert cache.seq_ids == ["a", "b", "c"]
    m.check(cache)


def test_newcomers_beyond_the_free_rows_fail_alone_before_any_compute(sharp_model):
    """Prefill groups join the batch's cache at the end of the step, so room is counted in
    sequences across the step's groups: the one that does not fit gets an error, the rest run
    and the step (and the batch) survives."""
    model, info = sharp_model
    worker = ModelWorker(model, info, max_num_seqs=3)
    long1, long2, short1, short2 = make_prompts(4, lengths=[40, 41, 4, 5], vocab=info.vocab_size)
    res = worker.step(StepRequest(prefill=[new_seq("l1", long1), new_seq("l2", long2),
                                           new_seq("s1", short1), new_seq("s2", short2)]))
    assert len(res.errors) == 1 and "full" in next(iter(res.errors.values()))
    assert sorted(worker.cache.seq_ids) == sorted(res.token_ids) and len(res.token_ids) == 3
    assert set(worker.states) == set(res.token_ids)


def test_newcomer_longer_than_the_window_relocates_the_rows(cache_and_model):
    cache, m = cache_and_model
    m.prefill(cache, {"a": 3, "b": 2})
    for _ in range(3):
        m.decode(cache)
    cap = cache.cap
    m.prefill(cache, {"c": 20})                        # longer than end (6): shift right
    assert (cache.start, cache.end) == (0, 20) and cache.cap == cap
    m.check(cache)
    m.prefill(cache, {"d": cap + 10})                  # longer than the buffer: grow
    assert cache.cap >= cap + 10 + 64 and cache.end == cap + 10
    m.check(cache)
    m.decode(cache)
    m.check(cache)


def test_decode_at_the_end_of_the_buffer_compacts_without_growing(cache_and_model):
    cache, m = cache_and_model
    m.prefill(cache, {"a": 3})
    cap = cache.cap
    while cache.end < cap - 30:
        m.decode(cache)
    m.prefill(cache, {"b": 2})
    m.remove(cache, ["a"])                             # the window is now b's alone: small
    while cache.end < cap:
        m.decode(cache)
    w = cache.end - cache.start
    assert w <= cap - 64
    m.decode(cache)                                    # no column left: moves to column 0
    assert cache.cap == cap and (cache.start, cache.end) == (0, w + 1)
    m.check(cache)


def test_decode_at_the_end_of_the_buffer_grows_a_wide_window(cache_and_model):
    cache, m = cache_and_model
    m.prefill(cache, {"a": 3, "b": 1})
    cap = cache.cap
    while cache.end < cap:
        m.decode(cache)
    m.decode(cache)                                    # window of cap columns: must grow
    assert cache.cap == 2 * cap and (cache.start, cache.end) == (0, cap + 1)
    m.check(cache)


# --- through a real ModelWorker ------------------------------------------------------------------
LOGIT_TOL = 1e-4


def test_worker_with_a_tiny_initial_buffer_matches_solo_runs(sharp_model):
    """A worker whose cache starts with 8 columns goes through growth on the first prefill,
    compaction when decoding hits the end of the buffer, and growth when a long newcomer
    joins running rows; every sequence still produces its solo tokens and logits."""
    model, info = sharp_model
    lengths = {"A": 60, "B": 30, "C": 8, "D": 6, "E": 100}
    prompts = dict(zip(lengths, make_prompts(5, lengths=list(lengths.values()), seed=99)))
    worker = ModelWorker(model, info, 4)
    worker.cache = BatchKVCache(max_rows=4, initial_cols=8)
    rec = recording(worker)
    cache = worker.cache
    relocations = []
    original = cache._relocate

    def spy(new_start, min_cap):
        caller = sys._getframe(1).f_code.co_name
        before = (cache.cap, cache.num_rows)
        original(new_start, min_cap)
        relocations.append({"by": caller, "cap": (before[0], cache.cap), "rows": before[1],
                            "start": cache.start})

    cache._relocate = spy
    d = Driver(worker)
    seq = lambda sid: new_seq(sid, prompts[sid])   # noqa: E731
    d.step(prefill=[seq("A"), seq("B")])
    while cache.end < 72:
        d.step()
    d.step(free=["A"], prefill=[seq("C")])             # B moves into A's row
    while cache.end < 80:
        d.step()
    d.step(free=["B"], prefill=[seq("D")])             # C moves into B's row
    cap = cache.cap
    while not any(r["by"] == "begin_decode" for r in relocations):
        assert cache.end <= cap
        d.step()
    for _ in range(3):
        d.step()
    d.step(prefill=[seq("E")])                         # longer than the window: grow
    for _ in range(3):
        d.step()
    d.finish()

    assert [(r["by"], r["cap"][0] == r["cap"][1]) for r in relocations] == [
        ("add", False), ("begin_decode", True), ("add", False)], relocations
    assert relocations[0]["cap"] == (8, 128)
    assert relocations[1]["start"] == 0 and relocations[1]["rows"] == 2
    assert relocations[2]["rows"] == 2 and cache.cap == 256
    assert d.row_moves() >= 2

    solo = solo_references(model, info, prompts, {sid: len(t) for sid, t in d.outputs.items()})
    ties = [t for sid in prompts
            if (t := compare_to_solo(sid, solo[sid], d.outputs[sid], rec.steps[sid], LOGIT_TOL))]
    if ties:
        print("near ties:", ties)


def test_moving_the_window_reuses_the_buffers_while_they_are_big_enough(cache_and_model):
    # Zero-filling fresh buffers costs ~0.3 s for 64 rows of SmolLM2 on a CPU: a prefill into an
    # empty batch (every request at concurrency 1) or a longer newcomer must not reallocate.
    cache, m = cache_and_model
    m.prefill(cache, {"a": 3})
    bufs = [id(b) for b in cache.k + cache.v] + [id(cache.mask)]
    m.decode(cache)
    m.prefill(cache, {"b": 20})                        # longer than the window: it moves
    m.check(cache)
    m.remove(cache, ["a", "b"])
    m.prefill(cache, {"c": 30})                        # into an empty batch
    m.check(cache)
    assert [id(b) for b in cache.k + cache.v] + [id(cache.mask)] == bufs
