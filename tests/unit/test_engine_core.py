"""EngineCore in one process: a scripted backend behind the in-process executor, fakeredis for
the store. Every end is written once, whatever ends it; cancels, deadlines, a record restarted
on the same worker, a model crash mid-step and the hand-back at drain."""
from __future__ import annotations

import threading
import time

import fakeredis
import pytest
from kombu.exceptions import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError

from common import metrics
from common.protocol import GENERATE_TASK, FinishReason, SamplingParams, SequenceRequest
from common.keys import Keys
from common.store import SequenceStore
from worker.model.backend import StepHooks

from bench.stack import wait_until

from .factories import EOS, ScriptedBackend, make_engine



@pytest.fixture
def store():
    return SequenceStore(fakeredis.FakeRedis(decode_responses=True))


def submit(store, seq_id: str = "s", prompt=(3, 4, 5), deadline=None, **params) -> None:
    store.create([SequenceRequest(seq_id=seq_id, prompt_token_ids=list(prompt),
                                  params=SamplingParams(**params), deadline=deadline)])


def run(engine, seqs, max_steps: int = 200) -> None:
    """Steps the engine (no loop thread) until the sequences have ended and all is written."""
    for _ in range(max_steps):
        if all(s.done.is_set() for s in seqs) and not engine.output.has_pending:
            return
        engine.step()
    raise AssertionError(f"not finished after {max_steps} steps")


def events(store, seq_id: str = "s") -> list[tuple[str, dict]]:
    return [(k, d) for _i, k, d in store.read_events(seq_id)]


def assert_ended_once(store, engine, seq, reason: FinishReason) -> None:
    """One done event, the record's final status, one count in the metrics, and nothing more
    written by later steps."""
    assert seq.done.is_set() and seq.is_closed and seq.finish_reason is reason
    kinds = [k for k, _d in events(store, seq.seq_id)]
    assert kinds.count("done") == 1 and kinds[-1] == "done"
    job = store.get_job(seq.seq_id)
    assert (job["status"], job["finish_reason"]) == (reason.status.value, reason.value)
    assert metrics.read_snapshot(store.r)["success"].get(reason.value) == 1
    for _ in range(3):
        engine.step()
    assert [k for k, _d in events(store, seq.seq_id)] == kinds
    assert seq.seq_id not in engine.output.admitted


@pytest.mark.parametrize("params, script, reason, text", [
    ({}, [5, EOS], FinishReason.STOP, " w5"),                                   # EOS
    ({"stop_token_ids": [9]}, [5, 9], FinishReason.STOP, " w5"),                # a stop token
    ({"stop": [" w6"]}, [5, 6, 8], FinishReason.STOP, " w5"),                   # a stop string
    ({"max_tokens": 3}, [5], FinishReason.LENGTH, " w5 w7 w7"),                 # the length
    ({"max_tokens": 2, "stop": [" w6"]}, [5, 6], FinishReason.STOP, " w5"),     # both at once
    ({"max_tokens": 0, "prompt_logprobs": 1}, [5], FinishReason.LENGTH, ""),    # echo only
])
def test_each_end_on_a_token_is_written_once(store, params, script, reason, text):
    engine = make_engine(store, ScriptedBackend({"s": script}))
    submit(store, **params)
    seq = engine.admit("s")
    run(engine, [seq])
    assert_ended_once(store, engine, seq, reason)
    assert store.get_job("s")["text"] == text
    streamed = "".join(d["text"] for k, d in events(store) if k == "token")
    assert streamed == text   # the pieces add up to the text; no stop string leaks


