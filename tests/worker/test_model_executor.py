"""ModelExecutor: the model worker in its own (spawned) process, its steps, its death and restart.

Starting the process (import torch + transformers, load the tiny model, warm up) is the slow
part, so one executor is shared by the module: it is started once, killed and restarted once.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from common.protocol import SamplingParams
from common.settings import Settings
from factories import make_prompts, run_solo
from worker.messages import NewSequence, StepRequest
from worker.model_executor import ModelExecutor, ModelWorkerDied
from worker.model.transformers.backend import TransformersBackend

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = {"a": make_prompts(1, lengths=[9], seed=21)[0], "b": make_prompts(1, lengths=[4], seed=22)[0]}
N = 5


@pytest.fixture(scope="module")
def executor(tiny_model_dir):
    ex = ModelExecutor(Settings.from_env(model=tiny_model_dir, device="cpu", dtype="float32",
                                         max_num_seqs=4), start_timeout_s=300)
    ex.launch()   # as a worker starts it: spawned first, waited for after its own start-up
    spawned = ex.pid
    assert spawned and ex.info is None and ex.num_starts == 0
    ex.start()
    assert ex.pid == spawned   # start() waited for the launched process, it spawned no other
    yield ex
    ex.stop()


@pytest.fixture
def running(executor):
    """The shared executor, started again if an earlier test stopped it."""
    if executor.pid is None:
        executor.start()
    return executor


@pytest.fixture(scope="module")
def expected(tiny_model):
    """Each prompt's greedy tokens from an in-process worker: what the process must answer."""
    model, info = tiny_model
    return {sid: run_solo(TransformersBackend(model, info, 1), ids, N) for sid, ids in PROMPTS.items()}


def generate(ex: ModelExecutor) -> dict[str, list[int]]:
    """Prefill both prompts (one joins a step later, while the other decodes), decode, free."""
    out = {"a": [], "b": []}
    res = ex.execute(StepRequest(prefill=[NewSequence("a", PROMPTS["a"], GREEDY)]))
    out["a"].append(res.token_ids["a"])
    res = ex.execute(StepRequest(decode_seq_ids=["a"],
                                 prefill=[NewSequence("b", PROMPTS["b"], GREEDY)]))
    for sid, tok in res.token_ids.items():
        out[sid].append(tok)
    while len(out["b"]) < N:
        running = [s for s in ("a", "b") if len(out[s]) < N]
        done = [s for s in ("a", "b") if len(out[s]) >= N]
        res = ex.execute(StepRequest(decode_seq_ids=running, free_seq_ids=done))
        assert not res.errors and set(res.token_ids) == set(running)
        for sid, tok in res.token_ids.items():
            out[sid].append(tok)
    res = ex.execute(StepRequest(free_seq_ids=["b"]))
    assert res.token_ids == {}
    return out


def test_start_and_execute_steps(running, expected, tiny_model_dir):
    ex = running
    assert ex.num_starts >= 1 and ex.pid and ex.pid != os.getpid()
    assert ex.info.path == tiny_model_dir and ex.info.device == "cpu"
    assert ex.info.vocab_size == 49152 and ex.info.eos_token_ids
    assert generate(ex) == expected
    assert generate(ex) == expected   # the freed rows left nothing behind


def test_newcomers_first_tokens_come_ahead_of_the_decode(running, expected):
    """A step that prefills and decodes answers twice: the newcomer's first token, then the
    running batch's; a prefill-only or decode-only step answers once."""
    ex = running
    ex.submit(StepRequest(prefill=[NewSequence("a", PROMPTS["a"], GREEDY)]))
    whole = ex.wait()
    assert not whole.partial and whole.token_ids == {"a": expected["a"][0]}
    ex.submit(StepRequest(decode_seq_ids=["a"], prefill=[NewSequence("b", PROMPTS["b"], GREEDY)]))
    first = ex.wait()
    assert first.partial and first.token_ids == {"b": expected["b"][0]}
    rest = ex.wait()
    assert not rest.partial and rest.token_ids == {"a": expected["a"][1]}
    # The newcomer joined the batch's cache after the decode: it decodes with the rest now.
    res = ex.execute(StepRequest(decode_seq_ids=["a", "b"]))
    assert res.token_ids == {"a": expected["a"][2], "b": expected["b"][1]}
    ex.execute(StepRequest(free_seq_ids=["a", "b"]))


def test_an_interjection_is_answered_apart_from_the_step_in_flight(running, expected):
    """Issue 16: sent while a step runs, a newcomer's prefill is answered on its own
    (`interjected`), between the step's layers or after it, and joins the batch's cache."""
    from worker.engine_core import Bell

    ex = running
    assert ex.interjects   # the transformers backend runs them between its layers
    bell = Bell()
    bell.ring()
    assert ex.wait(bell) is None   # nothing in flight: the bell alone wakes the wait
    ex.execute(StepRequest(prefill=[NewSequence("a", PROMPTS["a"], GREEDY)]))
    ex.submit(StepRequest(decode_seq_ids=["a"]))
    ex.submit(StepRequest(prefill=[NewSequence("b", PROMPTS["b"], GREEDY)], interject=True))
    got = [ex.wait(), ex.wait()]
    [side] = [r for r in got if r.interjected]
    [step] = [r for r in got if not r.interjected]
    assert side.token_ids == {"b": expected["b"][0]} and not side.partial
    assert step.token_ids == {"a": expected["a"][1]}
    assert ex._in_flight == 0
    res = ex.execute(StepRequest(decode_seq_ids=["a", "b"]))
    assert res.token_ids == {"a": expected["a"][2], "b": expected["b"][1]}
    ex.execute(StepRequest(free_seq_ids=["a", "b"]))


def test_killed_worker_raises_then_restarts(running, expected):
    ex = running
    starts = ex.num_starts
    res = ex.execute(StepRequest(prefill=[NewSequence("x", [7, 8, 9], GREEDY)]))
    assert set(res.token_ids) == {"x"}
    old_pid = ex.pid
    os.kill(old_pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(ModelWorkerDied):
        ex.execute(StepRequest(decode_seq_ids=["x"]))
    assert time.monotonic() - t0 < 5.0
    # The executor stays broken until restarted: a second call fails the same way.
    with pytest.raises(ModelWorkerDied):
        ex.wait()

    ex.restart()
    assert ex.num_starts == starts + 1 == 2
    assert ex.pid not in (None, old_pid)
    # A fresh process: the old sequence's cache is gone, the model answers as before.
    assert generate(ex) == expected

    pid = ex.pid
    ex.stop()
    assert ex.pid is None
    assert ex.exitcode == 0                   # it took Shutdown and left, it was not killed
    with pytest.raises(ProcessLookupError):   # exited and reaped, not left running
        os.kill(pid, 0)
