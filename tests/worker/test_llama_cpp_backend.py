"""The llama.cpp backend driven step by step, in this process, on the default model's GGUF.

The same StepRequests the model executor sends: sequences join and leave the flat batch, their
slots are reused, and a bad sequence fails alone. Sampling takes one of two paths: llama.cpp's
own sampler chain per sequence (its logits never copied out), or llmq's Sampler for what only
it does (logprobs, penalties, structured output); both must give the same tokens where both
apply.
"""
from __future__ import annotations

import dataclasses

import pytest

from common.protocol import SamplingParams
from worker.messages import NewSequence, StepRequest
from worker.model.backend import StepHooks

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make llama-cpp)")

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def backend(default_model_dir):
    from common.settings import Settings
    from worker.model.backend import load_backend

    b = load_backend(Settings.from_env(backend="llama_cpp", model="smollm2", max_num_seqs=4,
                                       max_model_len=256, torch_threads=1))
    b.warm_up()
    return b


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def run(backend, prompts: dict[str, list[int]], n: int, params=GREEDY, join_at: dict | None = None,
        logprobs: dict | None = None, done_before: int = 0) -> dict[str, list[int]]:
    """Decodes n tokens for each prompt; join_at delays a prompt's prefill to a step; params is
    one SamplingParams or one per prompt; `logprobs` collects the logprobs answered;
    `done_before` says that many of each prompt's last tokens are output already (a restart)."""
    join_at = join_at or {}
    per = params if isinstance(params, dict) else dict.fromkeys(prompts, params)
    out: dict[str, list[int]] = {sid: [] for sid in prompts}
    live: list[str] = []
    step = 0
    while any(len(v) < n for v in out.values()):
        new = [NewSequence(sid, ids, per[sid], num_output_tokens=done_before)
               for sid, ids in prompts.items() if join_at.get(sid, 0) == step]
        done = [sid for sid in live if len(out[sid]) >= n]
        live = [sid for sid in live if sid not in done]
        res = backend.step(StepRequest(prefill=new, decode_seq_ids=list(live), free_seq_ids=done))
        assert not res.errors, res.errors
        for sid, t in res.token_ids.items():
            out[sid].append(t)
        if logprobs is not None:
            for sid, lp in res.logprobs.items():
                logprobs.setdefault(sid, []).append(lp)
        live += [s.seq_id for s in new]
        step += 1
    backend.step(StepRequest(free_seq_ids=live))
    return out


def test_loads_the_gguf_and_describes_it(backend):
    info = backend.info
    assert info.path.endswith(".gguf") and info.dtype == "gguf-q4_1"
    assert info.vocab_size == 49152 and info.max_model_len == 256
    assert info.eos_token_ids, "EOS must be known, or nothing would ever stop"


@pytest.fixture(scope="module")
def pool_backend(default_model_dir):
    """Four sequences and no LLMQ_MAX_MODEL_LEN: a pool of 4 x 2,048 KV cells."""
    from common.settings import Settings
    from worker.model.backend import load_backend

    return load_backend(Settings.from_env(backend="llama_cpp", model="smollm2", max_num_seqs=4,
                                          max_model_len=0, torch_threads=1))


def test_one_kv_pool_serves_a_prompt_longer_than_an_equal_share(pool_backend, tok):
    """The sequences share one pool of KV cells (llama.cpp's unified cache): a prompt longer
    than the pool over max_num_seqs is served beside a short one, up to the model's context,
    and the workload manager counts the pool's cells."""
    assert pool_backend.kv_capacity == (4 * 2048, 1)
    assert pool_backend.info.max_model_len == 8192   # SmolLM2's context, not 8192 / 4
    text = "The lighthouse keeper wrote a letter every night about the sea. "
    long_ids = (tok(text)["input_ids"] * 200)[:2100]
    short = tok("The capital of France is")["input_ids"]
    out = run(pool_backend, {"long": long_ids, "short": short}, 3)
    assert len(out["long"]) == 3 and "Paris" in tok.decode(out["short"])


