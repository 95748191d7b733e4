"""The vLLM backend in its real home: the daemonic model process behind the ModelExecutor,
driven with the StepRequests the engine sends, on the tiny random model (64-wide heads).

It starts there at all (vLLM's engine core stays in the model process), reports its KV cache to
llmq's scheduler, samples seeded requests the same whatever shares the batch, honours stop ids,
min_tokens, logprobs, structured output and cache_salt, and frees what llmq frees.
"""
from __future__ import annotations

import sys

import pytest

from common.protocol import SamplingParams
from factories import run_steps
from worker.messages import NewSequence, StepRequest

pytest.importorskip("vllm", reason="vLLM is not installed (make vllm)")

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def vllm_settings(model: str, **kw):
    from common.settings import Settings

    return Settings.from_env(backend="vllm", model=model, max_num_seqs=4, max_model_len=512,
                             kv_cache_mb=1024, **kw)


@pytest.fixture(scope="module")
def executor(tiny_vllm_model_dir):
    from worker.model_executor import ModelExecutor

    ex = ModelExecutor(vllm_settings(tiny_vllm_model_dir), start_timeout_s=600)
    ex.start()
    yield ex
    ex.stop()


def run(ex, prompts: dict[str, tuple[list[int], SamplingParams]], n: int,
        join_at: dict | None = None) -> dict[str, list[int]]:
    return run_steps(ex.execute, prompts, n, join_at)


def test_starts_in_the_daemonic_model_process_and_reports_its_kv_cache(executor):
    # Before: vLLM's engine core was a child of the daemonic model process, which may not have
    # children, so the backend never started.
    info = executor.info
    assert info.device == "cpu" and info.dtype == "float32"   # float32 on CPU by default
    assert info.max_model_len == 512                           # LLMQ_MAX_MODEL_LEN honoured
    assert info.kv_cache_dtype == "float32" and info.kernels == "vLLM (cpu)"   # (the heartbeat's)
    # A re-added request starts its grammar, seeded draws and penalties again: the scheduler
    # leaves such sequences to vLLM's own preemption (WorkloadManager.set_exact_resume).
    assert info.resumes_exactly is False
    blocks, block_size = executor.kv_capacity
    assert blocks > 0 and block_size > 0   # llmq's scheduler admits no more than vLLM holds


def test_a_seeded_sequence_gets_the_same_tokens_whatever_shares_the_batch(executor):
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=64)
    prompts = {"a": ([1, 2, 3, 4, 5], seeded), "b": ([9, 8, 7], seeded),
               "c": ([5, 5, 5, 5], SamplingParams(temperature=1.0, max_tokens=64))}
    alone = run(executor, {"a": prompts["a"]}, 12)["a"]
    together = run(executor, prompts, 12, join_at={"a": 2, "c": 1})
    assert together["a"] == alone
    assert together["b"] != alone   # same seed, another prompt: its own text


def test_freed_sequences_leave_vllm_and_their_ids_can_come_back(executor):
    first = run(executor, {"x": ([4, 3, 2, 1], GREEDY)}, 5)["x"]
    # "x" was freed (aborted in vLLM): the id starts afresh, with the same greedy tokens.
    assert run(executor, {"x": ([4, 3, 2, 1], GREEDY)}, 5)["x"] == first


def test_stop_ids_wait_for_min_tokens_and_logprobs_come_with_tokens(executor):
    prompt = [11, 12, 13, 14]
    greedy = run(executor, {"g": (prompt, GREEDY)}, 3)["g"]
    stop = SamplingParams(temperature=0.0, max_tokens=64, min_tokens=2)
    res = executor.execute(StepRequest(prefill=[NewSequence("m", prompt, stop, 0,
                                                            (greedy[0],))]))
    assert res.token_ids["m"] != greedy[0]   # the stop id is masked before min_tokens
    executor.execute(StepRequest(free_seq_ids=["m"]))

    asked = SamplingParams(temperature=0.0, max_tokens=64, logprobs=2, prompt_logprobs=1)
    res = executor.execute(StepRequest(prefill=[NewSequence("l", prompt, asked)]))
    lp = res.logprobs["l"]
    assert res.token_ids["l"] == greedy[0] and lp.rank == 1 and lp.top_ids[0] == greedy[0]
    assert len(lp.top_ids) == len(lp.top_logprobs) == 2 and lp.logprob == lp.top_logprobs[0]
    assert len(res.prompt_logprobs["l"]) == len(prompt) - 1
    executor.execute(StepRequest(free_seq_ids=["l"]))


def test_prefix_cache_is_shared_only_within_a_cache_salt(executor):
    _blocks, block_size = executor.kv_capacity
    prompt = [100 + i % 50 for i in range(3 * block_size + 1)]

    def cached(sid: str, salt: str | None) -> int:
        p = SamplingParams(temperature=0.0, max_tokens=4, cache_salt=salt)
        res = executor.execute(StepRequest(prefill=[NewSequence(sid, prompt, p)]))
        executor.execute(StepRequest(free_seq_ids=[sid]))
        return res.cached_tokens[sid]

    assert cached("s1", "alice") == 0
    assert cached("s2", "alice") >= 2 * block_size
    assert cached("s3", "bob") == 0


def test_structured_and_free_sequences_share_a_step(executor):
    digits = SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                            structured={"type": "regex", "value": "[0-9]{4}"})
    out = run(executor, {"j": ([1, 2, 3], digits), "k": ([1, 2, 3], GREEDY)}, 4)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(executor.info.path)
    text = tok.decode(out["j"], skip_special_tokens=True)
    assert text and len(text) <= 4 and text.strip("0123456789") == "", text


def test_a_model_vllm_cannot_load_is_a_clear_error_at_start(tmp_path):
    from worker.model_executor import ModelExecutor, ModelWorkerDied

    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    ex = ModelExecutor(vllm_settings(str(tmp_path)), start_timeout_s=300)
    try:
        with pytest.raises(ModelWorkerDied, match="vLLM could not load"):
            ex.start()
    finally:
        ex.stop()


def test_a_kv_cache_dtype_vllm_would_not_honour_is_a_clear_error_at_start(
        tiny_vllm_model_dir):
    """LLMQ_KV_CACHE_DTYPE reaches vLLM. Before, it was not passed at all; passed as it is, vLLM
    0.32's CPU build takes float16 under a float32 model and answers gibberish (measured with
    the default model: 24 greedy tokens, none the same). So vLLM gets the model's dtype, or
    the worker an error that says why."""
    from worker.model_executor import ModelExecutor, ModelWorkerDied

    ex = ModelExecutor(vllm_settings(tiny_vllm_model_dir, kv_cache_dtype="float16"),
                       start_timeout_s=300)
    try:
        with pytest.raises(ModelWorkerDied, match="vLLM keeps its KV cache in the model's dtype"):
            ex.start()
    finally:
        ex.stop()


def test_missing_vllm_is_a_clear_error(monkeypatch, tiny_vllm_model_dir):
    from worker.model.backend import BackendUnavailable
    from worker.model.backend import load_backend

    monkeypatch.setitem(sys.modules, "vllm", None)   # as if it were not installed
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")   # restored after the test
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    with pytest.raises(BackendUnavailable, match="make vllm"):
        load_backend(vllm_settings(tiny_vllm_model_dir))
