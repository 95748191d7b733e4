"""The engine over the real transformers backend in this process (InProcessExecutor): the
tiny random model, its tokenizer, fakeredis. What the model samples reaches the record as
text, through the same step protocol the model process speaks."""
from __future__ import annotations

import fakeredis
import pytest

from common.protocol import SamplingParams, SequenceRequest
from common.settings import Settings
from common.store import SequenceStore



@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from worker.engine_core import EngineCore
    from worker.inprocess_executor import InProcessExecutor
    from worker.model_manager import ModelManager

    settings = Settings(model=tiny_model_dir, device="cpu", dtype="float32", kv_cache_mb=16,
                        max_num_seqs=8)
    executor = InProcessExecutor(settings)
    executor.start()
    store = SequenceStore(fakeredis.FakeRedis(decode_responses=True))
    yield EngineCore("w1", settings, store, executor, ModelManager(tiny_model_dir).load_tokenizer())
    executor.stop()


def run(engine, seqs, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        if all(s.done.is_set() for s in seqs) and not engine.output.has_pending:
            return
        engine.step()
    raise AssertionError("not finished")


def test_greedy_copies_of_a_prompt_get_the_same_text_as_their_tokens_decode(engine):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.store.create([SequenceRequest(seq_id=i, prompt="The capital of France is",
                                         params=params) for i in ("a", "b")])
    a = engine.admit("a")
    engine.step()                 # b joins a running batch (its first token ahead of the decode)
    b = engine.admit("b")
    run(engine, [a, b])
    ja, jb = engine.store.get_job("a"), engine.store.get_job("b")
    assert (ja["status"], ja["finish_reason"], ja["usage"]["completion_tokens"]) == (
        "succeeded", "length", 6)
    assert a.output_token_ids == b.output_token_ids
    assert ja["text"] == jb["text"] == engine.tokenizer.decode(a.output_token_ids,
                                                               skip_special_tokens=True)
    assert engine.executor.num_starts == 1 and engine.executor.pid is None



def test_sequences_that_come_and_go_leave_nothing_behind_in_the_model(tiny_model_dir):
    """Per-sequence state lives only while its sequence does: after a cancel mid-prefill (a
    chunked prompt), mid-decode and while waiting, preemptions by a full KV cache, and ends on
    a token, every per-sequence container of the engine and the model worker is empty and
    every KV block is free or parked in the prefix cache (the soak's memory check, in one
    process and without timing)."""
    import random

    from worker.engine_core import EngineCore
    from worker.inprocess_executor import InProcessExecutor
    from worker.model_manager import ModelManager

    # 1 MiB of KV is 256 blocks of 8 tokens with the tiny model in float32 (the model's
    # dtype; a float16 cache would hold twice as many): six 300-token prompts fit beside a
    # short one, and outgrow the cache as they decode (preemption).
    settings = Settings(model=tiny_model_dir, device="cpu", dtype="float32", kv_cache_mb=1,
                        kv_cache_dtype="model", prefix_cache_mb=1, max_num_seqs=8)
    executor = InProcessExecutor(settings)
    executor.start()
    store = SequenceStore(fakeredis.FakeRedis(decode_responses=True))
    engine = EngineCore("w1", settings, store, executor,
                        ModelManager(tiny_model_dir).load_tokenizer())
    engine.fit_to_model()   # as start() does
    worker, cache = executor.backend, executor.backend.cache
    rng = random.Random(0)

    def admit(sid: str, prompt_len: int, max_tokens: int, prompt_logprobs: int | None = None):
        store.create([SequenceRequest(
            seq_id=sid, prompt_token_ids=[rng.randint(3, 900) for _ in range(prompt_len)],
            params=SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                  temperature=rng.choice([0.0, 0.8]),
                                  prompt_logprobs=prompt_logprobs))])
        return engine.admit(sid)

    def steps(n: int) -> None:
        for _ in range(n):
            engine.step()

    seqs = [admit("short", 5, 12)]
    steps(2)
    seqs.append(admit("chunked", 300, 10, 1))   # beside a decode: 32 tokens a step, scored
    steps(3)
    assert "chunked" in worker.prefilling and worker.scored["chunked"]
    store.request_cancel("chunked")
    seqs.append(admit("decoding", 5, 200))
    steps(3)
    assert "decoding" in worker.states
    store.request_cancel("decoding")
    seqs += [admit(f"long{i}", 300, 60) for i in range(8)]   # six fit; two wait
    steps(1)
    store.request_cancel("long7")
    run(engine, seqs, max_steps=400)
    engine.step()   # hands the last frees to the model worker

    statuses = {s.seq_id: store.get_job(s.seq_id)["status"] for s in seqs}
    assert [k for k, v in statuses.items() if v == "cancelled"] == ["chunked", "decoding",
                                                                    "long7"]
    assert engine.workload_manager.stats.num_preemptions > 0
    assert (worker.states, worker.prefilling, worker.scored) == ({}, {}, {})
    assert (cache.tables, cache.lengths, cache._slots) == ({}, {}, {})
    assert len(cache.pool.free) + cache.prefix.num_parked == cache.num_blocks
    assert not any(cache.pool.refs)
    assert engine.output.admitted == {} and not engine.output.pending
    assert not (engine.workload_manager.waiting or engine.workload_manager.running
                or engine.workload_manager._prompt_left)
    executor.stop()


