"""Sampling: seeds, top-k/top-p/min-p, min_tokens, repetition penalty, greedy.

Unit tests run the Sampler on hand-made logits; the others run a real TransformersBackend on the tiny
random model, whose temperature-1 distribution is close to uniform over ~49k tokens (so two
different seeds practically never agree by chance), and on its sharpened variant, whose greedy
tokens change from step to step.
"""
from __future__ import annotations

import pytest
import torch

from common.protocol import SamplingParams
from factories import GREEDY, Driver, make_prompts, new_seq, run_batch, run_solo
from worker.messages import StepRequest
from worker.model.transformers.backend import TransformersBackend
from worker.model.sampler import Sampler, SamplingState, greedy_tokens

N = 20


def sampled(seed=None, **kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 1.0), seed=seed, **kw)


def state(params: SamplingParams, token_ids=(), num_output_tokens=0, stop=()) -> SamplingState:
    return SamplingState.create(params, list(token_ids), num_output_tokens, stop, "cpu")


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(8, lengths=[17, 5, 40, 9, 63, 3, 28, 11], seed=5)


# --- seeds, through the worker ------------------------------------------------------------------
def test_same_seed_same_tokens_whatever_shares_the_batch(tiny_model, prompts):
    model, info = tiny_model
    me, seeded = prompts[0], sampled(seed=42)
    alone = run_solo(TransformersBackend(model, info, 8), me, N, seeded)
    assert len(set(alone)) >= N - 2, "temperature 1 on a random model: mostly distinct tokens"
    assert run_solo(TransformersBackend(model, info, 8), me, N, seeded) == alone

    # First row, among greedy, unseeded and otherwise seeded neighbours.
    out = run_batch(TransformersBackend(model, info, 8),
                    {"me": me, "g": prompts[1], "u": prompts[2], "o": prompts[3]}, N,
                    {"me": seeded, "g": GREEDY, "u": sampled(), "o": sampled(seed=7, top_k=50)})
    assert out["me"] == alone
    # Last row, other neighbours, other lengths.
    out = run_batch(TransformersBackend(model, info, 8),
                    {"a": prompts[4], "b": prompts[5], "c": prompts[6], "me": me}, N,
                    {"a": sampled(seed=42), "b": sampled(top_p=0.9), "c": GREEDY, "me": seeded})
    assert out["me"] == alone

    # Joining a running batch, then moving rows when a neighbour leaves before it.
    d = Driver(TransformersBackend(model, info, 8))
    d.step(prefill=[new_seq("x", prompts[4], sampled(seed=1)), new_seq("y", prompts[5])])
    for _ in range(3):
        d.step()
    d.step(prefill=[new_seq("me", me, seeded), new_seq("z", prompts[6], sampled())])
    for i in range(N - 1):
        d.step(free=["x"] if i == 5 else ())
    assert d.row_moves() >= 1
    assert d.outputs["me"] == alone


def test_different_seeds_give_different_tokens(tiny_model, prompts):
    model, info = tiny_model
    worker = TransformersBackend(model, info, 8)
    out = run_batch(worker, {"s1": prompts[0], "s2": prompts[0], "n1": prompts[0],
                             "n2": prompts[0]}, N,
                    {"s1": sampled(seed=1), "s2": sampled(seed=2), "n1": sampled(),
                     "n2": sampled()})
    for a, b in [("s1", "s2"), ("n1", "n2"), ("s1", "n1")]:
        same = sum(x == y for x, y in zip(out[a], out[b]))
        assert same <= 2, (a, b, out[a], out[b])


# --- top-k / top-p reduce to greedy, through the worker -------------------------------------------
def test_top_k_1_and_tiny_top_p_equal_greedy(sharp_model, prompts):
    model, info = sharp_model
    greedy = {f"p{i}": run_solo(TransformersBackend(model, info, 1), prompts[i], N) for i in (0, 1, 2)}
    assert all(len(set(g)) > 5 for g in greedy.values()), "greedy must not be one token repeated"
    out = run_batch(TransformersBackend(model, info, 8),
                    {"k1": prompts[0], "p0": prompts[1], "k1p": prompts[2], "free": prompts[3],
                     "k50": prompts[4]}, N,
                    {"k1": sampled(seed=3, top_k=1, temperature=1.5),
                     "p0": sampled(seed=4, top_p=1e-6),
                     "k1p": sampled(seed=5, top_k=1, top_p=0.9, min_p=0.05),
                     "free": sampled(seed=6), "k50": sampled(seed=7, top_k=50)})
    assert out["k1"] == greedy["p0"]
    assert out["p0"] == greedy["p1"]
    assert out["k1p"] == greedy["p2"]


