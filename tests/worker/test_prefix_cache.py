"""Prefix caching: PrefixCache by itself on hand-made tensors, then inside the model worker,
where a prompt prefilled over cached blocks must give what the same prompt gives computed
from scratch (tokens, and logits within float noise)."""
from __future__ import annotations

import pytest
import torch

from common.protocol import SamplingParams
from factories import Driver, compare_to_solo, make_prompts, new_seq, recording, solo_references
from worker.messages import StepRequest
from worker.model_worker import ModelWorker
from worker.prefix_cache import PrefixCache

B = 8          # the block size
LOGIT_TOL = 1e-4


def kv_of_positions(layers: int = 2, heads: int = 1, dim: int = 1):
    """kv_of(start, end) whose values are the token positions, so a match can be read back."""
    def kv_of(start, end):
        pos = torch.arange(start, end, dtype=torch.float32)
        return pos.view(1, 1, 1, -1, 1).expand(layers, 2, heads, end - start, dim)
    return kv_of


BLOCK_BYTES = 2 * 2 * 1 * B * 1 * 4   # layers x (k, v) x heads x tokens x dim x float32


# --- PrefixCache --------------------------------------------------------------------------------
def test_a_match_is_whole_blocks_and_leaves_the_last_token_to_compute():
    c = PrefixCache(1 << 20, block_size=B)
    prompt = list(range(100, 120))                      # 20 tokens: 2 whole blocks
    assert c.insert(prompt, None, kv_of_positions()) == 2
    assert c.insert(prompt, None, kv_of_positions()) == 0   # already there
    assert c.match(prompt).num_tokens == 16
    assert c.match(prompt[:16]).num_tokens == 8         # 16 cached, but one must be computed
    assert c.match(prompt[:17] + [7, 7]).num_tokens == 16
    m = c.match(prompt)
    assert m.kv().shape == (2, 2, 1, 16, 1)
    assert m.kv()[0, 0, 0, :, 0].tolist() == list(range(16))   # blocks in prompt order
    assert c.match(prompt[:8]).num_tokens == 0 and c.match(prompt[:8]).kv() is None


def test_a_block_is_shared_only_after_the_same_tokens_and_the_same_salt():
    c = PrefixCache(1 << 20, block_size=B)
    prompt = list(range(100, 125))
    c.insert(prompt, None, kv_of_positions())
    second_block_differs = prompt[:8] + [1] + prompt[9:]
    first_block_differs = [1] + prompt[1:]
    assert c.match(second_block_differs).num_tokens == 8
    assert c.match(first_block_differs).num_tokens == 0  # later blocks equal, context not
    assert c.match(prompt, salt="tenant-b").num_tokens == 0
    c.insert(prompt, "tenant-b", kv_of_positions())
    assert c.match(prompt, salt="tenant-b").num_tokens == 24


def test_eviction_keeps_the_budget_and_takes_chains_from_their_tail():
    c = PrefixCache(3 * BLOCK_BYTES, block_size=B)
    old, new = list(range(100, 117)), list(range(200, 217))   # 2 blocks each
    c.insert(old, None, kv_of_positions())
    c.insert(new, None, kv_of_positions())          # one of old's blocks has to go: its tail
    assert c.num_bytes == 3 * BLOCK_BYTES and len(c.blocks) == 3
    assert c.match(old).num_tokens == 8
    assert c.match(new).num_tokens == 16
    # Two more blocks: the least recently used go, old's last one, then new's tail (new's
    # first block was touched after its tail).
    c.insert(list(range(300, 317)), None, kv_of_positions())
    assert c.match(new).num_tokens == 8 and c.match(old).num_tokens == 0
    assert c.num_bytes == 3 * BLOCK_BYTES


def test_off_with_no_budget():
    c = PrefixCache(0)
    assert c.insert(list(range(40)), None, kv_of_positions()) == 0
    assert c.match(list(range(40))).num_tokens == 0


# --- in the model worker ------------------------------------------------------------------------
@pytest.fixture
def shared_prompts():
    """Prompts that share a 27-token 'system prompt' (3 whole blocks and 3 tokens), with
    different tails, plus one that shares nothing."""
    system, = make_prompts(1, lengths=[27], seed=99)
    tails = make_prompts(5, lengths=[1, 5, 13, 30, 2], seed=7)
    prompts = {f"chat{i}": system + t for i, t in enumerate(tails)}
    prompts["other"] = make_prompts(1, lengths=[21], seed=5)[0]
    return system, prompts


def test_prefill_over_cached_blocks_matches_computing_everything(sharp_model, shared_prompts):
    model, info = sharp_model
    system, prompts = shared_prompts
    solo = solo_references(model, info, prompts, 6)        # no prefix cache
    worker = ModelWorker(model, info, 8, prefix_cache_bytes=64 << 20)
    d = Driver(worker)
    d.step(prefill=[new_seq("warm", system + [101, 102, 103, 104, 105])])
    d.finish()
    rec = recording(worker)
    res = worker.step(StepRequest(prefill=[new_seq(sid, ids) for sid, ids in prompts.items()]))
    assert not res.errors
    # Whole blocks of the shared part (24 of its 27 tokens; chat0's own tail is 1 token, so
    # with it the prompt has 28 and 24 can still be reused); nothing for the stranger.
    assert res.cached_tokens == {f"chat{i}": 24 for i in range(5)}
    outputs = {sid: [tok] for sid, tok in res.token_ids.items()}
    d = Driver(worker, outputs=outputs, running=list(prompts))
    for _ in range(5):
        d.step()
    for sid in prompts:
        assert compare_to_solo(sid, solo[sid], outputs[sid], rec.steps[sid], LOGIT_TOL) is None
    d.finish()


def test_a_prompt_meets_its_own_blocks_the_second_time(sharp_model):
    model, info = sharp_model
    prompt, = make_prompts(1, lengths=[40], seed=3)
    worker = ModelWorker(model, info, 4, prefix_cache_bytes=64 << 20)
    first, second = Driver(worker), Driver(worker)
    first.step(prefill=[new_seq("a", prompt)])
    for _ in range(4):
        first.step()
    first.finish()
    res = worker.step(StepRequest(prefill=[new_seq("b", prompt)]))
    assert res.cached_tokens == {"b": 32}
    second.running, second.outputs = ["b"], {"b": [res.token_ids["b"]]}
    for _ in range(4):
        second.step()
    assert second.outputs["b"] == first.outputs["a"]
    salted = SamplingParams(temperature=0.0, cache_salt="someone else")
    res = worker.step(StepRequest(prefill=[new_seq("c", prompt, salted)], decode_seq_ids=["b"]))
    assert "c" not in res.cached_tokens
    assert res.token_ids["c"] == first.outputs["a"][0]


def test_a_cache_layout_it_cannot_store_turns_it_off_and_the_prefill_still_runs(tiny_model):
    model, info = tiny_model
    prompt, = make_prompts(1, lengths=[20], seed=11)
    worker = ModelWorker(model, info, 2, prefix_cache_bytes=64 << 20)

    def unsupported(*_args):
        raise RuntimeError("layers of different shapes")

    worker.prefix_cache.insert = unsupported
    res = worker.step(StepRequest(prefill=[new_seq("a", prompt)]))
    assert not res.errors and "a" in res.token_ids
    assert not worker.prefix_cache.enabled
    assert worker.prefix_cache.match(prompt).num_tokens == 0