def test_greedy_continues_a_known_sentence(backend, tok):
    ids = tok("The capital of France is")["input_ids"]
    out = run(backend, {"a": ids}, 3)
    assert "Paris" in tok.decode(out["a"])


def test_a_sequence_joining_the_batch_gets_what_it_gets_alone(backend, tok):
    prompts = {"a": tok("Once upon a time")["input_ids"],
               "b": tok("The best way to learn Python is")["input_ids"]}
    alone = {sid: run(backend, {sid: ids}, 8)[sid] for sid, ids in prompts.items()}
    together = run(backend, prompts, 8, join_at={"b": 3})
    assert together == alone


def test_slots_are_freed_and_reused(backend, tok):
    ids = tok("Hello")["input_ids"]
    for round_ in range(3):   # 3 x 4 sequences through 4 slots: each round frees all of them
        out = run(backend, {f"r{round_}-{i}": ids for i in range(4)}, 2)
        assert len({tuple(v) for v in out.values()}) == 1
    assert len(backend.free_slots) == 4 and not backend.slots and not backend.chains


def test_the_batch_goes_to_llama_cpp_in_slot_order(backend, tok, monkeypatch):
    """llama.cpp cuts a batch into micro-batches of ascending runs of consecutive sequence ids
    (one KV stream per sequence), each a pass over all the weights: rows out of slot order
    make one pass per row. Whatever order the engine lists them in, they go in slot order,
    each sequence's prompt in position order, and the tokens still go to the right sequence."""
    ids = {sid: tok(p)["input_ids"] for sid, p in
           [("a", "Once upon a time"), ("b", "The best way to learn Python is"),
            ("c", "Hello"), ("d", "The capital of France is")]}
    alone = {sid: run(backend, {sid: v}, 3)[sid] for sid, v in ids.items()}
    batches = []
    decode = backend.lib.llama_decode

    def recording(ctx, batch):
        batches.append([(batch.seq_id[i][0], batch.pos[i]) for i in range(batch.n_tokens)])
        return decode(ctx, batch)

    monkeypatch.setattr(backend.lib, "llama_decode", recording)
    out = {sid: [] for sid in ids}
    joining = [("c", "b", "a"), ("d",), ()]   # newcomers listed out of slot order too
    for step in range(3):
        new = [NewSequence(sid, ids[sid], GREEDY) for sid in joining[step]]
        running = [sid for sid in ("c", "a", "b", "d") if out[sid]]   # not in slot order
        res = backend.step(StepRequest(prefill=new, decode_seq_ids=running))
        for sid, t in res.token_ids.items():
            out[sid].append(t)
    backend.step(StepRequest(free_seq_ids=list(ids)))
    assert batches and all(b == sorted(b) for b in batches), batches
    assert out == {sid: alone[sid][:len(out[sid])] for sid in ids}
    assert [len(v) for v in out.values()] == [3, 3, 3, 2]


def test_a_bad_sequence_fails_alone(backend, tok):
    ok = NewSequence("ok", tok("Hello")["input_ids"], GREEDY)
    too_long = NewSequence("long", [1] * 300, GREEDY)
    bad_stop = NewSequence("stop", [1, 2], GREEDY, stop_token_ids=(10**9,))
    res = backend.step(StepRequest(prefill=[ok, too_long, bad_stop]))
    assert set(res.errors) == {"long", "stop"} and "context" in res.errors["long"]
    assert set(res.token_ids) == {"ok"}
    res = backend.step(StepRequest(decode_seq_ids=["ok"]))
    assert set(res.token_ids) == {"ok"}
    backend.step(StepRequest(free_seq_ids=["ok"]))
    assert len(backend.free_slots) == 4


def test_seeded_sampling_does_not_depend_on_the_batch(backend, tok):
    seeded = SamplingParams(temperature=1.0, seed=7)
    ids = tok("My favourite colour is")["input_ids"]
    alone = run(backend, {"s": ids}, 6, params=seeded)["s"]
    crowd = run(backend, {"s": ids, "x": tok("Other text")["input_ids"]}, 6, params=seeded)["s"]
    assert alone == crowd
    other = run(backend, {"s": ids}, 6, params=SamplingParams(temperature=1.0, seed=8))["s"]
    assert other != alone