# --- min_tokens ---------------------------------------------------------------------------------
def test_min_tokens_suppresses_stop_tokens_in_the_worker(tiny_model):
    """The tiny random model's greedy next token is its last input token: make that a stop
    token, and min_tokens must keep it out of the first tokens."""
    model, info = tiny_model
    prompt = make_prompts(1, lengths=[12], seed=8)[0]
    stop = prompt[-1]
    worker = TransformersBackend(model, info, 4)
    free = run_batch(worker, {"s": prompt}, 6)["s"]
    assert free[0] == stop, "the premise: unconstrained, the model says the stop token first"
    d = Driver(worker)
    d.step(prefill=[new_seq("s", prompt, SamplingParams(temperature=0.0, min_tokens=4),
                            stop_token_ids=(stop, 1)),
                    new_seq("t", prompt, sampled(seed=0, min_tokens=4, top_k=1),
                            stop_token_ids=(stop,))])
    for _ in range(5):
        d.step()
    for sid in ("s", "t"):
        assert stop not in d.outputs[sid][:4], d.outputs[sid]


def test_min_tokens_unit():
    logits = torch.full((2, 10), -50.0)
    logits[:, 3] = 10.0     # stop token, by far the likeliest
    logits[:, 6] = 1.0
    for num_out, want in ((0, 6), (1, 6), (2, 3)):
        for params in (SamplingParams(temperature=0.0, min_tokens=2),
                       sampled(seed=11, min_tokens=2)):
            st = state(params, [1, 2], num_output_tokens=num_out, stop=(3, 9))
            tok = Sampler()(logits.clone(), [st, state(GREEDY)])
            assert tok == [want, 3]   # the second row has no min_tokens: stop allowed


# --- repetition penalty -------------------------------------------------------------------------
@pytest.mark.parametrize("penalty,seen_logit,unseen_logit,want", [
    (1.5, 2.0, 1.5, "unseen"),    # positive seen logit divided: 2.0 -> 1.33 < 1.5
    (1.5, -1.0, -1.2, "unseen"),  # negative seen logit multiplied: -1.0 -> -1.5 < -1.2
    (1.5, 2.0, 1.2, "seen"),      # 1.33 still above 1.2: penalised, not banned
    (0.5, 1.0, 1.5, "seen"),      # a penalty below 1 favours seen tokens: 1.0 -> 2.0
    (1.0, 2.0, 1.5, "seen"),      # 1.0 is no penalty
])
def test_repetition_penalty_direction(penalty, seen_logit, unseen_logit, want):
    seen, unseen = 4, 7
    logits = torch.full((1, 10), -10.0)
    logits[0, seen], logits[0, unseen] = seen_logit, unseen_logit
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    tok = Sampler()(logits, [state(params, [1, seen, 2])])   # the prompt counts as seen
    assert tok == [seen if want == "seen" else unseen]


