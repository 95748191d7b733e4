"""The worker side of the LLM engine: one loop that schedules, executes, updates and publishes.

Celery task threads hand sequences in through `run_sequence` and wait; the loop runs in its own
thread, and the model runs in the model-worker process behind the executor.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from redis.exceptions import RedisError

from common.protocol import FinishReason, SamplingParams, SequenceStatus
from common import metrics
from common.store import Finish, SequenceStore, TokenDelta

from .detokenizer import IncrementalDetokenizer
from .logprobs import LogprobsRecorder
from .messages import NewSequence, StepRequest, StepResult
from .model_executor import ModelExecutor, ModelWorkerDied
from .sequence import Sequence
from .workload_manager import POLICIES, SchedulerOutput, WorkloadManager

log = logging.getLogger("llmq.engine")

MAX_RESTARTS_PER_SEQUENCE = 2
# After the shutdown grace: how long the loop may take to hand the batch back before the task
# threads are released all the same (the loop is stuck in a step, or Redis does not answer).
HANDBACK_TIMEOUT_S = 5.0
FAIR_HANDBACK_S = 0.25   # a task thread waits this long before handing an over-share key's back


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


class EngineCore:
    """Runs the continuous-batching loop of one worker over its model executor."""

    def __init__(self, name: str, settings, store: SequenceStore, executor: ModelExecutor,
                 tokenizer, scheduler: WorkloadManager | None = None,
                 requeue: Callable[..., None] | None = None):
        self.name = name
        self.settings = settings
        self.store = store
        self.executor = executor
        self.tokenizer = tokenizer
        self.logprobs = LogprobsRecorder(tokenizer)
        self.scheduler = scheduler or WorkloadManager(
            settings.max_num_seqs, settings.max_num_batched_tokens,
            POLICIES[settings.batch_policy](), key_share=settings.key_batch_share)
        self.inbox: queue.Queue[Sequence] = queue.Queue()
        # Keyed by the Sequence object, not its id: after this worker was taken for dead, a
        # newer start of the same record can arrive while the stale copy is still here.
        self.detokenizers: dict[Sequence, IncrementalDetokenizer] = {}
        self._attempts: dict[Sequence, int] = {}   # the record's start each copy belongs to
        self._all_admitted: dict[str, Sequence] = {}   # admitted, not finished: task threads wait
        self.num_finished = 0
        self.num_prefill_tokens = 0   # tokens of every prefill, cached or computed
        self.num_cached_tokens = 0    # ... of which the model process's prefix cache gave
        self.timing = StepTiming()
        self.last_step_time = time.time()
        self.requeue = requeue or (lambda seq_id, priority=None: None)
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._handback = threading.Event()
        self._handback_done = threading.Event()
        self._stranded: set[Sequence] = set()   # released at shutdown without a hand-back
        self._idle = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress = time.monotonic()
        self._step_started: float | None = None
        self._beating_since: float | None = None   # start of the current run of good beats

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self.executor.start()   # loads the model in its own process (blocks until ready)
        self.scheduler.set_kv_budget(*self.executor.kv_capacity)
        # Whatever this worker name was running before a crash is ours to run again.
        for seq_id in self.store.reclaim(self.name):
            log.warning("re-queueing a sequence lost by this worker's previous run",
                        extra={"seq_id": seq_id})
            self.requeue(seq_id)
        if self.settings.test_step_delay_s:
            log.warning("LLMQ_TEST_STEP_DELAY=%g: every step waits that long (a test setting)",
                        self.settings.test_step_delay_s)
        self._thread = threading.Thread(target=self._loop, name="llmq-engine", daemon=True)
        threading.Thread(target=self._beat_loop, name="llmq-heartbeat", daemon=True).start()
        self._thread.start()
        self._heartbeat(force=True)

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
                 self.scheduler.num_unfinished + self.inbox.qsize())
        self._idle.clear()
        if self.scheduler.num_unfinished or not self.inbox.empty():
            self._idle.wait(grace_s)
        self._handback.set()
        if not self._handback_done.wait(HANDBACK_TIMEOUT_S):
            # The loop is stuck (a step, or a Redis call, that does not return): its data is
            # left alone; only the task threads waiting on it are let go.
            self._strand(list(self._all_admitted.values()),
                         f"the engine did not hand back within {HANDBACK_TIMEOUT_S:.0f} s")

    # --- the door Celery tasks use -------------------------------------------------------------
    def run_sequence(self, seq_id: str, timeout_s: float | None = None) -> dict:
        """Runs one sequence to its end (called from a Celery task thread)."""
        self._stall("received")
        for attempt in range(600):
            try:
                seq = self.admit(seq_id)
                break
            except RedisError as exc:   # Redis restarting: the message is not acked yet
                log.warning("redis unavailable admitting: %s", exc, extra={"seq_id": seq_id})
                self._stop.wait(min(5.0, 0.2 * (attempt + 1)))
        else:
            raise RuntimeError("redis unavailable for too long")
        if seq is None:
            return {"seq_id": seq_id, "skipped": True}
        seq.done.wait(timeout_s)
        if seq in self._stranded:   # released at shutdown, not handed back: Redis was away
            return {"seq_id": seq_id, "stranded": True}
        return {"seq_id": seq_id, "finish_reason": seq.finish_reason and seq.finish_reason.value,
                "completion_tokens": seq.num_output_tokens}

    def admit(self, seq_id: str) -> Sequence | None:
        """Marks the record running, tokenizes (in the caller's thread) and queues the sequence."""
        if self._draining.is_set():
            self.requeue(seq_id)   # shutting down: another worker takes it
            return None
        if not self._advancing():
            # The engine is stuck mid-step and its heartbeat has gone quiet, so other workers
            # take back what it runs; starting more here would only hold sequences hostage.
            # Hand the message back (at most once a second per task thread, in case this is
            # the only worker).
            log.warning("engine stuck: handing a sequence back", extra={"seq_id": seq_id})
            self._stop.wait(1.0)
            self.requeue(seq_id)
            return None
        if self._over_fair_share(seq_id):
            # This key already has its share of a full worker: the task thread is worth more
            # to another key's sequence (docs/security.md). Back to the queue, behind others.
            self._stop.wait(FAIR_HANDBACK_S)
            self.requeue(seq_id, 9)
            return None
        _prev, attempt = self.store.start(seq_id, self.name, self.settings.worker_stale_s)
        if not attempt:
            return None   # finished, cancelled while queued, or expired: nothing to do twice
        req = self.store.load_request(seq_id)
        code = "invalid_prompt"   # the record says it was the input (-> a 400 on the API)
        try:
            ids = self._tokenize(req)
            if len(ids) >= self.executor.info.max_model_len:
                code = "context_length_exceeded"
                raise ValueError(f"prompt is {len(ids)} tokens; the model's context is "
                                 f"{self.executor.info.max_model_len}")
            if not ids:
                raise ValueError("prompt is empty after tokenization")
        except Exception as exc:  # noqa: BLE001 - bad input fails this sequence alone
            log.warning("sequence rejected: %s", exc, extra={"seq_id": seq_id})
            self.store.finish(seq_id, FinishReason.ERROR, error=str(exc), error_code=code,
                              text="", completion_tokens=0, only_if=(SequenceStatus.RUNNING,),
                              attempt=attempt)
            return None
        self.store.set_prompt_tokens(seq_id, len(ids))
        log.info("sequence admitted", extra={"seq_id": seq_id, "attempt": attempt,
                                             "prompt_tokens": len(ids)})
        seq = Sequence(seq_id, ids, self._resolve(req.params, len(ids)),
                       eos_token_ids=self.executor.info.eos_token_ids,
                       created_at=req.created_at, admitted_at=time.time(), deadline=req.deadline,
                       owner=req.owner)
        self.detokenizers[seq] = IncrementalDetokenizer(self.tokenizer, ids)
        self._attempts[seq] = attempt
        self._all_admitted[seq_id] = seq
        self.inbox.put(seq)
        return seq

    def _over_fair_share(self, seq_id: str) -> bool:
        """Whether this worker holds a full batch and the sequence's key holds its share of
        it. Task threads outnumber batch slots (scripts/worker.sh), so another key's sequence
        can reach the scheduler while one key fills the batch; a key past its share must not
        take those threads too. Without API keys (no owner) sequences are never handed back,
        so their queue order holds."""
        held = list(self._all_admitted.values())
        if len(held) < self.settings.max_num_seqs:
            return False
        owner = self.store.owner_of(seq_id)
        return bool(owner) and sum(s.owner == owner for s in held) >= self.scheduler.key_cap

    # --- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        # (sequence, new text, its token count at that step): what is still to be published
        # text None: no new token, only the end to write.
        pending: list[tuple[Sequence, str | None, int]] = []
        while not self._stop.is_set():
            if self._handback.is_set():
                pending = self._hand_back(pending)
            self._take_inbox(block=not (self.scheduler.num_unfinished or pending))
            t_sched = time.monotonic()
            out = self.scheduler.schedule()                      # 1. schedule
            if out.is_empty and not out.freed_seq_ids:
                pending = self._publish(pending)
                continue
            try:
                self._step_started = t0 = time.monotonic()
                self.executor.submit(self._request(out))         # 2. execute (async) ...
                pending = self._publish(pending)                 # ... publishing meanwhile
                t1 = time.monotonic()
                if self.settings.test_step_delay_s:   # tests only: a slow engine on any CPU
                    self._stop.wait(self.settings.test_step_delay_s)
                result = self.executor.wait()
                if result.partial:   # the newcomers' first tokens, sent ahead of the decode
                    joined, out = out.split()
                    pending = self._publish(pending + self._update(joined, result))
                    result = self.executor.wait()
            except ModelWorkerDied as exc:
                self._recover(out, exc)
                continue
            finally:
                self._step_started = None
            t2 = time.monotonic()
            pending += self._update(out, result)                 # 3. update
            self.timing.record(t_sched, t0, t1, t2, time.monotonic(), result)
        self._publish(pending)                                   # 4. publish (the last one)

    def _take_inbox(self, block: bool) -> None:
        try:
            seq = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                # A newer start of a record this engine still runs (it was taken for dead and
                # the record restarted, here): the old copy goes first, so the model process
                # never holds two sequences under one id.
                for old in self.scheduler.running + list(self.scheduler.waiting):
                    if old.seq_id == seq.seq_id:
                        self._drop(old)
                self.scheduler.add(seq)
                seq = self.inbox.get_nowait()
        except queue.Empty:
            pass
        if block:
            self._idle.set()
            self._heartbeat()

    def _request(self, out: SchedulerOutput) -> StepRequest:
        return StepRequest(
            prefill=[NewSequence(s.seq_id, s.all_token_ids, s.params, s.num_output_tokens,
                                 s.stop_token_ids) for s in out.prefill],
            decode_seq_ids=[s.seq_id for s in out.decode],
            free_seq_ids=out.freed_seq_ids)

    def _update(self, out: SchedulerOutput, result: StepResult
                ) -> list[tuple[Sequence, str | None, int]]:
        """Turns sampled tokens into text deltas and finishes sequences; returns what to publish."""
        self.last_step_time = time.time()
        for seq_id, error in result.errors.items():
            seq = next(s for s in out.prefill + out.decode if s.seq_id == seq_id)
            self.scheduler.abort(seq, FinishReason.ERROR, error)
        for seq in out.prefill:   # counted before update() appends this step's token
            if not seq.num_output_tokens:   # not a preempted sequence's second prefill
                seq.num_cached_tokens = result.cached_tokens.get(seq.seq_id, 0)
            self.num_prefill_tokens += seq.num_tokens
            self.num_cached_tokens += seq.num_cached_tokens
        self.scheduler.update(out, result.token_ids)
        publish = []
        for seq in out.prefill + out.decode:
            self.logprobs.record(seq, result)
            if seq.seq_id in result.token_ids and seq in self.detokenizers:
                detok = self.detokenizers[seq]
                delta = detok.step(seq.output_token_ids[-1]) if seq.output_token_ids else ""
                if seq.is_finished:
                    delta += detok.flush()
                text = seq.add_text(delta, final=seq.is_finished)
                if seq.is_finished and seq in self.scheduler.running:   # a stop string ended it
                    self.scheduler.abort(seq, FinishReason.STOP)
                # (no output token: an echo-only sequence ends with no token event)
                publish.append((seq, text if seq.output_token_ids else None,
                                seq.num_output_tokens))
            elif seq.is_finished:
                publish.append((seq, None, seq.num_output_tokens))   # ended without a token
        return publish

    def _publish(self, pending: list[tuple[Sequence, str | None, int]]
                 ) -> list[tuple[Sequence, str | None, int]]:
        """Token events and finished records to Redis; cancellations back. Returns what could
        not be published (Redis unreachable): it is kept, in order, and retried next step."""
        try:
            if pending:
                # Each delta carries its step's token count: a batch retried after a reply lost
                # with the connection (Redis went down mid-call) is not appended twice.
                # One token event per generated token, the last one too when its text is
                # empty (an EOS): only entries without a token (text None) have none.
                # A copy dropped meanwhile (its record restarted, here or elsewhere) has no
                # attempt left to fence on: its pending delta is stale and never written.
                deltas = [(s, t, n) for s, t, n in pending
                          if t is not None and s in self._attempts]
                refused = self.store.publish_deltas(
                    TokenDelta(s.seq_id, t, s.text, n, self._attempts[s],
                               logprobs=self.logprobs.of_token(s, n),
                               prompt_logprobs=self.logprobs.of_prompt(s, n))
                    for s, t, n in deltas)
                for i in refused:   # the record is no longer this start's: stop, write nothing
                    self._drop(deltas[i][0])
                pending = [(s, None, n) for s, t, n in pending if s.is_finished]
                self._finish_many([s for s, _t, _n in pending])
                pending = []
            active = self.scheduler.running + list(self.scheduler.waiting)
            cancelled = self.store.cancelled_among([s.seq_id for s in active])
            now, ended = time.time(), []
            for seq in active:
                if seq.seq_id in cancelled:
                    self.scheduler.abort(seq, FinishReason.CANCELLED)
                elif seq.deadline and now > seq.deadline:
                    self.scheduler.abort(seq, FinishReason.TIMEOUT)
                else:
                    continue
                ended.append(seq)
            pending = [(s, None, s.num_output_tokens) for s in ended]   # kept if Redis fails
            self._finish_many(ended)
            pending = []
        except RedisError as exc:
            log.warning("redis unavailable, keeping %d updates for later: %s", len(pending), exc)
            self._stop.wait(0.5)
            return pending
        self._heartbeat()
        return []

    def _finish(self, seq: Sequence) -> None:
        self._finish_many([seq])

    def _finish_many(self, seqs: list[Sequence]) -> None:
        """Writes final records once (the detokenizer's presence marks "not yet written"), all
        in a few round trips, then lets their task threads return."""
        seqs = [s for s in seqs if s in self.detokenizers]
        if not seqs:
            return
        written = self.store.finish_many([
            Finish(s.seq_id, s.finish_reason, text=s.text, completion_tokens=s.num_output_tokens,
                   error=s.error, cached_tokens=s.num_cached_tokens,
                   logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs,
                   only_if=(SequenceStatus.RUNNING,), attempt=self._attempts.get(s),
                   metrics_recorded=True)   # _record_metrics below, with the timings
            for s in seqs])
        for seq in seqs:
            del self.detokenizers[seq]
            self._attempts.pop(seq, None)
            if self._all_admitted.get(seq.seq_id) is seq:
                del self._all_admitted[seq.seq_id]
        done = [s for s, ok in zip(seqs, written) if ok]
        self.num_finished += len(done)
        try:
            self._record_metrics(done)
        except RedisError:
            log.warning("metrics of %d sequences not recorded", len(done))
        for seq, ok in zip(seqs, written):
            if ok:
                log.info("sequence finished", extra={
                    "seq_id": seq.seq_id, "finish_reason": seq.finish_reason.value,
                    "prompt_tokens": seq.num_prompt_tokens,
                    "completion_tokens": seq.num_output_tokens, "error": seq.error})
            else:   # taken over elsewhere (or cancelled while queued): not ours to end
                log.warning("final result not written: the record is no longer this start's",
                            extra={"seq_id": seq.seq_id})
            seq.done.set()

    def _drop(self, seq: Sequence) -> None:
        """Stops this worker's copy of a sequence whose record was taken over meanwhile (handed
        back or restarted after this engine was taken for dead): frees its slot, writes
        nothing, and lets its task thread return."""
        self.scheduler.abort(seq, FinishReason.CANCELLED)
        self.detokenizers.pop(seq, None)
        self._attempts.pop(seq, None)
        if self._all_admitted.get(seq.seq_id) is seq:
            del self._all_admitted[seq.seq_id]
        log.warning("dropping a stale copy: the record was taken over",
                    extra={"seq_id": seq.seq_id})
        seq.done.set()

    def _hand_back(self, pending):
        """Drain ran out of time: unfinished sequences go back to the queue, from scratch.
        Those that cannot (Redis or the broker away) are released as stranded: their messages
        stay unacknowledged and their records `running` here, for kombu or a peer's reaper."""
        pending = self._publish(pending)
        for seq in self.scheduler.running + list(self.scheduler.waiting):
            self.scheduler.abort(seq, FinishReason.CANCELLED)
        self._take_inbox(block=False)
        for seq in list(self.scheduler.waiting):
            self.scheduler.abort(seq, FinishReason.CANCELLED)
        handed_back: set[str] = set()
        try:
            handed = self.store.reclaim(self.name, held=False, reason="handed back")
            self._stall("handback")
            for seq_id in handed:
                self.requeue(seq_id)
                handed_back.add(seq_id)
                log.info("handed back at shutdown", extra={"seq_id": seq_id})
        except Exception as exc:  # noqa: BLE001 - RedisError, or kombu's OperationalError
            self._strand([s for s in self._all_admitted.values()
                          if s.seq_id not in handed_back], f"redis unavailable: {exc}")
        self.detokenizers.clear()
        self._attempts.clear()
        self._release_all()
        self._handback.clear()
        self._handback_done.set()
        return pending

    def _release_all(self) -> None:
        for seq in list(self._all_admitted.values()):
            seq.done.set()
        self._all_admitted.clear()

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

    def _reap_dead_workers(self) -> None:
        """Takes back what workers that stopped heart-beating were running."""
        for name in self.store.stale_workers(self.settings.worker_stale_s):
            if name == self.name:
                continue
            for seq_id in self.store.reclaim(name, self.settings.worker_stale_s):
                log.warning("re-queueing a sequence of dead worker %s", name,
                            extra={"seq_id": seq_id})
                self.requeue(seq_id)

    def _record_metrics(self, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        now, mono = time.time(), time.monotonic()
        pipe = self.store.r.pipeline(transaction=False)
        for seq in seqs:
            created = seq.created_at or seq.admitted_at or now
            queue_s = (seq.admitted_at or now) - created
            ttft = tpot = None
            if seq.first_token_time is not None:
                ttft = queue_s + (seq.first_token_time - seq.arrival_time)
                if seq.num_output_tokens > 1:
                    tpot = (mono - seq.first_token_time) / (seq.num_output_tokens - 1)
            metrics.record_finished(pipe, finish_reason=seq.finish_reason.value,
                                    prompt_tokens=seq.num_prompt_tokens,
                                    cached_tokens=seq.num_cached_tokens,
                                    preemptions=seq.num_preemptions,
                                    generation_tokens=seq.num_output_tokens, queue_s=queue_s,
                                    ttft_s=ttft, tpot_s=tpot, e2e_s=now - created)
        pipe.execute()

    def _recover(self, out: SchedulerOutput, exc: Exception) -> None:
        """The model process died: restart it and re-run the batch from the tokens we have."""
        log.error("model worker died (%s); restarting it", exc)
        seqs = self.scheduler.requeue(out)
        for seq in seqs:
            seq.num_restarts += 1
            if seq.num_restarts > MAX_RESTARTS_PER_SEQUENCE:
                self.scheduler.abort(seq, FinishReason.ERROR,
                                     f"model worker crashed {seq.num_restarts} times running it")
                self._finish(seq)
        while not self._stop.is_set():
            self._step_started = time.monotonic()   # a restart is progress, for a while
            try:
                self.executor.restart()
                return
            except ModelWorkerDied as err:
                log.error("model worker restart failed: %s", err)
                time.sleep(1.0)

    # --- helpers ------------------------------------------------------------------------------
    def _stall(self, moment: str) -> None:
        """Tests only (LLMQ_TEST_STALL_AT): parks this thread at `moment`, for a fault test to
        kill the worker exactly there."""
        if self.settings.test_stall_at == moment:
            log.warning("stalling at %s (LLMQ_TEST_STALL_AT)", moment)
            threading.Event().wait()

    def _tokenize(self, req) -> list[int]:
        if req.prompt_token_ids is not None:
            vocab = self.executor.info.vocab_size
            if any(not 0 <= t < vocab for t in req.prompt_token_ids):
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
            return list(req.prompt_token_ids)
        if req.messages is not None:
            text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                                      tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(req.prompt)["input_ids"]

    def _resolve(self, p: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """Fills unset sampling values from the model's generation_config; caps max_tokens."""
        d = self.executor.info.generation_defaults
        room = self.executor.info.max_model_len - num_prompt_tokens
        # (replace: fields this does not resolve, such as logprobs, pass through as they are)
        return dataclasses.replace(
            p, max_tokens=max(min(1, p.max_tokens), min(p.max_tokens, room)),   # 0: echo only
            temperature=p.temperature if p.temperature is not None else d.get("temperature", 0.0),
            top_p=p.top_p if p.top_p is not None else d.get("top_p"),
            top_k=p.top_k if p.top_k is not None else d.get("top_k"),
            min_p=p.min_p if p.min_p is not None else d.get("min_p"),
            repetition_penalty=(p.repetition_penalty if p.repetition_penalty is not None
                                else d.get("repetition_penalty")),
            seed=p.seed, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
            min_tokens=p.min_tokens, ignore_eos=p.ignore_eos, cache_salt=p.cache_salt)

    def stats(self) -> dict:
        st = self.scheduler.stats
        return {"model": self.executor.info.name if self.executor.info else "",
                "device": self.executor.info.device if self.executor.info else "",
                "dtype": self.executor.info.dtype if self.executor.info else "",
                "model_loaded": int(self.executor.info is not None),
                # the API refuses prompts past it before they queue
                "max_model_len": self.executor.info.max_model_len if self.executor.info else 0,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "num_steps": st.num_steps, "num_prefilled": st.num_prefilled,
                "num_joined_running_batch": st.num_joined_running_batch,
                "max_running": st.max_running, "num_preempted": st.num_preempted,
                "num_finished": self.num_finished,
                "prefill_tokens": self.num_prefill_tokens,
                "prefix_cached_tokens": self.num_cached_tokens,
                "model_starts": self.executor.num_starts, "last_step": self.last_step_time,
                **self.timing.as_dict()}

    def _heartbeat(self, force: bool = False) -> None:
        """Marks progress of the loop; the beat thread turns progress into heartbeats."""
        self._progress = time.monotonic()
        if force:
            self._beat()

    def _beat_loop(self) -> None:
        """Heart-beats while the engine advances: its loop turned recently, or a step is in
        flight for less than LLMQ_MAX_STEP (a long prefill is progress; a hang is not). A
        stuck engine goes silent, /readyz turns red and other workers reclaim its sequences."""
        while not self._stop.wait(self.settings.worker_heartbeat_s):
            if self._advancing():
                self._beat()
            else:
                self._beating_since = None

    def _advancing(self) -> bool:
        now = time.monotonic()
        in_step = self._step_started is not None and (
            now - self._step_started < self.settings.max_step_s)
        return in_step or now - self._progress < self.settings.worker_stale_s / 2

    def _beat(self) -> None:
        try:
            self.store.heartbeat(self.name, self.stats(), ttl_s=self.settings.worker_stale_s * 4)
        except Exception as exc:  # noqa: BLE001 - Redis hiccup: try again next beat
            self._beating_since = None
            log.warning("heartbeat failed: %s", exc)
            return
        # Judge others dead only after beating without a gap for LLMQ_WORKER_STALE ourselves:
        # after a Redis outage (or a pause of this engine) every heartbeat in Redis is old, and
        # the first worker back would otherwise take its live peers' sequences from them.
        now = time.monotonic()
        if self._beating_since is None:
            self._beating_since = now
        if now - self._beating_since >= self.settings.worker_stale_s:
            try:
                self._reap_dead_workers()
            except Exception as exc:  # noqa: BLE001 - Redis hiccup: try again next beat
                log.warning("reaping failed: %s", exc)