def with_(params: SamplingParams, **changes) -> SamplingParams:
    return dataclasses.replace(params, **changes)


@pytest.fixture
def no_python_sampling(backend, monkeypatch):
    """Fails the test if llmq's Sampler is asked to sample (the C path must take the step)."""
    def refuse(logits, states):
        raise AssertionError(f"llmq's Sampler called for {len(states)} rows")

    monkeypatch.setattr(backend.sampler, "sample", refuse)


def test_plain_requests_are_sampled_without_llmq_sampler(backend, tok, no_python_sampling):
    ids = tok("The capital of France is")["input_ids"]
    plain = [GREEDY, SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=1),
             SamplingParams(temperature=1.0), with_(GREEDY, logit_bias={5: 1.0}, min_tokens=2,
                                                    stop_token_ids=[2])]
    out = run(backend, {f"p{i}": ids for i in range(len(plain))}, 4,
              params={f"p{i}": p for i, p in enumerate(plain)})
    assert all(len(v) == 4 for v in out.values())
    assert "Paris" in tok.decode(out["p0"])


@pytest.mark.parametrize("params", [
    GREEDY,
    with_(GREEDY, logit_bias={1: 3.0, 12: -100.0}),                 # C chain: bias, greedy
    SamplingParams(temperature=0.7, top_k=1, seed=3),                # one candidate left
    SamplingParams(temperature=1.0, top_p=1e-6, seed=3),
], ids=["argmax", "bias", "top_k=1", "top_p~0"])
def test_c_sampling_equals_llmq_sampler_where_both_are_deterministic(backend, tok, params):
    """The same prompt through the C chain and through llmq's Sampler (taken because the
    request asks for logprobs) gives the same tokens, in a batch shared by both."""
    ids = tok("Once upon a time there was")["input_ids"]
    lps: dict = {}
    out = run(backend, {"c": ids, "py": ids}, 8, logprobs=lps,
              params={"c": params, "py": with_(params, logprobs=0)})
    assert out["c"] == out["py"]
    assert "c" not in lps and len(lps["py"]) == 8, "the fallback answers logprobs, C does not"


def test_min_tokens_holds_back_stop_tokens_on_both_paths(backend, tok):
    ids = tok("The capital of France is")["input_ids"]
    free = run(backend, {"a": ids}, 6)["a"]
    stops = tuple(dict.fromkeys(free[:3]))    # what greedy says first: now stop tokens
    held = with_(GREEDY, min_tokens=3)
    c = _run_with_stops(backend, ids, held, stops, 6)
    assert not set(c[:3]) & set(stops), (c, stops)
    # llmq's Sampler masks the same way, and both unmask after min_tokens
    assert c == _run_with_stops(backend, ids, with_(held, logprobs=0), stops, 6)
    drawn = _run_with_stops(backend, ids, SamplingParams(temperature=1.0, seed=5, min_tokens=3),
                            stops, 6)
    assert not set(drawn[:3]) & set(stops), (drawn, stops)


def _run_with_stops(backend, ids, params, stops, n) -> list[int]:
    sid = "stops"
    res = backend.step(StepRequest(prefill=[NewSequence(sid, ids, params, stop_token_ids=stops)]))
    toks = [res.token_ids[sid]]
    while len(toks) < n:
        toks.append(backend.step(StepRequest(decode_seq_ids=[sid])).token_ids[sid])
    backend.step(StepRequest(free_seq_ids=[sid]))
    return toks


