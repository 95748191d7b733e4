"""Prefix caching: PrefixCache by itself on hand-made block ids, then inside the model worker,
where a prompt prefilled over cached (shared) blocks must give what the same prompt gives
computed from scratch (tokens, and logits within float noise)."""
from __future__ import annotations

import pytest

from common.protocol import SamplingParams
from factories import Driver, compare_to_solo, make_prompts, new_seq, recording, solo_references
from worker.messages import StepRequest
from worker.model.transformers.backend import TransformersBackend
from worker.model.transformers.prefix_cache import PrefixCache, block_keys

B = 8          # the block size
LOGIT_TOL = 1e-4


def cache_with(prompt: list[int], salt: str | None = None, max_parked: int = 64,
               c: PrefixCache | None = None) -> PrefixCache:
    """Registers the prompt's full blocks under block ids 100, 101, ... (or the next free)."""
    c = c or PrefixCache(max_parked, block_size=B)
    first = 100 + len(c.key_of)
    for i, key in enumerate(c.keys(prompt, salt, len(prompt) // B)):
        c.register(key, first + i)
    return c


# --- PrefixCache --------------------------------------------------------------------------------
def test_a_match_is_whole_blocks_and_leaves_the_last_token_to_compute():
    prompt = list(range(100, 120))                      # 20 tokens: 2 whole blocks
    c = cache_with(prompt)
    assert c.match(prompt) == [100, 101]
    assert c.match(prompt[:16]) == [100]                # 16 cached, but one must be computed
    assert c.match(prompt[:17] + [7, 7]) == [100, 101]
    assert c.match(prompt[:8]) == []
    c.register(c.keys(prompt, None, 1)[0], 555)         # a key keeps its first block
    assert c.match(prompt) == [100, 101]


def test_a_block_is_shared_only_after_the_same_tokens_and_the_same_salt():
    prompt = list(range(100, 125))
    c = cache_with(prompt)
    second_block_differs = prompt[:8] + [1] + prompt[9:]
    first_block_differs = [1] + prompt[1:]
    assert c.match(second_block_differs) == [100]
    assert c.match(first_block_differs) == []           # later blocks equal, context not
    assert c.match(prompt, salt="tenant-b") == []
    cache_with(prompt, "tenant-b", c=c)
    assert c.match(prompt, salt="tenant-b") == [103, 104, 105]


def test_a_salt_cannot_pose_as_an_earlier_block():
    """The salt started the chain raw, as a block's key does: a salt whose bytes were some
    prompt's first-block key made a block at positions 0-7 that the prompt took for its own
    block at positions 8-15 (with no keys, or a shared cache, any client can pick the salt)."""
    for first in range(1000, 200000):                   # a first block whose key is UTF-8
        victim = [first] + list(range(1, 16))
        k0, k1 = block_keys(victim, None, 2, B)
        try:
            salt = k0.decode("utf-8")
        except UnicodeDecodeError:
            continue
        break
    else:
        pytest.fail("no first-block key was valid UTF-8")
    assert block_keys(victim[8:], salt, 1, B) != [k1]
    c = cache_with(victim[8:] + [0], salt)              # the posing block, registered
    assert c.match(victim + [0]) == []


def test_parked_blocks_are_evicted_least_recently_parked_first_within_the_cap():
    old, new = list(range(100, 117)), list(range(200, 217))   # 2 blocks each
    c = cache_with(old, max_parked=3)
    cache_with(new, c=c)
    # Released last block first (as BlockPool.release does): chains lose their tails first.
    assert c.park(101) == [] and c.park(100) == []
    assert c.park(103) == [] and c.park(102) == [101]   # over the cap: old's tail goes
    assert c.match(old) == [100] and c.match(new) == [102, 103]
    c.unpark(102)                                       # in use again: not evictable
    assert c.evict() == 100 and c.evict() == 103 and c.evict() is None
    assert c.match(new) == [102] and c.match(old) == []
    assert c.park(555) == [555]                         # a block holding no prefix is freed


def test_off_with_no_budget():
    c = PrefixCache(0, block_size=B)
    cache_with(list(range(40)), c=c)
    assert c.match(list(range(40))) == [] and not c.key_of


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
    worker = TransformersBackend(model, info, 8, prefix_cache_bytes=64 << 20)
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
    worker = TransformersBackend(model, info, 4, prefix_cache_bytes=64 << 20)
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


def test_without_a_prefix_budget_nothing_is_reused(tiny_model):
    model, info = tiny_model
    prompt, = make_prompts(1, lengths=[20], seed=11)
    worker = TransformersBackend(model, info, 2, prefix_cache_bytes=0)
    for sid in ("a", "b"):
        res = worker.step(StepRequest(prefill=[new_seq(sid, prompt)]))
        assert not res.errors and sid in res.token_ids and not res.cached_tokens
        worker.step(StepRequest(free_seq_ids=[sid]))
    assert worker.cache.num_free_blocks == worker.cache.num_blocks