def test_newcomers_answered_pass_by_pass_each_get_their_tokens(tiny_model_dir):
    """A wave of newcomers beside a running sequence is prefilled in several passes
    (LLMQ_PREFILL_PASS_TOKENS), each pass's first tokens a partial result of its own: the
    engine takes every partial, then the decode's tokens, and nobody loses a token."""
    from worker.engine_core import EngineCore
    from worker.inprocess_executor import InProcessExecutor
    from worker.model_manager import ModelManager

    settings = Settings(model=tiny_model_dir, device="cpu", dtype="float32", kv_cache_mb=16,
                        max_num_seqs=8, prefill_pass_tokens=8)
    executor = InProcessExecutor(settings)
    executor.start()
    store = SequenceStore(fakeredis.FakeRedis(decode_responses=True))
    engine = EngineCore("w1", settings, store, executor,
                        ModelManager(tiny_model_dir).load_tokenizer())
    engine.fit_to_model()
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    ids = ["run", "n1", "n2", "n3", "n4"]
    store.create([SequenceRequest(seq_id=i, prompt="The capital of France is", params=params)
                  for i in ids])
    partials = []
    step = executor.backend.step
    executor.backend.step = lambda req, early=None: step(
        req, early=None if early is None else (lambda r: (partials.append(r), early(r))))
    run_seq = engine.admit("run")
    engine.step()
    wave = [engine.admit(i) for i in ids[1:]]
    engine.step()   # the wave's passes, then the running sequence's decode
    assert len(partials) >= 2   # the wave took several passes, each answered apart
    assert run_seq.num_output_tokens == 2 and all(s.num_output_tokens == 1 for s in wave)
    run(engine, [run_seq, *wave])
    texts = {store.get_job(i)["text"] for i in ids}
    assert len(texts) == 1 and all(len(s.output_token_ids) == 5 for s in [run_seq, *wave])
    executor.stop()


def test_a_scored_prompt_beside_a_decode_goes_in_chunks_and_keeps_every_logprob(engine):
    """Through the engine: a 300-token prompt with prompt_logprobs beside a decoding sequence
    is computed in chunks (LLMQ_LONG_PREFILL_CHUNK tokens a step), and its job keeps a logprob
    for every prompt token, those of the same prompt scored alone (in one step)."""
    import random

    rng = random.Random(3)
    prompt = [rng.randint(3, 900) for _ in range(300)]
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    engine.store.create([
        SequenceRequest(seq_id="dec", prompt="Hello", params=SamplingParams(
            max_tokens=30, temperature=0.0, ignore_eos=True)),
        SequenceRequest(seq_id="lp", prompt_token_ids=prompt, params=scored),
        SequenceRequest(seq_id="alone", prompt_token_ids=prompt, params=scored)])
    backend = engine.executor.backend
    chunks, step = [], backend.step
    backend.step = lambda req, early=None: (chunks.append(req.chunks.get("lp")),
                                            step(req, early))[1]
    try:
        dec = engine.admit("dec")
        engine.step()
        lp = engine.admit("lp")
        run(engine, [lp])
        cap = engine.settings.long_prefill_chunk
        sizes = [c for c in chunks if c]
        assert len(sizes) > 1 and max(sizes) <= cap and sum(sizes) == len(prompt)
        alone = engine.admit("alone")
        run(engine, [alone, dec])
    finally:
        backend.step = step
    got, ref = (engine.store.get_job(s)["prompt_logprobs"] for s in ("lp", "alone"))
    assert len(got) == len(ref) == len(prompt) and got[0]["logprob"] is None
    for a, b in zip(got[1:], ref[1:]):
        assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 1e-4
        assert [t["token_id"] for t in a["top_logprobs"]] == [t["token_id"]
                                                             for t in b["top_logprobs"]]