def test_seeded_c_sampling_is_reproducible_and_after_a_restart(backend, tok):
    """The same seed, the same tokens: alone, in the same company again, and continued after
    a restart. (Not in any company: in the shared KV pool a sequence's cells lie among the
    others', and llama.cpp's attention rounds by where they lie, so a sampled draw near a
    tie can go another way in other company.)"""
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    ids = tok("My favourite colour is")["input_ids"]
    alone = run(backend, {"s": ids}, 8, params=seeded)["s"]
    assert run(backend, {"s": ids}, 8, params=seeded)["s"] == alone
    company = {"s": seeded, "x": GREEDY, "y": with_(seeded, seed=12, logprobs=1),
               "z": SamplingParams(temperature=1.0, seed=13)}
    crowd = [run(backend, {sid: ids for sid in company}, 8, params=company,
                 join_at={"s": 2, "y": 1}) for _ in range(2)]
    assert crowd[0] == crowd[1]
    # a restart after 3 tokens: the prompt plus those tokens, then the same 5 that followed
    again = run(backend, {"s": ids + alone[:3]}, 5, params=seeded, done_before=3)["s"]
    assert again == alone[3:]


def test_prompt_logprobs_beside_c_sampling(backend, tok):
    """A prompt scored at every position still gets its first token from its C chain."""
    ids = tok("The capital of France is")["input_ids"]
    plain = backend.step(StepRequest(prefill=[NewSequence("p", ids, GREEDY)]))
    scored = backend.step(StepRequest(prefill=[NewSequence(
        "q", ids, with_(GREEDY, prompt_logprobs=1))], free_seq_ids=["p"]))
    backend.step(StepRequest(free_seq_ids=["q"]))
    lps = scored.prompt_logprobs["q"]
    assert len(lps) == len(ids) - 1 and all(lp.rank >= 1 and len(lp.top_ids) == 1 for lp in lps)
    assert scored.token_ids["q"] == plain.token_ids["p"]


@pytest.fixture
def decodes(backend, monkeypatch) -> list[int]:
    """The batch sizes of the llama_decode calls made from here on (running ahead allowed,
    whatever LLMQ_RUN_AHEAD=auto says about this host's cores)."""
    monkeypatch.setattr(backend, "runs_ahead", True)
    calls: list[int] = []
    decode = backend.lib.llama_decode

    def counting(ctx, batch):
        calls.append(batch.n_tokens)
        return decode(ctx, batch)

    monkeypatch.setattr(backend.lib, "llama_decode", counting)
    return calls


def _run_ahead(backend, decodes, ids, params, stops, n, held_back=()) -> tuple[list, list]:
    """A lone sequence as the model process runs it: `run_ahead` after every step. At the
    output counts in `held_back` the next step does not decode it (as when the engine
    preempts or holds it back), so the token run ahead must be taken back. Returns its tokens
    and the llama_decode calls made by each step that decoded it."""
    sid = "ahead"
    res = backend.step(StepRequest(prefill=[NewSequence(sid, ids, params, stop_token_ids=stops)]))
    toks, calls = [res.token_ids[sid]], []
    held = list(held_back)
    while len(toks) < n:
        backend.run_ahead()
        if len(toks) in held:
            held.remove(len(toks))
            assert sid not in backend.step(StepRequest()).token_ids
            # the cell run ahead is gone: the KV cache ends at the last token asked for
            kv_end = backend.lib.llama_memory_seq_pos_max(backend.mem, backend.slots[sid])
            assert kv_end == backend.positions[sid] - 1
            continue
        made = len(decodes)
        toks.append(backend.step(StepRequest(decode_seq_ids=[sid])).token_ids[sid])
        calls.append(len(decodes) - made)
    backend.step(StepRequest(free_seq_ids=[sid]))
    return toks, calls


@pytest.mark.parametrize("params", [
    GREEDY, SamplingParams(temperature=1.0, seed=5)], ids=["greedy", "seeded"])
def test_a_lone_sequence_is_decoded_ahead_of_the_step_that_asks(backend, tok, decodes, params):
    """Run ahead, a lone sequence's next token is ready when its step comes: that step makes
    no llama_decode call, and the tokens are those of the plain steps."""
    ids = tok("The capital of France is")["input_ids"]
    plain = _run_with_stops(backend, ids, params, (), 6)
    ahead, calls = _run_ahead(backend, decodes, ids, params, (), 6)
    assert ahead == plain
    assert calls == [0] * 5


