"""The engine over the real transformers backend in this process (InProcessExecutor): the
tiny random model, its tokenizer, fakeredis. What the model samples reaches the record as
text, through the same step protocol the model process speaks."""
from __future__ import annotations

import fakeredis
import pytest

from common.protocol import SamplingParams, SequenceRequest
from common.settings import Settings
from common.store import SequenceStore

pytest.importorskip("lupa", reason="fakeredis needs lupa to run the store's Lua scripts")


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