def test_repetition_penalty_applies_per_row():
    """Each row is penalised by its own tokens only."""
    logits = torch.tensor([[0.0, 2.0, 1.5, -9.0], [0.0, 2.0, 1.5, -9.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler()(logits, [state(p, [1]), state(p, [2])]) == [2, 1]


# --- greedy and the filters, unit ---------------------------------------------------------------
def test_temperature_zero_is_argmax_even_next_to_sampled_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen) * 3
    states = [state(GREEDY), state(sampled(seed=1)), state(GREEDY),
              state(SamplingParams(temperature=0.0, top_k=5, top_p=0.1)),
              state(sampled(seed=2, top_k=3)), state(GREEDY)]
    out = Sampler()(logits.clone(), states)
    want = logits.argmax(-1).tolist()
    for i in (0, 2, 3, 5):
        assert out[i] == want[i]


@pytest.mark.parametrize("vocab", [49152, 5000, 3000, 100])
def test_greedy_tokens_are_torch_argmax_ties_and_nan_included(vocab):
    """The two-pass argmax picks what torch.argmax picks: the first of equal maxima (also
    across chunks and in a short last chunk), NaN as the largest, index 0 of an all -inf row."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=gen).to(torch.bfloat16).float()
    top = float(logits.max()) + 1
    logits[1, [vocab - 1, vocab // 2, 7]] = top             # ties: the first wins
    logits[2, [vocab - 1, vocab - 2]] = top                 # in the last columns
    logits[3, vocab - 1] = top
    logits[4] = float("-inf")
    logits[5, [vocab // 3, vocab - 5]] = float("nan")
    logits[6] = 0.0                                         # all equal
    assert greedy_tokens(logits).tolist() == torch.argmax(logits, dim=-1).tolist()
    assert greedy_tokens(logits, chunk=7).tolist() == torch.argmax(logits, dim=-1).tolist()


def test_plain_greedy_rows_take_the_argmax_without_copying_the_logits(monkeypatch):
    """A batch of plain greedy rows is answered from the logits as they are (bf16 in a bf16
    model): the same tokens as argmax over fp32, and no fp32 copy of the whole matrix. A row
    that needs an edit (here min_tokens blocking its stop token) sends the batch the long way."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3000, generator=gen).to(torch.bfloat16)
    logits[2, [5, 2999]] = 10.0                              # a tie: the first wins
    want = torch.argmax(logits.float(), dim=-1).tolist()
    states = [state(GREEDY) for _ in range(4)]
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "float", lambda self: pytest.fail("the logits were copied"))
        assert Sampler().sample(logits, states) == (want, [None] * 4)
    stop = int(want[1])
    blocked = [state(GREEDY), state(SamplingParams(temperature=0.0, min_tokens=2), stop=[stop])]
    assert not blocked[1].plain_greedy and blocked[0].plain_greedy
    out = Sampler()(logits[:2], blocked)
    assert out[0] == want[0] and out[1] != stop


def draws(params_for_seed, logits, n=300) -> set[int]:
    """The tokens sampled from one row of logits under n seeds."""
    return {Sampler()(logits.clone(), [state(params_for_seed(s))])[0] for s in range(n)}


def test_top_k_keeps_the_k_likeliest():
    logits = torch.tensor([[0.0, 5.0, 4.9, 4.8, 4.7, 0.0]])
    assert draws(lambda s: sampled(seed=s, top_k=2), logits) == {1, 2}
    assert draws(lambda s: sampled(seed=s, top_k=1, temperature=2.0), logits) == {1}
    assert draws(lambda s: sampled(seed=s), logits) >= {1, 2, 3, 4}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert draws(lambda s: sampled(seed=s, top_p=0.5), logits) == {0, 1}
    assert draws(lambda s: sampled(seed=s, top_p=0.65), logits) == {0, 1}
    assert draws(lambda s: sampled(seed=s, top_p=0.75), logits) == {0, 1, 2}
    assert draws(lambda s: sampled(seed=s, top_p=1e-6), logits) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert draws(lambda s: sampled(seed=s, min_p=0.6), logits) == {0, 1}


def test_mixed_top_k_rows_in_one_batch():
    """Per-row k: a row without top_k is not cut by its neighbour's."""
    logits = torch.tensor([[0.0, 5.0, 4.9, 4.8, 4.7, 0.0]]).repeat(2, 1)
    seen_k1, seen_all = set(), set()
    for s in range(200):
        a, b = Sampler()(logits.clone(), [state(sampled(seed=s, top_k=1)), state(sampled(seed=s))])
        seen_k1.add(a)
        seen_all.add(b)
    assert seen_k1 == {1} and seen_all >= {1, 2, 3, 4}


def test_a_seeded_row_draws_the_same_in_one_batched_draw_as_alone():
    """The batch's rows are drawn in one pass (sampler.draw); a seeded row's token is the one
    it gets sampled on its own, whatever its neighbours (greedy, unseeded, other seeds and
    filters) and its place in the batch, at every output position."""
    gen = torch.Generator().manual_seed(11)
    kinds = [lambda s: sampled(seed=s), lambda s: GREEDY, lambda s: sampled(),
             lambda s: sampled(seed=s + 1, top_k=20), lambda s: sampled(seed=s, top_p=0.8),
             lambda s: sampled(temperature=0.7)]
    for trial in range(30):
        logits = torch.randn(len(kinds), 300, generator=gen) * 2
        params = [k(trial) for k in kinds]
        order = torch.randperm(len(kinds), generator=gen).tolist()
        n = trial % 5   # the output position: a seeded draw depends on (seed, n)
        batch = Sampler()(logits[order].clone(), [state(params[i], num_output_tokens=n)
                                                  for i in order])
        for row, i in enumerate(order):
            if params[i].seed is not None:
                alone = Sampler()(logits[i:i + 1].clone(), [state(params[i], num_output_tokens=n)])
                assert batch[row] == alone[0], (trial, i)


def test_unseeded_rows_drawn_together_follow_their_distribution(monkeypatch):
    """One draw for all the unseeded rows, not one per row (on a GPU, a few kernel launches
    each): each row's token follows its own probabilities (4,000 rows of one distribution,
    counts within 5 standard deviations), and a token of probability 0 is never drawn."""
    calls = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: calls.append(1) or multinomial(*a, **k))
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0])
    logits = probs.log().repeat(4000, 1)
    tokens = Sampler()(logits, [state(sampled()) for _ in range(4000)])
    counts = torch.bincount(torch.tensor(tokens), minlength=6).float()
    expected = probs * 4000
    assert counts[4:].sum() == 0
    assert ((counts - expected).abs() <= 5 * (expected * (1 - probs)).sqrt() + 1).all(), counts
    assert len(calls) == 1


