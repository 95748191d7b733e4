"""The llama.cpp backend driven step by step, in this process, on the default model's GGUF.

The same StepRequests the model executor sends: sequences join and leave the flat batch, their
slots are reused, sampling is llmq's own, and a bad sequence fails alone.
"""
from __future__ import annotations

import pytest

from common.protocol import SamplingParams
from factories import run_steps
from worker.messages import NewSequence, StepRequest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make llama-cpp)")

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def backend(default_model_dir):
    from common.settings import Settings
    from worker.backends import load_backend

    b = load_backend(Settings.from_env(backend="llama_cpp", model="smollm2", max_num_seqs=4,
                                       max_model_len=256, torch_threads=1))
    b.warm_up()
    return b


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def run(backend, prompts: dict[str, list[int]], n: int, params=GREEDY, join_at: dict | None = None
        ) -> dict[str, list[int]]:
    """Greedy-decodes n tokens for each prompt; join_at delays a prompt's prefill to a step."""
    return run_steps(backend.step, {sid: (ids, params) for sid, ids in prompts.items()}, n,
                     join_at)


def test_loads_the_gguf_and_describes_it(backend):
    info = backend.info
    assert info.path.endswith(".gguf") and info.dtype == "gguf-q4_1"
    assert info.vocab_size == 49152 and info.max_model_len == 256
    assert info.eos_token_ids, "EOS must be known, or nothing would ever stop"


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
    assert len(backend.free_slots) == 4 and not backend.slots


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
