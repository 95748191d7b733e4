"""The output processor: the only place a sequence ends.

Each step's sampled tokens become text (detokenizer, logprobs, stop strings); every end, an
EOS or stop token, the length limit, a stop string, a cancel, a deadline, an error, a copy
dropped for a newer start, is decided here and freed through the workload manager (which appends
tokens and ends nothing itself): its record is written once, its metrics counted once, and its
task thread let go. (vLLM v1's OutputProcessor, with the engine's Redis writes.)
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

from redis.exceptions import RedisError

from common.protocol import FinishReason, SequenceStatus
from common.store import Finish, SequenceStore, TokenDelta

from .input_processor import Rejected
from .logprobs import LogprobsRecorder
from .messages import StepResult
from .sequence import Sequence
from .workload_manager import SchedulerOutput, WorkloadManager

log = logging.getLogger("llmq.engine")


def end_on_token(seq: Sequence) -> FinishReason | None:
    """How the token just appended ends its sequence, if it does: a stop token (EOS unless
    ignored, or one of the request's stop_token_ids; counted, and only once min_tokens are
    out) is "stop", then the length limit is "length". An echo-only sequence (max_tokens 0)
    keeps no token and ends at once."""
    n, params = len(seq.output_token_ids), seq.params
    if n and n >= params.min_tokens and seq.output_token_ids[-1] in seq.stop_token_ids:
        return FinishReason.STOP
    if n >= params.max_tokens:
        return FinishReason.LENGTH
    return None


class Output(NamedTuple):
    """One sequence's progress in one step, waiting to be published: its new text (None: no
    token, only its end to write) and its token count at that step (the write's idempotency
    key: a batch retried after a lost reply is not appended twice)."""

    seq: Sequence
    text: str | None
    num_tokens: int


class OutputProcessor:
    """Turns steps into text and Redis writes, and ends sequences, each exactly once."""

    def __init__(self, store: SequenceStore, workload_manager: WorkloadManager, tokenizer):
        self.store = store
        self.workload_manager = workload_manager
        self.logprobs = LogprobsRecorder(tokenizer)
        self.admitted: dict[str, Sequence] = {}   # admitted, not yet ended: task threads wait
        self.pending: list[Output] = []           # in step order; kept while Redis is away
        self.num_finished = 0
        self.num_prefill_tokens = 0   # tokens of every prefill, cached or computed
        self.num_cached_tokens = 0    # ... of which the model process's prefix cache gave

    @property
    def has_pending(self) -> bool:
        return bool(self.pending)

    def track(self, seq: Sequence) -> None:
        """An admitted sequence: it ends here (or is released at hand-back)."""
        self.admitted[seq.seq_id] = seq

    # --- from the model ----------------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: StepResult) -> None:
        """Appends the sampled tokens (through the workload manager), turns them into text deltas
        and ends the sequences they stop."""
        for seq_id, error in result.errors.items():
            self.abort(next(s for s in out.prefill + out.decode if s.seq_id == seq_id),
                       FinishReason.ERROR, error)
        for seq in out.prefill:   # counted before update() appends this step's token
            if not seq.num_output_tokens:   # not a preempted sequence's second prefill
                seq.num_cached_tokens = result.cached_tokens.get(seq.seq_id, 0)
            self.num_prefill_tokens += seq.num_tokens
            self.num_cached_tokens += seq.num_cached_tokens
        got = self.workload_manager.update(out, result.token_ids)   # appends; ends nothing
        for seq in out.prefill + out.decode:
            if seq.seq_id not in result.errors:
                self.logprobs.record(seq, result)
        for seq in got:
            self.pending.append(self._on_token(seq))
        # A multi-step result: the running batch's later passes, one round at a time, so that
        # each token is judged (stop string, stop token, length) with those before it; a
        # sequence ended by one round takes none of its later tokens (they were decoded past
        # its end, and are dropped with its slot).
        more = result.more_token_ids
        for i in range(result.num_passes - 1):
            tokens = {sid: toks[i] for sid, toks in more.items() if i < len(toks)}
            for seq in self.workload_manager.update(SchedulerOutput(decode=out.decode), tokens):
                self.pending.append(self._on_token(seq))

    def _on_token(self, seq: Sequence) -> Output:
        """A sequence's new token: its text delta and, when the token ends it, its end. A stop
        string beats the length on the same token (vLLM and OpenAI report "stop")."""
        reason = end_on_token(seq)
        detok = seq.detokenizer
        # A stop token's own text is not output (vLLM's include_stop_str_in_output false);
        # its logprob and its count are.
        delta = (detok.step(seq.output_token_ids[-1])
                 if seq.output_token_ids and reason is not FinishReason.STOP else "")
        if reason is not None:
            delta += detok.flush()
        text = seq.add_text(delta, final=reason is not None)
        if seq.is_cut_at_stop:
            reason = FinishReason.STOP
        if reason is not None:
            self.workload_manager.abort(seq, reason)
        # (no output token: an echo-only sequence ends with no token event)
        return Output(seq, text if seq.output_token_ids else None, seq.num_output_tokens)

    # --- ends decided outside a token ----------------------------------------------------------
    def abort(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Ends a sequence wherever it is (cancel, deadline, error); written at the next publish.
        What was held back (the start of a possible stop string, half a character) is text
        all the same: it goes into the final record and its done event, whose text OpenAI's
        streams send as their last piece."""
        if seq.output_token_ids and not seq.is_finished:
            seq.add_text(seq.detokenizer.flush(), final=True)
        self.workload_manager.abort(seq, reason, error)
        self.pending.append(Output(seq, None, seq.num_output_tokens))

    def reject(self, exc: Rejected) -> None:
        """A started record whose input could not run: it fails alone (the store's finish
        script counts it in request_success_total, as it ran nowhere)."""
        log.warning("sequence rejected: %s", exc, extra={"seq_id": exc.seq_id})
        self.store.finish(exc.seq_id, FinishReason.ERROR, error=str(exc), error_code=exc.code,
                          text="", completion_tokens=0, only_if=(SequenceStatus.RUNNING,),
                          attempt=exc.attempt)

    def drop(self, seq: Sequence) -> None:
        """Stops this worker's copy of a sequence whose record was taken over meanwhile (handed
        back or restarted after this engine was taken for dead): frees its slot, writes
        nothing, and lets its task thread return."""
        self.workload_manager.abort(seq, FinishReason.CANCELLED)
        self._close(seq)
        log.warning("dropping a stale copy: the record was taken over",
                    extra={"seq_id": seq.seq_id})
        seq.done.set()

    def abort_all(self) -> None:
        """Hand-back: every sequence leaves the workload manager; nothing is written (the records go
        back to the queue, see EngineCore._hand_back)."""
        for seq in self.workload_manager.running + list(self.workload_manager.waiting):
            self.workload_manager.abort(seq, FinishReason.CANCELLED)

    def release_all(self) -> None:
        """After a hand-back: every copy here is closed and its task thread let go."""
        for seq in list(self.admitted.values()):
            self._close(seq)
            seq.done.set()
        self.admitted.clear()

    # --- to Redis ----------------------------------------------------------------------------
    def publish(self) -> None:
        """Token events and final records to Redis, then cancels and deadlines back. Raises
        RedisError with what is not yet written still pending (in order, retried next time)."""
        self._write(self.workload_manager.running + list(self.workload_manager.waiting))
        self._write()   # the ends the look for cancels and deadlines decided

    def _write(self, active: list[Sequence] | None = None) -> None:
        """Writes what is pending; with `active`, looks for cancels among those sequences in
        the same round trip and ends the cancelled and the late."""
        if not self.pending and not active:
            return
        # One token event per generated token, the last one too when its text is empty (an
        # EOS): only entries without a token (text None) have none. A closed copy (its end
        # written, or dropped for a newer start of its record) writes no delta.
        deltas = [o for o in self.pending if o.text is not None and not o.seq.is_closed]
        tokens = [TokenDelta(o.seq.seq_id, o.text, o.num_tokens, o.seq.attempt,
                             logprobs=self.logprobs.of_token(o.seq, o.num_tokens),
                             prompt_logprobs=self.logprobs.of_prompt(o.seq, o.num_tokens))
                  for o in deltas]
        refused, cancelled = self.store.publish_step(tokens, [s.seq_id for s in active or []])
        for o, d in zip(deltas, tokens):
            if d.prompt_logprobs is not None:
                o.seq.prompt_logprobs_in_events = True
        for i in refused:   # the record is no longer this start's: stop, write nothing
            self.drop(deltas[i].seq)
        # Deltas are written: from here on only the ends are still owed.
        self.pending = [Output(o.seq, None, o.num_tokens) for o in self.pending
                        if o.seq.is_finished]
        self._finish_many([o.seq for o in self.pending])
        self.pending = []
        now = time.time()
        for seq in active or []:
            if seq.is_finished:   # dropped just now
                continue
            if seq.seq_id in cancelled:
                self.abort(seq, FinishReason.CANCELLED)
            elif seq.deadline and now > seq.deadline:
                self.abort(seq, FinishReason.TIMEOUT)

    def _finish_many(self, seqs: list[Sequence]) -> None:
        """Writes final records once, all in a few round trips, then lets their task threads
        return."""
        seqs = [s for s in dict.fromkeys(seqs) if not s.is_closed]
        if not seqs:
            return
        written = self.store.finish_many([
            Finish(s.seq_id, s.finish_reason, text=s.text, completion_tokens=s.num_output_tokens,
                   error=s.error, cached_tokens=s.num_cached_tokens,
                   logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs,
                   in_events=self.logprobs.in_events(s),
                   only_if=(SequenceStatus.RUNNING,), attempt=s.attempt,
                   metrics_recorded=True)   # _record_metrics below, with the timings
            for s in seqs])
        for seq in seqs:
            self._close(seq)
        done = [s for s, ok in zip(seqs, written) if ok]
        self.num_finished += len(done)
        try:
            self._record_metrics(done)
        except RedisError:   # the figures are lost; the records are written
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

    def _close(self, seq: Sequence) -> None:
        seq.is_closed = True
        if self.admitted.get(seq.seq_id) is seq:
            del self.admitted[seq.seq_id]

    def _record_metrics(self, seqs: list[Sequence]) -> None:
        now, mono = time.time(), time.monotonic()
        observations = []
        for seq in seqs:
            created = seq.created_at or seq.admitted_at or now
            queue_s = (seq.admitted_at or now) - created
            ttft = tpot = None
            if seq.first_token_time is not None:
                ttft = queue_s + (seq.first_token_time - seq.arrival_time)
                if seq.num_output_tokens > 1:
                    tpot = (mono - seq.first_token_time) / (seq.num_output_tokens - 1)
            observations.append(dict(
                finish_reason=seq.finish_reason.value, prompt_tokens=seq.num_prompt_tokens,
                cached_tokens=seq.num_cached_tokens, preemptions=seq.num_preemptions,
                generation_tokens=seq.num_output_tokens, queue_s=queue_s, ttft_s=ttft,
                tpot_s=tpot, e2e_s=now - created))
        self.store.record_metrics(observations)