def test_a_stop_string_waits_for_min_tokens_as_stop_tokens_do(store):
    engine = make_engine(store, ScriptedBackend({"s": [5, 6, 7, 5, 8]}))
    submit(store, min_tokens=3, stop=[" w5"], max_tokens=10)
    seq = engine.admit("s")
    run(engine, [seq])
    job = store.get_job("s")
    assert job["text"] == " w5 w6 w7" and job["finish_reason"] == "stop"
    assert job["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("end", ["cancel", "deadline"])
def test_text_held_back_for_a_stop_string_is_kept_when_the_sequence_is_stopped(store, end):
    """" w5 w6" may begin the stop string " w5 w6 w9", so it is held back; a cancel or a
    deadline then ended the sequence with text "" though it had made those tokens."""
    engine = make_engine(store, ScriptedBackend({"s": [5, 6, 8, 8, 8, 8]}))
    submit(store, stop=[" w5 w6 w9"], max_tokens=100)
    seq = engine.admit("s")
    while seq.num_output_tokens < 2:
        engine.step()
    assert seq.pending_text == " w5 w6"
    if end == "cancel":
        store.request_cancel("s")
    else:
        seq.deadline = 1.0
    run(engine, [seq])
    job = store.get_job("s")
    made = "".join(f" w{t}" for t in seq.output_token_ids)
    assert job["text"] == made and job["usage"]["completion_tokens"] == len(seq.output_token_ids)
    [done] = [d for k, d in events(store) if k == "done"]
    streamed = "".join(d["text"] for k, d in events(store) if k == "token")
    assert done["text"] == made and made.startswith(streamed)


def test_a_sequence_the_model_fails_ends_once_with_its_error(store):
    engine = make_engine(store, ScriptedBackend(errors={"bad": "boom"}))
    submit(store, "bad")
    submit(store, "good", max_tokens=2)
    bad, good = engine.admit("bad"), engine.admit("good")
    run(engine, [bad, good])
    assert_ended_once(store, engine, bad, FinishReason.ERROR)
    assert store.get_job("bad")["error"] == {"message": "boom"}
    assert store.get_job("good")["status"] == "succeeded"   # the batch went on without it


def test_cancel_mid_run_keeps_the_text_and_frees_the_model(store):
    backend = ScriptedBackend()
    engine = make_engine(store, backend)
    submit(store, max_tokens=100)
    seq = engine.admit("s")
    for _ in range(4):
        engine.step()
    store.request_cancel("s")
    run(engine, [seq])
    assert_ended_once(store, engine, seq, FinishReason.CANCELLED)
    job = store.get_job("s")
    assert 0 < job["usage"]["completion_tokens"] < 100
    assert job["text"] == " w7" * job["usage"]["completion_tokens"]
    assert any("s" in req.free_seq_ids for req in backend.requests)   # its KV cache is freed
    assert store.cancelled_among(["s"]) == set()   # the flag goes with the end


def test_deadline_ends_a_running_sequence_with_timeout(store):
    engine = make_engine(store)
    submit(store, max_tokens=100, deadline=time.time() + 3600)
    seq = engine.admit("s")
    for _ in range(3):
        engine.step()
    seq.deadline = time.time() - 1   # (the clock moved past it)
    run(engine, [seq])
    assert_ended_once(store, engine, seq, FinishReason.TIMEOUT)
    assert store.get_job("s")["status"] == "cancelled"


def _multi_step_run(params: dict, script: list[int], multi: bool):
    """One sequence run to its end by an engine whose backend runs multi-step (5 ms passes,
    20 ms window: 4 passes a step) or not. Returns its token events' texts, its record and the
    backend's requests."""
    store = SequenceStore(fakeredis.FakeRedis(decode_responses=True))
    backend = ScriptedBackend({"s": script}, multi_step=multi, pass_s=0.005)
    engine = make_engine(store, backend, multi_step_window_s=0.02)
    submit(store, **params)
    seq = engine.admit("s")
    run(engine, [seq])
    assert_ended_once(store, engine, seq, seq.finish_reason)
    return [d["text"] for k, d in events(store) if k == "token"], store.get_job("s"), \
        backend.requests


@pytest.mark.parametrize("params, script", [
    ({"max_tokens": 11}, []),                                            # the length
    ({"max_tokens": 30}, [5, 6, 8, 9, 10, 11, 12, EOS]),                 # EOS mid-burst
    ({"max_tokens": 30, "stop": [" w11"]}, [5, 6, 8, 9, 10, 11, 12, 13]),   # a stop string
    ({"max_tokens": 30, "min_tokens": 6, "stop_token_ids": [9]}, [9] * 8),   # a stop token, at
                                                                        # min_tokens
])
def test_multi_step_streams_every_token_and_ends_where_one_pass_a_step_does(params, script):
    """Passes run back to back in the model process (multi-step) stream the same token events,
    one per token, and end the sequence on the same token as one pass a step, whether the end
    falls inside a step's passes or at their edge; tokens decoded past the end are dropped."""
    one_texts, one_job, one_reqs = _multi_step_run(params, script, multi=False)
    texts, job, reqs = _multi_step_run(params, script, multi=True)
    assert texts == one_texts
    for key in ("text", "finish_reason", "usage", "status"):
        assert job[key] == one_job[key]
    assert max(r.num_steps for r in reqs) == 4 and len(reqs) < len(one_reqs)
    assert max(r.num_steps for r in one_reqs) == 1   # a backend that cannot is asked for one


def test_a_test_step_delay_runs_one_pass_a_step(store):
    """LLMQ_TEST_STEP_DELAY paces the engine for tests that act while work runs: N tokens must
    still take N delayed steps, so the engine asks a multi-step backend for one pass a step."""
    from common.settings import Settings
    from common.test_hooks import HarnessHooks
    from worker.engine_core import EngineCore
    from worker.inprocess_executor import InProcessExecutor

    from .factories import WordTokenizer

    backend = ScriptedBackend({}, multi_step=True, pass_s=0.001)
    executor = InProcessExecutor(backend_factory=lambda: backend)
    executor.start()
    engine = EngineCore("w1", Settings(multi_step_window_s=0.05), store, executor,
                        WordTokenizer(), hooks=HarnessHooks(step_delay_s=0.001))
    engine.fit_to_model()
    submit(store, "s", max_tokens=8)
    seq = engine.admit("s")
    run(engine, [seq])
    assert seq.num_output_tokens == 8 and {r.num_steps for r in backend.requests} == {1}


class RoundTrips:
    """Counts the store's round trips to Redis: a command sent alone, or a pipeline."""

    def __init__(self, store, monkeypatch):
        self.n = 0
        client = store.r
        plain = client.execute_command

        def command(*args, **kw):
            self.n += 1
            return plain(*args, **kw)

        pipeline = client.pipeline

        def piped(*args, **kw):
            pipe = pipeline(*args, **kw)
            execute = pipe.execute

            def run(*a, **k):
                self.n += 1
                return execute(*a, **k)

            pipe.execute = run
            return pipe

        monkeypatch.setattr(client, "execute_command", command)
        monkeypatch.setattr(client, "pipeline", piped)


@pytest.mark.parametrize("fenced", [True, False])
def test_a_decode_step_writes_its_tokens_and_looks_for_cancels_in_one_round_trip(
        store, monkeypatch, fenced):
    """At one sequence the engine's Redis work is beside every token (on the cores the model
    uses): the step's token event and the look for cancels go in one round trip."""
    engine = make_engine(store)
    submit(store, max_tokens=100)
    seq = engine.admit("s")
    if not fenced:
        seq.attempt = None   # (an unfenced write: the plain pipeline path)
    for _ in range(3):
        engine.step()
    trips = RoundTrips(store, monkeypatch)
    for _ in range(4):
        engine.step()
    assert trips.n == 4
    store.request_cancel("s")   # the folded look still sees a cancel at the next step
    engine.step()
    engine.step()
    assert seq.finish_reason is FinishReason.CANCELLED
    run(engine, [seq])
    assert_ended_once(store, engine, seq, FinishReason.CANCELLED)


def taken_for_dead(store, worker: str = "w1") -> list[str]:
    """A peer's reaper takes the worker's sequences back: queued again, each with a reset."""
    store.r.zadd(Keys.workers, {worker: 0})   # its last beat, long ago
    return store.reclaim(worker, stale_s=15)


def test_restart_of_a_record_on_the_same_worker_streams_only_the_new_copy(store):
    """Bug 1's seam: this worker was taken for dead and the record restarted here while the old
    copy still runs, its last token not yet published. The old copy stops, writes nothing;
    after the reset, readers get exactly the new copy's tokens."""
    backend = ScriptedBackend({"s": [5, 6, 8]})
    engine = make_engine(store, backend)
    submit(store, max_tokens=3)
    old = engine.admit("s")
    engine.step()                       # " w5" sampled
    engine.step()                       # " w5" published, " w6" sampled (pending)
    assert engine.output.has_pending
    assert taken_for_dead(store) == ["s"]
    new = engine.admit("s")             # attempt 2, same worker name
    run(engine, [old, new])
    assert old.done.is_set() and old.is_closed and old.finish_reason is FinishReason.CANCELLED
    kinds = [k for k, _d in events(store)]
    assert kinds == ["token", "reset", "token", "token", "token", "done"]
    assert [d["text"] for k, d in events(store)[2:5]] == [" w5", " w6", " w8"]
    rec = store.get_record("s")
    assert (rec["text"], rec["completion_tokens"], rec["attempts"]) == (" w5 w6 w8", "3", "2")
    assert_ended_once(store, engine, new, FinishReason.LENGTH)


def test_a_second_message_for_the_sequence_this_engine_runs_is_skipped(store):
    """A stuck worker's held message comes back twice: the reaper's re-send, and that worker's
    own hand-back. When both reach this worker, the second must not restart the copy running
    here (a reset, its tokens thrown away, attempts + 1): it is skipped."""
    sent = []
    engine = make_engine(store, ScriptedBackend({"s": [5, 6, 8]}),
                         requeue=lambda seq_id, priority=None: sent.append(seq_id))
    submit(store, max_tokens=3)
    store.hold("stuck", "s")                 # the stuck worker received it
    store.r.zadd(Keys.workers, {"stuck": 0})   # and its heartbeat stopped long ago
    engine.liveness.reap_dead_workers()      # message 1: the reaper's re-send
    assert sent == ["s"]                     # (message 2: the stuck worker hands it back)
    seq = engine.admit("s")
    engine.step()
    engine.step()                            # " w5" published
    assert engine.admit("s") is None
    run(engine, [seq])
    assert [k for k, _d in events(store)] == ["token", "token", "token", "done"]
    assert store.get_record("s")["attempts"] == "1"
    assert_ended_once(store, engine, seq, FinishReason.LENGTH)


def test_a_second_message_arriving_while_the_first_is_admitted_is_skipped(store):
    """Two task threads receive the same id at once: the second read the admitted map before
    the first had put its copy there, started the record again (a reset, attempts 2) and both
    copies ran."""
    engine = make_engine(store, ScriptedBackend({"s": [5, 6, 8]}))
    submit(store, max_tokens=3)
    inside, release, calls = threading.Event(), threading.Event(), []
    process = engine.inputs.process

    def slow_first(seq_id, attempt=None):
        calls.append(seq_id)
        if len(calls) == 1:   # the first thread, between its start and its admission
            seq = process(seq_id, attempt)
            inside.set()
            release.wait(5)
            return seq
        return process(seq_id, attempt)

    engine.inputs.process = slow_first
    first = []
    t = threading.Thread(target=lambda: first.append(engine.admit("s")))
    t.start()
    assert inside.wait(5)
    assert engine.admit("s") is None   # the second message
    release.set()
    t.join(5)
    assert calls == ["s"] and first[0] is not None
    run(engine, first)
    assert store.get_record("s")["attempts"] == "1"
    assert_ended_once(store, engine, first[0], FinishReason.LENGTH)


def test_a_model_crash_mid_step_resumes_from_the_tokens_made(store):
    script = {"s": [5, 6, 8, 9]}
    engine = make_engine(store, ScriptedBackend(script, crash_at=(3,)))
    submit(store, max_tokens=4)
    seq = engine.admit("s")
    run(engine, [seq])
    assert engine.executor.num_starts == 2
    assert_ended_once(store, engine, seq, FinishReason.LENGTH)
    assert store.get_job("s")["text"] == " w5 w6 w8 w9"   # as without the crash
    assert "reset" not in [k for k, _d in events(store)]  # readers see no restart
    assert seq.num_restarts == 1


def test_a_sequence_that_crashes_the_model_every_time_fails_alone(store):
    engine = make_engine(store, ScriptedBackend(crash_at=tuple(range(1, 20))))
    submit(store)
    seq = engine.admit("s")
    run(engine, [seq])
    assert_ended_once(store, engine, seq, FinishReason.ERROR)
    assert "crashed 3 times" in store.get_job("s")["error"]["message"]


def test_the_restarted_model_process_sizes_the_scheduler_again(store):
    """The new process sizes its KV cache from the memory free when it starts: the scheduler
    kept admitting against the old size, the steps failed with KVCacheFull, and the whole
    batch ended with "crashed 3 times"."""
    first = ScriptedBackend(crash_at=(2,))
    first.kv_capacity = (64, 4)
    engine = make_engine(store, first)
    assert engine.workload_manager.kv_budget.num_blocks == 64
    smaller = ScriptedBackend()
    smaller.kv_capacity = (16, 4)
    engine.executor._factory = lambda: smaller
    submit(store, max_tokens=4)
    seq = engine.admit("s")
    run(engine, [seq])
    assert engine.executor.num_starts == 2 and engine.workload_manager.kv_budget.num_blocks == 16
    assert_ended_once(store, engine, seq, FinishReason.LENGTH)


def test_a_model_that_cannot_start_again_lets_the_heartbeat_stop(store):
    """Each restart try counted as a step beginning: a model that could never start again (its
    files gone, the GPU lost) kept the worker advancing for ever, and its batch, and every
    newcomer it admitted, waited here instead of on a peer. Now the tries get LLMQ_MAX_STEP in
    all."""
    # max_step_s past the 1 s between tries: each try restarted the step's clock
    engine = make_engine(store, ScriptedBackend(crash_at=(2,)), max_step_s=2.0,
                         worker_stale_s=2.0)

    def cannot_start():
        raise RuntimeError("CUDA error: no CUDA-capable device is detected")
    engine.executor._factory = cannot_start
    submit(store)
    engine.admit("s")
    stepping = threading.Thread(target=lambda: [engine.step() for _ in range(3)], daemon=True)
    stepping.start()
    try:
        wait_until(lambda: engine.executor.num_starts == 1 and not engine.liveness.advancing(),
                   30, "the heartbeat to stop while no model can start")
        submit(store, "late")
        assert engine.admit("late") is None             # handed back, for a peer
    finally:
        engine._stop.set()
        stepping.join(10)


def test_newcomers_first_tokens_ahead_of_the_decode_end_once(store):
    """A newcomer joining a running batch gets its token from the partial result; both
    sequences still end once each."""
    engine = make_engine(store, ScriptedBackend({"b": [EOS]}))
    submit(store, "a", max_tokens=5)
    a = engine.admit("a")
    engine.step()
    submit(store, "b")
    b = engine.admit("b")
    run(engine, [a, b])
    assert [k for k, _d in events(store, "b")] == ["token", "done"]
    assert store.get_job("a")["usage"]["completion_tokens"] == 5
    assert store.get_job("b")["finish_reason"] == "stop"


class SignallingBackend(ScriptedBackend):
    """Sets `running` once a few steps have run: the sequence is mid-generation."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.running = threading.Event()

    def step(self, req, early=None):
        res = super().step(req, early)
        if self.num_steps >= 3:
            self.running.set()
        return res


def test_drain_hands_the_batch_back_and_new_work_goes_back_too(store):
    requeued = []
    backend = SignallingBackend(max_model_len=1_000_000)
    engine = make_engine(store, backend, lambda seq_id, priority=None: requeued.append(seq_id))
    submit(store, max_tokens=900_000)
    engine.start()
    try:
        result = {}
        task = threading.Thread(target=lambda: result.update(engine.run_sequence("s")))
        task.start()
        assert backend.running.wait(30)
        engine.drain(grace_s=0)
        task.join(30)
        assert not task.is_alive() and not result.get("stranded")
        assert requeued == ["s"]
        kinds = [k for k, _d in events(store)]
        assert "done" not in kinds and kinds[-1] == "reset"
        assert events(store)[-1][1] == {"attempt": 2, "reason": "handed back"}
        assert store.get_job("s")["status"] == "queued"
        submit(store, "late")
        assert engine.admit("late") is None and requeued == ["s", "late"]
    finally:
        engine.stop()


def broker_away(seq_id, priority=None):
    raise OperationalError("Error 111 connecting to redis:6379. Connection refused.")


@pytest.mark.parametrize("why", ["draining", "stuck", "over its key's share", "redis away"])
def test_a_sequence_that_cannot_be_queued_again_keeps_its_message(store, monkeypatch, why):
    """A task that gives its sequence back (the engine draining or stuck, its key over its
    share) and cannot send the new message, or that cannot reach Redis at all, must not fail:
    Celery acknowledges a failed task's message, and the record would wait `queued` with no
    message. It rejects the message back to the queue instead."""
    from worker import tasks  # noqa: F401 - registers the task
    from worker.celery_app import celery

    engine = make_engine(store, requeue=broker_away, max_num_seqs=2)
    for seq_id, owner in (("s", "o"), ("o-first", "o"), ("p-first", "p")):
        store.create([SequenceRequest(seq_id=seq_id, prompt_token_ids=[3, 4], owner=owner,
                                      params=SamplingParams(max_tokens=50))])
    engine._stop.set()   # (no pause before a hand-back or between tries: no loop runs)
    if why == "draining":
        engine._draining.set()
    elif why == "stuck":
        engine.liveness._progress -= engine.settings.worker_stale_s
    elif why == "over its key's share":   # a full worker, half of it o's
        assert engine.admit("o-first") and engine.admit("p-first")
    else:
        def unreachable(seq_id, priority=None):
            raise RedisConnectionError("Error 111 connecting to redis:6379.")
        monkeypatch.setattr(engine, "admit", unreachable)
    celery.llmq_engine = engine
    try:
        result = celery.tasks[GENERATE_TASK].apply(args=["s"])
    finally:
        celery.llmq_engine = None
    assert result.state == "REJECTED" and result.result.requeue
    assert store.get_job("s")["status"] == "queued"
    assert engine._reserved == []


def test_a_hand_back_that_meets_redis_restarting_is_tried_again(store, monkeypatch):
    """A RedisError reading the sequence's priority for its hand-back rejected the message at
    once, and kombu could not reject it while Redis was away: the record waited `queued`
    until the visibility timeout. It is retried as any Redis error while admitting."""
    requeued = []
    engine = make_engine(store, requeue=lambda seq_id, priority=None: requeued.append(seq_id))
    submit(store)
    engine._stop.set()   # (no pause between tries)
    engine._draining.set()
    real, calls = store.priority_of, []

    def restarting(seq_id):
        calls.append(seq_id)
        if len(calls) == 1:
            raise RedisConnectionError("Error 111 connecting to redis:6379.")
        return real(seq_id)

    monkeypatch.setattr(store, "priority_of", restarting)
    result = engine.run_sequence("s")
    assert not result.get("stranded") and requeued == ["s"] and len(calls) == 2


def test_a_task_that_reaches_a_worker_without_an_engine_keeps_its_message(store):
    """(Starting up, or the engine failed to start): it raised RuntimeError, and Celery
    acknowledged the message of the failed task."""
    from worker import tasks  # noqa: F401 - registers the task
    from worker.celery_app import celery

    store.create([SequenceRequest(seq_id="s", prompt_token_ids=[3, 4])])
    assert celery.llmq_engine is None
    result = celery.tasks[GENERATE_TASK].apply(args=["s"])
    assert result.state == "REJECTED" and result.result.requeue
    assert store.get_job("s")["status"] == "queued"


def test_a_sequence_handed_back_keeps_its_priority(store):
    """Bug 10: every way a sequence goes back to the queue (the hand-back at drain, a task
    arriving while draining or while the engine is stuck, a dead worker's reaped sequence)
    queues it at the priority it was queued at, not Celery's default."""
    requeued = []
    backend = SignallingBackend(max_model_len=1_000_000)
    engine = make_engine(store, backend,
                         lambda seq_id, priority=None: requeued.append((seq_id, priority)))
    for seq_id, priority in (("s", 3), ("late", 7), ("stuck", 1), ("reaped", 4)):
        store.create([SequenceRequest(seq_id=seq_id, prompt_token_ids=[3, 4, 5],
                                      params=SamplingParams(max_tokens=900_000),
                                      priority=priority)])
    store.create([SequenceRequest(seq_id="plain", prompt_token_ids=[3, 4])])
    engine.liveness._progress -= engine.settings.worker_stale_s   # (a stuck engine's silence)
    assert engine.admit("stuck") is None and engine.admit("plain") is None
    assert requeued == [("stuck", 1), ("plain", None)]
    store.start("reaped", "dead-worker")
    store.heartbeat("dead-worker", {"model": "m"}, ttl_s=60)
    store.r.zadd(Keys.workers, {"dead-worker": 0})   # its last beat, long ago
    engine.liveness.reap_dead_workers()
    assert requeued[-1] == ("reaped", 4)
    requeued.clear()
    engine.start()
    try:
        task = threading.Thread(target=engine.run_sequence, args=("s",))
        task.start()
        assert backend.running.wait(30)
        engine.drain(grace_s=0)
        task.join(30)
        assert requeued == [("s", 3)]
        assert engine.admit("late") is None and requeued[-1] == ("late", 7)
    finally:
        engine.stop()


def test_task_threads_checking_at_once_do_not_take_a_keys_share_twice(store, monkeypatch):
    """Issue 23: at a wave's end many task threads pass the fair-share check at once. Each one
    that passes holds a place for its key until it is admitted, so the key gets no more than
    its share of a full batch (max 2, share 1: b's one running sequence plus one)."""
    requeued = []
    engine = make_engine(store, requeue=lambda seq_id, priority=None: requeued.append(seq_id),
                         max_num_seqs=2)
    assert engine.workload_manager.key_cap == 1
    for i in range(6):
        store.create([SequenceRequest(seq_id=f"b{i}", prompt_token_ids=[3, 4], owner="b",
                                      params=SamplingParams(max_tokens=50))])
    assert engine.admit("b0") is not None
    # Every thread that reaches the input processor waits there for the others (at most 1 s),
    # as threads do while their Redis calls run, so none is admitted before all have checked.
    together = threading.Barrier(5, timeout=1.0)
    process = engine.inputs.process

    def slow_process(seq_id, running=None):
        try:
            together.wait()
        except threading.BrokenBarrierError:
            pass
        return process(seq_id, running)

    monkeypatch.setattr(engine.inputs, "process", slow_process)
    monkeypatch.setattr("worker.engine_core.FAIR_HANDBACK_S", 0.0)
    threads = [threading.Thread(target=engine.admit, args=(f"b{i}",)) for i in range(1, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(engine.output.admitted) == 2          # b0 and one of the five
    assert sorted(requeued) == sorted(f"b{i}" for i in range(1, 6)
                                      if f"b{i}" not in engine.output.admitted)
    assert engine._reserved == []


def test_a_messages_priority_orders_the_engines_queue(store):
    """Issue 16: batch lines (Celery priority 9) queued before an interactive request (0) do
    not go ahead of it in the engine, and a batch they fill gives it a slot."""
    engine = make_engine(store, max_num_seqs=1)
    for seq_id in ("line-1", "line-2", "chat"):
        submit(store, seq_id, max_tokens=50)
    lines = [engine.admit("line-1", priority=9), engine.admit("line-2", priority=9)]
    engine.step()
    assert [s.seq_id for s in engine.workload_manager.running] == ["line-1"]
    chat = engine.admit("chat", priority=0)
    assert chat.priority == 0 and lines[0].priority == 9
    engine.step()
    assert engine.workload_manager.running == [chat] and chat.num_output_tokens == 1
    assert lines[0].num_preemptions == 1 and not lines[0].done.is_set()


class GatedExecutor:
    """A model executor whose steps run in a thread of their own and end only when the test
    opens `gate`; an interjection runs at once (as between two layers of the step in flight).
    Results come through a pipe, so the engine's wait selects over it and its bell."""

    interjects = True

    def __init__(self, backend):
        import os
        from collections import deque

        self.backend, self.info, self.kv_capacity = backend, backend.info, (0, 0)
        self.gate = threading.Event()
        self.at_gate = threading.Event()   # a step is in flight, held at the gate
        self.num_starts = 1
        self.cuts = 0
        self._results = deque()
        self._r, self._w = os.pipe()

    def _put(self, res) -> None:
        import os

        self._results.append(res)
        os.write(self._w, b"r")

    fail_interject = False   # the interjection's send finds the model process dead

    @property
    def multi_step(self) -> bool:
        return self.backend.multi_step

    def cut_short(self) -> None:
        """As the model process does with CutShort: the passes end after the current one."""
        self.cuts += 1
        self.backend.hooks = StepHooks(another_pass=lambda: False)

    def restart(self) -> None:
        self.num_starts += 1
        self.fail_interject = False

    def submit(self, req) -> None:
        if req.interject and self.fail_interject:
            from worker.model_executor import ModelWorkerDied

            self.gate.set()   # (the step in flight ends; its result is never read)
            raise ModelWorkerDied("broken pipe")
        if req.interject:
            res = self.backend.step(req)
            res.interjected = True
            self._put(res)
            return
        def run():
            self.at_gate.set()
            self.gate.wait(30)
            self._put(self.backend.step(req, early=self._put))
        threading.Thread(target=run, daemon=True).start()

    def wait(self, wake=None):
        import os
        from multiprocessing.connection import wait as wait_any

        ready = wait_any([self._r] + ([wake] if wake is not None else []), 30)
        if self._r not in ready:
            assert ready, "no result within 30 s"
            return None
        os.read(self._r, 1)
        return self._results.popleft()

    def stop(self, timeout_s: float = 0) -> None:
        self.gate.set()


def chat_during_a_held_line_step(store, executor, line_tokens: int, chat_tokens: int):
    """A batch line prefilled, its next step held at the executor's gate (in flight, on a
    thread of its own), then a chat admitted: (engine, line, chat, the stepping thread)."""
    from common.settings import Settings
    from worker.engine_core import EngineCore

    from .factories import WordTokenizer

    engine = EngineCore("w1", Settings(), store, executor, WordTokenizer())
    submit(store, "line", max_tokens=line_tokens)
    submit(store, "chat", max_tokens=chat_tokens)
    line = engine.admit("line", priority=9)
    executor.gate.set()
    engine.step()                                   # the line is prefilled
    executor.gate.clear()
    executor.at_gate.clear()
    stepping = threading.Thread(target=engine.step)   # its decode waits at the gate
    stepping.start()
    assert executor.at_gate.wait(10)
    chat = engine.admit("chat", priority=0)         # rings the bell mid-step
    return engine, line, chat, stepping


def test_an_interactive_request_is_interjected_and_published_while_a_batch_step_runs(store):
    """Issue 16: an interactive request arriving while a step of batch lines is in flight gets
    its first token published before that step ends, and decodes with the batch after it."""
    backend = ScriptedBackend({"chat": [5, 6, 8]})
    executor = GatedExecutor(backend)
    engine, line, chat, stepping = chat_during_a_held_line_step(store, executor, 50, 3)
    assert wait_until(lambda: [k for k, _d in events(store, "chat")] == ["token"], 10,
                      "chat's first token")
    assert stepping.is_alive() and line.num_output_tokens == 1   # the step is still running
    assert engine.workload_manager.stats.num_interjected == 1
    interjection = backend.requests[-1]
    assert interjection.interject and [s.seq_id for s in interjection.prefill] == ["chat"]
    executor.gate.set()
    stepping.join(10)
    run(engine, [chat])
    assert store.get_job("chat")["text"] == " w5 w6 w8"
    # Requests: the line's prefill, the interjection, the held step, then chat decodes at once.
    decoding = [i for i, r in enumerate(backend.requests) if "chat" in r.decode_seq_ids]
    assert decoding == [3, 4]


def test_a_restart_that_arrives_while_the_old_copys_prefill_is_in_flight_drops_the_old(store):
    """The record is restarted here while the old copy's prefill step is in flight (it has left
    the waiting queue and is not running yet): the old copy still stops and writes nothing, so
    the model process never holds two sequences under one id, and readers get the new copy's
    tokens only."""
    from common.settings import Settings
    from worker.engine_core import EngineCore

    from .factories import WordTokenizer

    backend = ScriptedBackend({"s": [5, 6, 8]})
    executor = GatedExecutor(backend)
    engine = EngineCore("w1", Settings(), store, executor, WordTokenizer())
    submit(store, max_tokens=3)
    old = engine.admit("s")
    stepping = threading.Thread(target=engine.step)   # old's prefill, held at the gate
    stepping.start()
    assert executor.at_gate.wait(10)
    assert taken_for_dead(store) == ["s"]
    new = engine.admit("s")                           # attempt 2, rings the bell mid-step
    assert wait_until(lambda: new in engine.workload_manager.waiting, 10, "the new copy taken in")
    executor.gate.set()
    stepping.join(10)
    run(engine, [old, new])
    assert old.is_closed and old.finish_reason is FinishReason.CANCELLED
    # The model process was told to free the old copy before the new one joined.
    joins = [i for i, r in enumerate(backend.requests) if "s" in [x.seq_id for x in r.prefill]]
    assert len(joins) == 2 and "s" in backend.requests[joins[1]].free_seq_ids
    assert store.get_job("s")["text"] == " w5 w6 w8"
    assert_ended_once(store, engine, new, FinishReason.LENGTH)


def test_an_interjection_whose_send_finds_the_model_dead_is_run_after_the_restart(store):
    """Nothing accepted is lost: the interjected newcomer has left the waiting queue when its
    send fails, and goes back to it with the batch for the restarted model."""
    executor = GatedExecutor(ScriptedBackend())
    executor.fail_interject = True
    engine, line, chat, stepping = chat_during_a_held_line_step(store, executor, 4, 2)
    stepping.join(10)
    assert executor.num_starts == 2 and engine._interjected is None
    assert chat in engine.workload_manager.waiting and line in engine.workload_manager.waiting
    executor.gate.set()
    run(engine, [chat, line])
    assert store.get_job("chat")["status"] == "succeeded"
    assert store.get_job("line")["status"] == "succeeded"


def test_the_pace_of_a_pass_is_read_only_off_bursts_that_decoded_the_whole_batch(store):
    """A burst in which one sequence ended early ran its later passes with fewer rows: their
    time is not a pass's over the whole batch, and must not set the pace multi-step counts by
    (it would ask the next full batch for more passes than fit in the window)."""
    backend = ScriptedBackend({"a": [5, 6, 8, 9, EOS]}, multi_step=True, pass_s=0.005)
    engine = make_engine(store, backend, multi_step_window_s=0.02)
    submit(store, "a", max_tokens=50)
    submit(store, "b", max_tokens=50)
    a, b = engine.admit("a"), engine.admit("b")
    engine.step()   # both prefill
    engine.step()   # one pass: the pace of two rows, 5 ms
    assert engine.workload_manager._pace == (2, 0.005)
    backend.pass_s = 0.001   # faster passes from here, but a ends inside this burst
    engine.step()
    assert backend.requests[-1].num_steps == 4 and a.is_finished and not b.is_finished
    assert engine.workload_manager._pace == (2, 0.005)
    engine.step()   # b alone: a new size, one pass; then its own pace
    assert backend.requests[-1].num_steps == 1 and engine.workload_manager._pace[0] == 1
    run(engine, [a, b])


def a_burst_of_passes(store, interjects: bool = False, priority: int | None = None,
                      **settings):
    """Sequence a (of `priority`) decoding alone in a multi-step request held at the gate (its
    pace known from one pass), b submitted: (engine, executor, backend, a, the stepping
    thread). `interjects`: the executor prefills a better priority inside the step, as the
    transformers backend does; else not, as llama_cpp."""
    from common.settings import Settings
    from worker.engine_core import EngineCore

    from .factories import WordTokenizer

    backend = ScriptedBackend({}, multi_step=True, pass_s=0.001)
    executor = GatedExecutor(backend)
    executor.interjects = interjects
    engine = EngineCore("w1", Settings(multi_step_window_s=0.05, **settings), store, executor,
                        WordTokenizer())
    engine.fit_to_model()
    submit(store, "a", max_tokens=60)
    submit(store, "b", max_tokens=3)
    a = engine.admit("a", priority=priority)
    executor.gate.set()
    engine.step()   # prefill
    engine.step()   # one pass: the pace of one row
    executor.gate.clear()
    executor.at_gate.clear()
    stepping = threading.Thread(target=engine.step)   # a burst of passes, held at the gate
    stepping.start()
    assert executor.at_gate.wait(10)
    return engine, executor, backend, a, stepping


def test_a_newcomer_cuts_a_multi_step_request_short_and_is_prefilled_next(store):
    """A newcomer that arrives while a multi-step request runs waits for the pass in flight,
    not for all of the window's passes: the engine asks the model to stop there (CutShort),
    takes the tokens made so far, and the next step prefills the newcomer."""
    engine, executor, backend, a, stepping = a_burst_of_passes(store)
    made = a.num_output_tokens
    b = engine.admit("b")   # rings the bell mid-step
    assert wait_until(lambda: executor.cuts == 1, 10, "the cut")
    executor.gate.set()
    stepping.join(10)
    assert backend.requests[-1].num_steps == 16   # the window held many passes
    assert a.num_output_tokens == made + 1        # the burst ended after its first
    engine.step()
    assert [s.seq_id for s in backend.requests[-1].prefill] == ["b"]
    backend.hooks = StepHooks()
    run(engine, [a, b])
    assert store.get_job("b")["status"] == "succeeded" and a.num_output_tokens == 60


def test_an_interjected_newcomer_cuts_a_multi_step_request_short(store):
    """A better priority is prefilled inside the multi-step request in flight (interjected);
    the request's later passes would hold the newcomer's second token back for the window,
    so the engine cuts them short and the newcomer decodes from the next step."""
    engine, executor, backend, a, stepping = a_burst_of_passes(store, interjects=True, priority=9)
    made = a.num_output_tokens
    b = engine.admit("b", priority=0)   # rings the bell mid-step: interjected
    assert wait_until(lambda: b.num_output_tokens == 1, 10, "b's first token")
    assert wait_until(lambda: executor.cuts == 1, 10, "the cut")
    executor.gate.set()
    stepping.join(10)
    assert backend.requests[-1].num_steps == 16 and a.num_output_tokens == made + 1
    engine.step()
    assert "b" in backend.requests[-1].decode_seq_ids
    backend.hooks = StepHooks()
    run(engine, [a, b])
    assert store.get_job("b")["status"] == "succeeded" and a.num_output_tokens == 60


def test_a_newcomer_that_cannot_join_does_not_cut_the_passes_short(store):
    """With every slot taken by sequences no worse than it, a newcomer could not join at the
    next step anyway: the multi-step request keeps its passes (a cut only cost turns)."""
    engine, executor, backend, a, stepping = a_burst_of_passes(store, max_num_seqs=1)
    made = a.num_output_tokens
    b = engine.admit("b")
    assert wait_until(lambda: b in engine.workload_manager.waiting, 10, "b taken in")
    executor.gate.set()
    stepping.join(10)
    assert executor.cuts == 0 and a.num_output_tokens == made + 16
    run(engine, [a, b])
    assert store.get_job("b")["status"] == "succeeded"


def test_a_model_on_a_gpu_gives_the_scheduler_the_gpus_limits(store, monkeypatch):
    """The engine learns the device from the model process (ModelInfo.device) and takes the
    same device defaults the model process took (Settings.for_device); on a CPU its own stay."""
    import dataclasses

    for var in ("LLMQ_MAX_NUM_SEQS", "LLMQ_MAX_NUM_BATCHED_TOKENS", "LLMQ_LONG_PREFILL_CHUNK",
                "LLMQ_LONG_PREFILL_TOKEN_THRESHOLD"):
        monkeypatch.delenv(var, raising=False)
    backend = ScriptedBackend()
    backend.info = dataclasses.replace(backend.info, device="cuda:0")
    gpu = make_engine(store, backend).workload_manager
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens, gpu.long_prefill_chunk,
            gpu.key_cap) == (256, 8192, 512, 128)   # (a key's share: half)
    cpu = make_engine(store, ScriptedBackend(), max_num_seqs=8).workload_manager
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.long_prefill_chunk) == (8, 2048, 32)