# --- a sequence whose sampling fails does not take the batch down -------------------------------
def test_failing_prefill_sampling_fails_that_sequence_alone(tiny_model):
    """A stop token id outside the vocabulary with min_tokens makes the sampler raise after the
    group's KV rows were added: the poisoned sequence must get an error, its group and the
    running batch must go on, and no row may be left behind (or cached twice)."""
    model, info = tiny_model
    worker = TransformersBackend(model, info, 8)
    d = Driver(worker)
    d.step(prefill=[new_seq("running", [5, 6, 7])])
    res = worker.step(StepRequest(
        decode_seq_ids=["running"],
        prefill=[new_seq("good", [8, 9, 10, 11]),
                 new_seq("bad", [12, 13], SamplingParams(temperature=0.0, min_tokens=2),
                         stop_token_ids=(10**9,))]))
    assert set(res.errors) == {"bad"}
    assert set(res.token_ids) == {"running", "good"}
    assert sorted(worker.cache.seq_ids) == ["good", "running"]
    assert set(worker.states) == {"good", "running"}
    res = worker.step(StepRequest(decode_seq_ids=["running", "good"]))
    assert set(res.token_ids) == {"running", "good"} and not res.errors


# --- the order of the edits, and a second try over the same logits ------------------------------
def test_bias_then_repetition_then_presence_as_vllm():
    """llmq subtracted the presence penalty before dividing by the repetition penalty: token 5
    (logit 1, in the output) came to (1 - 2) x 1.5 = -1.5 below token 0's -1.4, where vLLM
    makes it 1 / 1.5 - 2 = -1.33 and keeps it."""
    p = SamplingParams(temperature=0.0, presence_penalty=2.0, repetition_penalty=1.5)
    logits = torch.full((1, 10), -5.0)
    logits[0, 5], logits[0, 0] = 1.0, -1.4
    assert Sampler()(logits, [state(p, token_ids=[9, 5], num_output_tokens=1)]) == [5]


def test_sampling_leaves_float32_logits_as_the_model_made_them():
    """A batch whose sampling fails is sampled again row by row from the same logits
    (TransformersBackend._prefill_pass): float32 logits were edited in place by the first try, so a
    row's logit_bias (and penalties) counted twice on the second."""
    logits = torch.zeros(2, 50)
    logits[:, 0] = 10.0
    before = logits.clone()
    biased = state(SamplingParams(temperature=0.0, logit_bias={3: 6.0}), token_ids=[1])
    Sampler()(logits, [biased, state(GREEDY)])
    assert torch.equal(logits, before)
    assert Sampler()(logits[:1], [biased]) == [0]   # 10 > 6: as the first time


# --- per-sequence work done once, not per token ---------------------------------------------
class CountingSet(frozenset):
    """A stop-id set that counts how often it is walked through."""
    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


class CountingBias(dict):
    """A logit_bias that counts how often its entries are read."""
    reads = 0

    def items(self):
        type(self).reads += 1
        return super().items()


def test_stop_ids_and_bias_become_tensors_once_per_sequence_not_per_token():
    """The min_tokens mask was rebuilt from the stop-id tuple at every token (1,000,000 ids:
    ~267 ms a token) and the bias tensor from the dict (a whole-vocabulary bias: ~23 ms), all
    inside the step every sequence waits on: both are made at the first step and kept."""
    vocab, steps = 1000, 10
    bias = CountingBias({t: -50.0 for t in range(0, 300)})   # 0..299 out of the running
    st = state(SamplingParams(temperature=0.0, min_tokens=steps + 1, logit_bias=bias))
    st.stop_token_ids = CountingSet(range(300, 600))           # 300..599 blocked (min_tokens)
    sampler = Sampler()
    for i in range(steps):
        logits = torch.zeros(1, vocab)
        logits[0, :600] = 10.0        # only the bias and the mask keep these out
        logits[0, 600 + i] = 1.0
        [tok] = sampler(logits, [st])
        assert tok == 600 + i
        st.record(tok)
    assert CountingSet.walks == 1 and CountingBias.reads == 1