def test_a_token_run_ahead_and_not_asked_for_is_taken_back(backend, tok, decodes):
    """A step that does not decode the sequence (preempted, held back) takes back its token
    run ahead, KV cell and sample: the seeded draws, and the min_tokens mask lifted by the
    sample taken back, come out as without running ahead."""
    ids = tok("My favourite colour is")["input_ids"]
    params = SamplingParams(temperature=1.0, seed=9, min_tokens=3)
    stops = tuple(dict.fromkeys(run(backend, {"a": ids}, 3, params=params)["a"]))
    plain = _run_with_stops(backend, ids, params, stops, 6)
    ahead, _calls = _run_ahead(backend, decodes, ids, params, stops, 6, held_back=(2, 3, 4))
    assert ahead == plain


def test_no_running_ahead_beside_others_nor_past_the_end(backend, tok, decodes):
    ids = tok("Hello")["input_ids"]
    backend.step(StepRequest(prefill=[NewSequence("a", ids, GREEDY), NewSequence("b", ids, GREEDY)]))
    backend.run_ahead()   # two running: a newcomer could not share the pass any more
    backend.step(StepRequest(free_seq_ids=["a", "b"]))
    last = backend.step(StepRequest(prefill=[NewSequence("c", ids, with_(GREEDY, max_tokens=1))]))
    made = len(decodes)
    backend.run_ahead()   # its one token is out: the engine ends it
    backend.step(StepRequest(prefill=[NewSequence("d", ids, with_(GREEDY, logprobs=0))],
                             free_seq_ids=["c"]))
    backend.run_ahead()   # sampled by llmq's Sampler, whose state is not taken back
    backend.step(StepRequest(free_seq_ids=["d"]))
    assert last.token_ids["c"] is not None and len(decodes) == made + 1   # d's prefill only
    assert backend.ahead is None


def test_running_ahead_waits_for_a_core_left_to_the_serving_stack(monkeypatch):
    """`auto` runs ahead only when llama.cpp's threads leave a core over: without one, the
    engine's turn would take a core from a llama.cpp thread mid-decode."""
    from worker.model.llama_cpp.backend import _runs_ahead

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert _runs_ahead("auto", 1) and not _runs_ahead("auto", 2)
    assert _runs_ahead("on", 2) and not _runs_ahead("off", 1)


# --- multi-step: several decode passes in one request --------------------------------------------
def _multi_step(backend, prompts: dict[str, list[int]], params: dict, num_steps: int,
                stops: dict | None = None) -> tuple[dict[str, list[int]], list[int]]:
    """Prefills the prompts, then sends decode steps of `num_steps` passes until none of them
    makes a token. Returns each sequence's tokens and the passes each step ran."""
    stops = stops or {}
    res = backend.step(StepRequest(prefill=[NewSequence(sid, ids, params[sid],
                                                        stop_token_ids=stops.get(sid, ()))
                                            for sid, ids in prompts.items()]))
    out = {sid: [t] for sid, t in res.token_ids.items()}
    passes = []
    while True:
        live = [sid for sid in prompts if not backend.states[sid].ended]
        if not live:
            break
        res = backend.step(StepRequest(decode_seq_ids=live, num_steps=num_steps))
        assert not res.errors, res.errors
        passes.append(res.num_passes)
        for sid in live:
            out[sid] += [res.token_ids[sid], *res.more_token_ids.get(sid, [])]
    backend.step(StepRequest(free_seq_ids=list(prompts)))
    return out, passes


@pytest.mark.parametrize("params", [
    GREEDY, SamplingParams(temperature=1.0, top_p=0.9, seed=3)], ids=["greedy", "seeded"])
