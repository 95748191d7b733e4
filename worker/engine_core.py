"""The worker side of the LLM engine: one loop that schedules, executes, updates and publishes.

Celery task threads hand sequences in through `run_sequence` and wait; the loop runs in its own
thread, and the model runs in the model-worker process behind the executor. Each job around the
loop has one owner: `input_processor` admits sequences, `output_processor` turns tokens into
text and ends sequences (the only place that does), `liveness` heart-beats and reaps dead
workers; the loop itself only schedules, executes, updates, and recovers from a crashed model.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable

from redis.exceptions import RedisError

from common.protocol import FinishReason
from common.reconcile_store import ReconcileStore
from common.store import SequenceStore, queue_lists
from common.test_hooks import NO_HOOKS, HarnessHooks

from .input_processor import InputProcessor, Rejected
from .liveness import Liveness
from .messages import NewSequence, StepRequest
from .model_executor import ModelExecutor, ModelWorkerDied
from .output_processor import OutputProcessor
from .reconciler import Reconciler
from .sequence import Sequence
from .workload_manager import POLICIES, SchedulerOutput, WorkloadManager

log = logging.getLogger("llmq.engine")

MAX_RESTARTS_PER_SEQUENCE = 2
# After the shutdown grace: how long the loop may take to hand the batch back before the task
# threads are released all the same (the loop is stuck in a step, or Redis does not answer).
HANDBACK_TIMEOUT_S = 5.0
FAIR_HANDBACK_S = 0.25   # a task thread waits this long before handing an over-share key's back


class NotSentBack(Exception):
    """A sequence this engine does not take now could not be queued again (the broker or Redis
    away): its task must keep its own message instead (worker/tasks.py rejects it back to the
    queue). Acknowledged, it would leave the record queued with no message at all."""


class StepTiming:
    """Where a worker's steps spend their time, as running totals (seconds) in its heartbeat:
    `step_s` from submitting a step to its result, of which `model_prefill_s` and
    `model_decode_s` are the model process's own compute; `publish_s` is the Redis work
    overlapped with it and `host_s` the engine's own work around a step (schedule, build the
    request, then turn tokens into text). `make bench` turns the differences into "where the time goes"."""

    FIELDS = ("steps", "step_s", "model_prefill_s", "model_decode_s", "publish_s", "host_s")

    def __init__(self):
        self.steps = 0
        self.step_s = self.model_prefill_s = self.model_decode_s = 0.0
        self.publish_s = self.host_s = 0.0

    def record(self, scheduled: float, submitted: float, published: float, done: float,
               updated: float, result) -> None:
        self.steps += 1
        self.step_s += done - submitted
        self.publish_s += published - submitted
        self.host_s += (submitted - scheduled) + (updated - done)
        self.model_prefill_s += result.prefill_s
        self.model_decode_s += result.decode_s

    def as_dict(self) -> dict:
        return {f"timing_{k}": round(getattr(self, k), 4) if k != "steps" else self.steps
                for k in self.FIELDS}


class Bell:
    """A pipe the task threads ring when they put a sequence in the engine's inbox, so the
    loop's wait for the model process (a select over both) wakes for it mid-step."""

    def __init__(self):
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    def ring(self) -> None:
        try:
            os.write(self._w, b"\0")
        except BlockingIOError:   # full: it is ringing already
            pass

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass


class EngineCore:
    """Runs the continuous-batching loop of one worker over its model executor."""

    def __init__(self, name: str, settings, store: SequenceStore, executor: ModelExecutor,
                 tokenizer, workload_manager: WorkloadManager | None = None,
                 requeue: Callable[..., None] | None = None, hooks: HarnessHooks = NO_HOOKS):
        self.name = name
        self.settings = settings
        self.hooks = hooks   # the test harness's (common/test_hooks.py); none in production
        self.store = store
        self.executor = executor
        self.tokenizer = tokenizer
        self.workload_manager = workload_manager or WorkloadManager(
            settings.max_num_seqs, settings.max_num_batched_tokens,
            POLICIES[settings.batch_policy](), key_share=settings.key_batch_share,
            long_prefill_tokens=settings.long_prefill_tokens,
            long_prefill_chunk=settings.long_prefill_chunk,
            attention_context=settings.prefill_attention_context,
            priority_hold_steps=settings.priority_hold_steps,
            priority_window_s=settings.priority_window_s,
            interjection=settings.priority_interject,
            multi_step_window_s=settings.multi_step_window_s)
        self.requeue = requeue or (lambda seq_id, priority=None: None)
        self._stop = threading.Event()
        self.inputs = InputProcessor(name, settings, store, executor, tokenizer)
        self.output = OutputProcessor(store, self.workload_manager, tokenizer)
        self.liveness = Liveness(
            name, settings, store, self.stats, self._send_back, self._stop,
            # (every model's queues: a message in another model's queue is not lost)
            Reconciler(settings, store.beside(ReconcileStore, [
                name for m in settings.served_models() for name in queue_lists(m.queue)]),
                self.requeue))
        self.inbox: queue.Queue[Sequence] = queue.Queue()
        self.bell = Bell()
        # Newcomers prefilled inside the step in flight, their result not yet in (one at a time).
        self._interjected: SchedulerOutput | None = None
        self._cut = False   # the multi-step request in flight was asked to stop (CutShort)
        self._in_flight: SchedulerOutput | None = None   # the step the model process runs
        self.timing = StepTiming()
        self.last_step_time = time.time()
        self._draining = threading.Event()
        self._handback = threading.Event()
        self._handback_done = threading.Event()
        self._stranded: set[Sequence] = set()   # released at shutdown without a hand-back
        self._idle = threading.Event()
        self._admitting = threading.Lock()   # the fair-share check and its reservation
        self._reserved: list[str] = []       # owners of sequences past the check, not admitted
        self._arriving: set[str] = set()     # ids a task thread is admitting now
        self._thread: threading.Thread | None = None

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self.executor.start()   # loads the model in its own process (blocks until ready)
        self.fit_to_model()
        self.liveness.take_back_own()
        if self.hooks.step_delay_s:
            log.warning("LLMQ_TEST_STEP_DELAY=%g: every step waits that long (a test hook)",
                        self.hooks.step_delay_s)
        self._thread = threading.Thread(target=self._loop, name="llmq-engine", daemon=True)
        self._thread.start()
        self.liveness.progress()
        self.liveness.start()

    def fit_to_model(self) -> None:
        """Sizes the workload manager to the model process its executor started: the KV cache it
        admits against, whether a step may run several decode passes, and the batch and step
        limits of the model's device."""
        self.workload_manager.set_kv_budget(*self.executor.kv_capacity)
        self.workload_manager.set_multi_step(self.executor.multi_step
                                             and not self.hooks.step_delay_s)
        self.workload_manager.set_exact_resume(self.executor.info.resumes_exactly)
        # The model process took the same device defaults (worker/model/process.py).
        device = self.settings.for_device(self.executor.info.device)
        if device is not self.settings:
            self.workload_manager.set_limits(device.max_num_seqs, device.max_num_batched_tokens,
                                      device.long_prefill_tokens, device.long_prefill_chunk)

    def stop(self) -> None:
        self._stop.set()
        # A drain whose hand-back never came means a loop stuck in a step (or a Redis call):
        # it will not turn again, so it gets a moment, not a step's worth of time.
        stuck = self._draining.is_set() and not self._handback_done.is_set()
        if self._thread:
            self._thread.join(1.0 if stuck else 10.0)
        # A loop still mid-step never reads a Shutdown: stopping the model process under it
        # (killed after 2 s) ends its wait.
        stuck = self._thread is not None and self._thread.is_alive()
        self.executor.stop(timeout_s=2.0 if stuck else 10.0)
        # Leave the registry only with nothing left running under this name. A stop without
        # a hand-back (SIGQUIT, or Redis away during the drain) leaves sequences marked running
        # here; staying registered lets the silence be noticed, so another worker (or this
        # name's next start) takes them back instead of nobody, ever.
        try:
            if not self.store.running_ids(self.name):
                self.store.remove_worker(self.name)
        except RedisError as exc:
            log.warning("redis unavailable at stop; the registry entry stays for the reaper: %s",
                        exc)

    def drain(self, grace_s: float) -> None:
        """Graceful shutdown: take nothing new, let the batch finish for up to grace_s, then
        hand every unfinished sequence back to the queue (another worker restarts it). Bounded
        whatever Redis or the model does: HANDBACK_TIMEOUT_S after the grace, every task thread
        is released, those not handed back with their messages unacknowledged."""
        self._draining.set()
        log.info("draining: up to %.0f s for %d sequences", grace_s,
                 self.workload_manager.num_unfinished + self.inbox.qsize())
        self._idle.clear()
        if self.workload_manager.num_unfinished or not self.inbox.empty():
            self._idle.wait(grace_s)
        self._handback.set()
        if not self._handback_done.wait(HANDBACK_TIMEOUT_S):
            # The loop is stuck (a step, or a Redis call, that does not return): its data is
            # left alone; only the task threads waiting on it are let go.
            self._strand(list(self.output.admitted.values()),
                         f"the engine did not hand back within {HANDBACK_TIMEOUT_S:.0f} s")

    # --- the door Celery tasks use -------------------------------------------------------------
    def run_sequence(self, seq_id: str, timeout_s: float | None = None,
                     priority: int | None = None) -> dict:
        """Runs one sequence to its end (called from a Celery task thread). priority: its
        message's Celery priority, which the workload manager honours too (0 first)."""
        self._stall("received")
        for attempt in range(600):
            try:
                seq = self.admit(seq_id, priority)
                break
            except RedisError as exc:   # Redis restarting: the message is not acked yet
                log.warning("redis unavailable admitting: %s", exc, extra={"seq_id": seq_id})
                self._stop.wait(min(5.0, 0.2 * (attempt + 1)))
            except NotSentBack as exc:
                return self._keep_message(seq_id, f"could not queue it again: {exc}")
        else:
            return self._keep_message(seq_id, "redis unavailable for too long")
        if seq is None:
            return {"seq_id": seq_id, "skipped": True}
        seq.done.wait(timeout_s)
        if seq in self._stranded:   # released at shutdown, not handed back: Redis was away
            return {"seq_id": seq_id, "stranded": True}
        return {"seq_id": seq_id, "finish_reason": seq.finish_reason and seq.finish_reason.value,
                "completion_tokens": seq.num_output_tokens}

    @staticmethod
    def _keep_message(seq_id: str, why: str) -> dict:
        """Neither run here nor queued again: the task keeps its message (a task that failed
        would have it acknowledged, and the record would wait `queued` for nothing)."""
        log.error("%s; the message goes back to the queue", why, extra={"seq_id": seq_id})
        return {"seq_id": seq_id, "stranded": True}

    def admit(self, seq_id: str, priority: int | None = None) -> Sequence | None:
        """Hands the sequence to the input processor (in the caller's thread) and queues it,
        unless this engine should not take it now."""
        if self._draining.is_set():
            self._decline(seq_id)   # shutting down: another worker takes it
            return None
        if not self.liveness.advancing():
            # The engine is stuck mid-step and its heartbeat has gone quiet, so other workers
            # take back what it runs; starting more here would only hold sequences hostage.
            # Hand the message back (at most once a second per task thread, in case this is
            # the only worker).
            log.warning("engine stuck: handing a sequence back", extra={"seq_id": seq_id})
            self._stop.wait(1.0)
            self._decline(seq_id)
            return None
        owner = self.store.owner_of(seq_id)
        if not self._reserve(owner):
            # This key already has its share of a full worker: the task thread is worth more
            # to another key's sequence (docs/security.md). Back to the queue, behind others.
            self._stop.wait(FAIR_HANDBACK_S)
            self._decline(seq_id, behind=True)
            return None
        with self._admitting:
            # A second message for an id another task thread is admitting at this moment: the
            # record's start cannot tell the two apart yet (neither copy is admitted), and both
            # would run, the second restarting the first's stream. Skipped, as below.
            duplicate = seq_id in self._arriving
            if duplicate:
                self._reserved.remove(owner)
            else:
                self._arriving.add(seq_id)
        if duplicate:
            log.info("a second message for a sequence being admitted: skipped",
                     extra={"seq_id": seq_id})
            return None
        seq = None
        try:
            # The copy this engine runs, if any: a second message for it is skipped (a stuck
            # peer's hand-back and the reaper's re-send of one message can both come here).
            current = self.output.admitted.get(seq_id)
            seq = self.inputs.process(seq_id, current.attempt if current else None)
        except Rejected as exc:
            self.output.reject(exc)
        finally:
            with self._admitting:   # from reserved to admitted in one move: counted once
                self._reserved.remove(owner)
                self._arriving.discard(seq_id)
                if seq is not None:
                    self.output.track(seq)
        if seq is not None:
            seq.priority = priority or 0
            self.inbox.put(seq)
            self.bell.ring()
        return seq

    def _send_back(self, seq_id: str) -> None:
        """Queues a sequence again (handed back, or taken from a dead worker) at the priority
        it was queued at."""
        self.requeue(seq_id, self.store.priority_of(seq_id))

    def _decline(self, seq_id: str, behind: bool = False) -> None:
        """Queues again a sequence this engine does not take now, at its priority or, `behind`,
        behind the others. Raises NotSentBack if the broker refuses it; a RedisError (the
        priority's read) goes to run_sequence's retries, as any other of admit's."""
        try:
            if behind:
                self.requeue(seq_id, 9)
            else:
                self._send_back(seq_id)
        except RedisError:
            raise
        except Exception as exc:  # noqa: BLE001 - kombu's OperationalError, and the like
            raise NotSentBack(f"{type(exc).__name__}: {exc}") from exc

    def _reserve(self, owner: str) -> bool:
        """Counts a sequence toward its key's share from the moment it passes the fair-share
        check until it is admitted: task threads check at once when a wave ends, and without
        the reservation all of them pass before any is admitted, so one key took every
        thread. False: the key is over its share of a full worker."""
        with self._admitting:
            held = [s.owner for s in list(self.output.admitted.values())] + self._reserved
            if self.inputs.over_fair_share(owner, held, self.workload_manager.key_cap,
                                           self.workload_manager.max_num_seqs):
                return False
            self._reserved.append(owner)
            return True

    # --- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._handback.is_set():
                self._hand_back()
            if not (self.workload_manager.num_unfinished or self.output.has_pending):
                self._take_inbox(block=True)
            self.step()
        self._publish()   # the last step's outputs

    def step(self) -> None:
        """One iteration: schedule, execute, update, publish. This step's outputs are published
        while the next one executes (or, with nothing to run, at once)."""
        self._take_inbox(block=False)
        t_sched = time.monotonic()
        out = self.workload_manager.schedule()                          # 1. schedule
        if out.is_empty and not out.freed_seq_ids:
            self._publish()
            return
        ran = self._execute(out)                                 # 2. execute
        if ran is None:
            return   # the model process died; _recover has dealt with the step
        out, result, t_submit, t_published = ran
        t_done, self.last_step_time = time.monotonic(), time.time()
        self.output.update(out, result)                          # 3. update
        if out.decode and not out.prefill and result.decode_s and result.is_full(out.decode):
            self.workload_manager.observe_pass(result.decode_s / result.num_passes, len(out.decode))
        self.timing.record(t_sched, t_submit, t_published, t_done, time.monotonic(), result)
        # 4. publish: at the next step's execute, overlapped with the model

    def _execute(self, out: SchedulerOutput):
        """Sends the step to the model process and publishes the last step's outputs while it
        runs; then waits for its result (_wait: newcomers arriving meanwhile may be
        interjected into it, or cut a multi-step request short). Newcomers' first tokens that
        come ahead of the rest are applied and published as they come, and leave `out`.
        Returns (what is left of out, its result, submit time, published time), or None when
        the model process died (recovered)."""
        try:
            with self.liveness.stepping():
                t_submit = time.monotonic()
                self._cut = False
                self._in_flight = in_flight = out
                self.executor.submit(self._request(out))
                self._publish()
                t_published = time.monotonic()
                if self.hooks.step_delay_s:   # tests only: a slow engine on any CPU
                    self._stop.wait(self.hooks.step_delay_s)
                result = self._wait(in_flight)
                while result.partial:   # newcomers' first tokens, pass by pass, ahead of the rest
                    joined, out = out.split({*result.token_ids, *result.errors})
                    self.output.update(joined, result)
                    self._publish()
                    result = self._wait(in_flight)
                while self._interjected is not None:   # it came after the step: the next
                    self._wait(None)                   # step must find it in the batch
        except ModelWorkerDied as exc:
            self._recover(out, exc)
            return None
        finally:
            self._in_flight = None
        return out, result, t_submit, t_published

    def _wait(self, in_flight: SchedulerOutput | None):
        """The step's next result. Meanwhile, newcomers that ring the bell are taken in, and
        those of a better priority than the worst of the step (`WorkloadManager.interject`)
        are sent to be prefilled inside it; their result is applied and published as it comes.
        in_flight None: only the outstanding interjection's result is awaited."""
        while True:
            can = in_flight is not None and self._interjected is None and self.executor.interjects
            cut = in_flight is not None and in_flight.num_steps > 1 and not self._cut
            res = self.executor.wait(self.bell if can or cut else None)
            if res is None:   # the bell: newcomers in the inbox
                self._take_inbox(block=False)
                side = self.workload_manager.interject(in_flight) if can else None
                if side is not None:
                    self._interjected = side   # (first: a failing send still requeues them)
                    self.executor.submit(StepRequest(prefill=self._new_sequences(side),
                                                     interject=True))
                elif cut and self.workload_manager.would_admit():
                    # A multi-step request's later passes would keep them waiting: it ends
                    # after the pass it is in, and the next step prefills them.
                    self._cut = True
                    self.executor.cut_short()
                continue
            if res.interjected:
                side, self._interjected = self._interjected, None
                self.output.update(side, res)
                self._publish()
                if in_flight is None:
                    return res
                if cut:
                    # The newcomers it prefilled decode from the next step: the multi-step
                    # request's later passes would hold their second tokens back.
                    self._cut = True
                    self.executor.cut_short()
                continue
            return res

    def _publish(self) -> None:
        """Publishes what the output processor holds; with Redis away, keeps it for later."""
        try:
            self.output.publish()
        except RedisError as exc:
            log.warning("redis unavailable, keeping %d updates for later: %s",
                        len(self.output.pending), exc)
            self._stop.wait(0.5)
            return
        self.liveness.progress()

    def _take_inbox(self, block: bool) -> None:
        self.bell.clear()   # (a ring after this finds its sequence here, or wakes the next wait)
        try:
            seq = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                # A newer start of a record this engine still runs (it was taken for dead and
                # the record restarted, here): the old copy goes first, so the model process
                # never holds two sequences under one id. The newcomers of the step and the
                # interjection in flight count too: they have left the waiting queue, and
                # join the running batch only with their result (once each: one whose first
                # token came ahead of the step's end is running already).
                joining = ((self._interjected.prefill if self._interjected else [])
                           + (self._in_flight.prefill if self._in_flight else []))
                wm = self.workload_manager
                for old in dict.fromkeys(wm.running + list(wm.waiting) + joining):
                    if old.seq_id == seq.seq_id:
                        self.output.drop(old)
                self.workload_manager.add(seq)
                seq = self.inbox.get_nowait()
        except queue.Empty:
            pass
        if block:
            self._idle.set()
            self.liveness.progress()

    def _request(self, out: SchedulerOutput) -> StepRequest:
        return StepRequest(prefill=self._new_sequences(out),
                           decode_seq_ids=[s.seq_id for s in out.decode],
                           free_seq_ids=out.freed_seq_ids, chunks=out.prompt_chunks,
                           num_steps=out.num_steps)

    @staticmethod
    def _new_sequences(out: SchedulerOutput) -> list[NewSequence]:
        return [NewSequence(s.seq_id, s.all_token_ids, s.params, s.num_output_tokens,
                            s.stop_token_ids) for s in out.prefill]

    def _recover(self, out: SchedulerOutput, exc: Exception) -> None:
        """The model process died: restart it and re-run the batch from the tokens we have."""
        log.error("model worker died (%s); restarting it", exc)
        side, self._interjected = self._interjected, None
        for seq in self.workload_manager.requeue(out, side):
            seq.num_restarts += 1
            if seq.num_restarts > MAX_RESTARTS_PER_SEQUENCE:
                self.output.abort(seq, FinishReason.ERROR,
                                  f"model worker crashed {seq.num_restarts} times running it")
        self._publish()
        # A restart is progress for LLMQ_MAX_STEP in all, not per try: a model that can never
        # start again (files gone, the GPU lost) kept the heartbeat going for ever, and the
        # batch (and every newcomer) waited here instead of on a peer.
        with self.liveness.stepping():
            while not self._stop.is_set():
                try:
                    self.executor.restart()
                    # The new process sizes its own KV cache (from the memory free now) and
                    # may differ: admitting against the old size failed its steps.
                    self.fit_to_model()
                    return
                except ModelWorkerDied as err:
                    log.error("model worker restart failed: %s", err)
                    time.sleep(1.0)

    # --- shutdown -----------------------------------------------------------------------------
    def _hand_back(self) -> None:
        """Drain ran out of time: unfinished sequences go back to the queue, from scratch.
        Those that cannot (Redis or the broker away) are released as stranded: their messages
        stay unacknowledged and their records `running` here, for kombu or a peer's reaper."""
        self._publish()
        self._take_inbox(block=False)
        self.output.abort_all()
        handed_back: set[str] = set()
        try:
            # Each stays in the running set until it is sent: this name stays registered
            # (stop) and a peer's reaper sends what this could not.
            handed = self.store.reclaim(self.name, held=False, reason="handed back",
                                        sender=self.name)
            self._stall("handback")
            for seq_id in handed:
                self._send_back(seq_id)
                handed_back.add(seq_id)
                self.store.resent(self.name, seq_id)
                log.info("handed back at shutdown", extra={"seq_id": seq_id})
        except Exception as exc:  # noqa: BLE001 - RedisError, or kombu's OperationalError
            self._strand([s for s in self.output.admitted.values()
                          if s.seq_id not in handed_back], f"redis unavailable: {exc}")
        self.output.pending = []   # (the records are queued again: nothing of theirs to write)
        self.output.release_all()
        self._handback.clear()
        self._handback_done.set()

    def _strand(self, seqs: list[Sequence], why: str) -> None:
        """Lets task threads go without a hand-back. Their tasks leave the messages
        unacknowledged and the records stay `running` under this name, so kombu redelivers
        them or a peer's reaper (or this name's next start) takes them back."""
        seqs = [s for s in seqs if not s.done.is_set()]
        if not seqs:
            return
        log.error("could not hand back %d sequences (%s); their messages stay "
                  "unacknowledged, for kombu or a peer's reaper to bring back", len(seqs), why)
        self._stranded.update(seqs)
        for seq in seqs:
            seq.done.set()

    # --- helpers ------------------------------------------------------------------------------
    def _stall(self, moment: str) -> None:
        """Tests only (LLMQ_TEST_STALL_AT): parks this thread at `moment`, for a fault test to
        kill the worker exactly there."""
        if self.hooks.stall_at == moment:
            log.warning("stalling at %s (LLMQ_TEST_STALL_AT)", moment)
            threading.Event().wait()

    def stats(self) -> dict:
        st, info, out = self.workload_manager.stats, self.executor.info, self.output
        return {"model": info.name if info else "",
                # the name the API routes requests by (`model`), and what /v1/models says
                "model_name": self.settings.served_model.name,
                "backend": self.settings.backend,
                "device": info.device if info else "",
                "dtype": info.dtype if info else "",
                "kv_cache_dtype": info.kv_cache_dtype if info else "",
                "kernels": info.kernels if info else "",
                "model_loaded": int(info is not None),
                # the API refuses prompts past it before they queue
                "max_model_len": info.max_model_len if info else 0,
                "running": len(self.workload_manager.running),
                "waiting": len(self.workload_manager.waiting),
                "num_steps": st.num_steps, "num_prefilled": st.num_prefilled,
                "num_joined_running_batch": st.num_joined_running_batch,
                "max_running": st.max_running, "num_preempted": st.num_preempted,
                "num_held_steps": st.num_held_steps, "num_interjected": st.num_interjected,
                "num_finished": out.num_finished,
                "prefill_tokens": out.num_prefill_tokens,
                "prefix_cached_tokens": out.num_cached_tokens,
                "model_starts": self.executor.num_starts, "last_step": self.last_step_time,
                **self.timing.as_dict()}