def test_multi_step_passes_make_the_tokens_of_one_pass_a_step(backend, tok, decodes, params):
    """A request of 4 passes decodes its running batch 4 times in one step, one llama_decode a
    pass, and each sequence gets the tokens one pass a step gives it; a sequence that reaches
    max_tokens stops there while the others go on."""
    prompts = {"a": tok("The capital of France is")["input_ids"],
               "b": tok("My favourite colour is")["input_ids"]}
    per = {"a": with_(params, max_tokens=7), "b": with_(params, max_tokens=11)}
    single, _ = _multi_step(backend, prompts, per, 1)
    made = len(decodes)
    multi, passes = _multi_step(backend, prompts, per, 4)
    assert multi == single
    assert [len(multi[s]) for s in "ab"] == [7, 11]
    assert passes == [4, 4, 2]   # b alone in the last two passes of the second step, then 2
    assert len(decodes) - made == 1 + sum(passes)   # the prefill, then one call a pass
    assert decodes[made + 5:made + 9] == [2, 2, 1, 1]


def test_multi_step_stops_a_sequence_at_a_stop_token_once_min_tokens_are_out(backend, tok):
    ids = tok("The capital of France is")["input_ids"]
    first = run(backend, {"a": ids}, 12)["a"]
    k = next(i for i in range(2, 12) if first[i] not in first[:i])   # a token new at k
    stop = (first[k],)
    out, _ = _multi_step(backend, {"a": ids}, {"a": with_(GREEDY, max_tokens=50)}, 8,
                         stops={"a": stop})
    assert out["a"] == first[:k + 1]   # ends on it, inside a step's passes
    out, _ = _multi_step(backend, {"a": ids}, {"a": with_(GREEDY, max_tokens=k + 3,
                                                          min_tokens=k + 2)}, 8,
                         stops={"a": stop})
    a = out["a"]   # the stop token masked for its first k + 2 tokens: it runs to the length
    assert a[:k] == first[:k] and stop[0] not in a[:k + 2] and len(a) == k + 3


def test_multi_step_runs_one_pass_for_a_sequence_sampled_by_llmq(backend, tok):
    """logprobs need llmq's Sampler, whose state the passes after the first would bypass."""
    ids = tok("Hello")["input_ids"]
    out, passes = _multi_step(backend, {"a": ids, "b": ids},
                              {"a": with_(GREEDY, max_tokens=4),
                               "b": with_(GREEDY, max_tokens=4, logprobs=1)}, 4)
    assert passes == [1, 1, 1] and out["a"] == out["b"]


def test_multi_step_passes_end_where_another_pass_says_so(backend, tok):
    """The model process's CutShort hook: asked before each pass after the first, False ends
    the request there with the tokens made so far, the same tokens as one pass a step."""
    ids = tok("The capital of France is")["input_ids"]
    whole, _ = _multi_step(backend, {"a": ids}, {"a": with_(GREEDY, max_tokens=9)}, 1)
    asked = []
    backend.hooks = StepHooks(another_pass=lambda: asked.append(1) or len(asked) % 3 != 0)
    try:
        cut, passes = _multi_step(backend, {"a": ids}, {"a": with_(GREEDY, max_tokens=9)}, 8)
    finally:
        backend.hooks = StepHooks()
    assert cut == whole
    assert passes == [3, 3, 2]   # two more passes, cut at the third ask; then the last two


def test_a_cut_short_reaches_the_passes_in_the_model_process(default_model_dir, tok):
    """Through the pipe: CutShort sent behind a multi-step request ends it after its first
    pass; one that finds no step running (sent before the request) is dropped, and the next
    request runs all its passes."""
    from common.settings import Settings
    from worker.model_executor import ModelExecutor

    ex = ModelExecutor(Settings.from_env(backend="llama_cpp", model="smollm2", max_num_seqs=2,
                                         max_model_len=256, torch_threads=1))
    ex.start()
    try:
        assert ex.multi_step
        ids = tok("The capital of France is")["input_ids"]
        ex.execute(StepRequest(prefill=[NewSequence("a", ids, with_(GREEDY, max_tokens=200))]))
        ex.submit(StepRequest(decode_seq_ids=["a"], num_steps=16))
        ex.cut_short()
        assert ex.wait().num_passes < 16
        ex.cut_short()   # no step in flight: stale
        res = ex.execute(StepRequest(decode_seq_ids=["a"], num_steps=4))
        assert res.num_passes == 4 and not res.errors
    finally:
        ex.stop()
