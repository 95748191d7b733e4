"""The workload manager (scheduler): waiting and running queues, and the next batch.

Plain Python over plain data: no torch, no Redis. The engine asks `schedule()` for the next
step's work and reports the sampled tokens back through `update()`, which appends them; the
output processor decides which sequences they end and frees those through `abort()`.
"""
from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Protocol

from common.protocol import FinishReason

from .sequence import Sequence, SequenceState


class BatchPolicy(Protocol):
    """Decides whether newcomers may join the batch this step (the replaceable part)."""

    name: str

    def may_admit(self, num_running: int) -> bool: ...


class ContinuousBatching:
    """Iteration-level batching: newcomers join at the next step whenever there is room."""

    name = "continuous"

    def may_admit(self, num_running: int) -> bool:
        return True


class StaticBatching:
    """Request-level batching: a batch runs to completion before anyone joins (for comparison)."""

    name = "static"

    def may_admit(self, num_running: int) -> bool:
        return num_running == 0


POLICIES: dict[str, type] = {p.name: p for p in (ContinuousBatching, StaticBatching)}

# A chunk's attention reads its whole context's keys and values once, however few its tokens:
# per `attention_context` tokens of context, about as much as this many tokens' worth of the
# rest of the model (measured in one process, bf16, one thread: a 2-8 token chunk's attention
# over 3,000 keys takes 0.4-0.7 ms a layer, against ~10 us a layer per token of linears).
CHUNK_READ_COST = 16
MAX_DECODE_PASSES = 16   # a multi-step step's passes at most, however short they are


@dataclass
class SchedulerOutput:
    """One step's work: sequences to prefill (joining the batch) and sequences to decode."""

    prefill: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    freed_seq_ids: list[str] = field(default_factory=list)
    # Running sequences whose prompt the model process is still computing, chunk by chunk:
    # the tokens of this step's chunk (they are in `decode`, and get no token until the last).
    chunks: dict[str, int] = field(default_factory=dict)
    # Newcomers whose prompt is longer than this step's chunk of it: that chunk's tokens.
    first_chunks: dict[str, int] = field(default_factory=dict)
    num_steps: int = 1   # decode passes back to back (multi-step: see WorkloadManager)

    @property
    def is_empty(self) -> bool:
        return not (self.prefill or self.decode)

    @property
    def num_batched_tokens(self) -> int:
        return (sum(self.first_chunks.get(s.seq_id, s.num_tokens) for s in self.prefill)
                + len(self.decode) - len(self.chunks) + sum(self.chunks.values()))

    @property
    def prompt_chunks(self) -> dict[str, int]:
        """Prompt tokens the model process computes this step, of each sequence whose prompt
        spans steps (newcomers and running ones alike)."""
        return {**self.first_chunks, **self.chunks}

    def split(self, answered) -> tuple["SchedulerOutput", "SchedulerOutput"]:
        """The newcomers a partial result answers (their first tokens or errors, sent ahead
        of the rest of the step), and the rest of the step: the other newcomers, the running
        batch."""
        mine = [s for s in self.prefill if s.seq_id in answered]
        rest = [s for s in self.prefill if s.seq_id not in answered]
        return (SchedulerOutput(prefill=mine, first_chunks={s.seq_id: self.first_chunks[s.seq_id]
                                                            for s in mine
                                                            if s.seq_id in self.first_chunks}),
                SchedulerOutput(prefill=rest, decode=self.decode,
                                freed_seq_ids=self.freed_seq_ids, chunks=self.chunks,
                                first_chunks={s.seq_id: self.first_chunks[s.seq_id]
                                              for s in rest if s.seq_id in self.first_chunks},
                                num_steps=self.num_steps))


@dataclass
class SchedulerStats:
    """Counters the engine publishes; tests read them to prove sequences joined a live batch."""

    num_steps: int = 0
    num_prefilled: int = 0
    num_joined_running_batch: int = 0    # prefilled while other sequences were decoding
    max_running: int = 0
    num_preemptions: int = 0             # running sequences sent back to wait for KV blocks
    num_preempted: int = 0               # running sequences that gave their slot to a fair share or a better priority
    num_held_steps: int = 0              # steps whose worse-priority newcomers waited for a better priority's sake
    num_interjected: int = 0             # newcomers prefilled inside a step in flight (interject)


@dataclass(frozen=True)
class KVBudget:
    """The model process's KV cache, in blocks of block_size tokens: what admission counts."""

    num_blocks: int
    block_size: int

    def blocks(self, seq: Sequence) -> int:
        """Blocks a sequence holds once this step has computed it: its tokens so far (the
        last sampled one gets its keys and values in this step's decode)."""
        return -(-seq.num_tokens // self.block_size)


class WorkloadManager:
    """Admission bounded by `max_num_seqs`, a per-step token budget (vLLM's chunked prefill:
    decode tokens first, then the next chunk of prompts already being prefilled, then
    newcomers' prompts; at least one newcomer per step while there is a free slot) and, once
    the model process has said how big it is, the KV cache's blocks: a newcomer joins only if
    its blocks fit beside the running batch's, and when the running batch outgrows the cache
    the newest sequences are preempted (vLLM's recompute preemption: back to the front of the
    queue, keeping their output; their next prefill covers prompt and output). The best
    priority waiting goes first (0 before 9: interactive requests before batch lines), takes the
    newest slot of a worse priority when the batch is full (vLLM's priority scheduling), and is
    prefilled without worse-priority newcomers beside it; and while a better priority runs or
    waits (or did, within `priority_window_s`), worse-priority newcomers join the running
    batch together once every `priority_hold_steps` steps, so most steps an interactive
    request lands in are decode-only. Within a priority, FIFO within a key;
    across keys (sequence owners) the key holding the fewest slots goes first, and while
    another key waits, none holds more than `key_share` of the batch (docs/security.md).

    Long prompts (vLLM's long_prefill_token_threshold): while the step carries other
    sequences' tokens (decodes, or short newcomers), a prompt longer than
    `long_prefill_tokens` gets `long_prefill_chunk` tokens per step (by default as many), so
    each decode step grows by a bounded amount instead of a whole budget's chunk; alone, it
    gets the whole budget. Shorter prompts always go whole. With
    `attention_context`, a chunk's tokens are weighted by the context they attend over, so
    the cap holds a chunk's cost, not its length, as the prompt gets deeper. Deep into a
    prompt, a chunk's reading of its context costs more than a step's cap whatever its size:
    the prompt then earns the cap every step and gets a chunk only every few steps, once it has
    earned twice that reading cost, so the decodes' steps grow by the cap on average."""

    def __init__(self, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 policy: BatchPolicy | None = None, kv_budget: KVBudget | None = None,
                 key_share: float = 1.0, long_prefill_tokens: int = 0,
                 long_prefill_chunk: int = 0, attention_context: int = 0,
                 priority_hold_steps: int = 1, priority_window_s: float = 0.0,
                 interjection: bool = False, multi_step_window_s: float = 0.0,
                 clock=time.monotonic):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_tokens = long_prefill_tokens   # longer prompts are long; 0: no cap
        self.long_prefill_chunk = long_prefill_chunk or long_prefill_tokens
        # A prompt token's attention reads its whole context: at this many tokens of context
        # it costs as much again as the rest of the model, so a chunk deep into a long prompt
        # counts 1 + context / attention_context per token against its limit (0: 1 each).
        self.attention_context = attention_context
        self.policy = policy or ContinuousBatching()
        self.kv_budget = kv_budget
        self.exact_resume = True   # set_exact_resume
        # A key's fair share of the batch, in slots (all of them for key_share 1).
        self.key_share = key_share
        self.key_cap = max(1, int(max_num_seqs * key_share))
        # Worse-priority newcomers' prefill is held beside a better priority (1: never held).
        self.priority_hold_steps = max(1, priority_hold_steps)
        self.priority_window_s = priority_window_s
        # Newcomers of a better priority than a whole step in flight are prefilled inside it
        # (interject); off: they wait for the step to end.
        self.interjection = interjection
        # Decode-only steps with nobody waiting run several passes, as many as fit in this
        # window at the recent passes' pace, once the backend says it can (set_multi_step).
        self.multi_step_window_s = multi_step_window_s
        self.multi_step = False
        self._pace: tuple[int, float] | None = None   # (batch size, seconds a decode pass)
        self._clock = clock
        self._seen: dict[int, float] = {}   # priority -> when a sequence of it last ran or waited
        self._held = 0                      # steps in a row that held worse-priority newcomers
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        # Left the batch since the last step (the model frees them then): id -> KV blocks held
        self._freed: dict[str, int] = {}
        # Prompt tokens (prompt + output after a preemption) the model process has yet to
        # compute, of running sequences whose prefill spans steps. Each step's chunk of each is
        # decided here and sent with the step (StepRequest.chunks); the model process computes
        # at most that (cached prefixes make this count an upper bound, and a sequence that
        # gets its first token early is dropped from it).
        self._prompt_left: dict[str, int] = {}
        # Cost (in the cap's units) each capped prompt has earned and not yet spent.
        self._credit: dict[str, float] = {}

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.state = SequenceState.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Ends a sequence wherever it is and frees its slot. The output processor decides
        every end and calls this; the scheduler itself ends nothing."""
        seq.finish(reason, error)
        self._remove(seq)

    def set_kv_budget(self, num_blocks: int, block_size: int) -> None:
        """The model process's KV cache size (0 blocks: the backend counts for itself)."""
        self.kv_budget = KVBudget(num_blocks, block_size) if num_blocks and block_size else None

    def set_limits(self, max_num_seqs: int, max_num_batched_tokens: int,
                   long_prefill_tokens: int, long_prefill_chunk: int) -> None:
        """The batch's and the step's limits for the model's device (Settings.for_device: a
        GPU's are larger than the CPU defaults the scheduler was made with)."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_tokens = long_prefill_tokens
        self.long_prefill_chunk = long_prefill_chunk or long_prefill_tokens
        self.key_cap = max(1, int(max_num_seqs * self.key_share))

    def set_exact_resume(self, able: bool) -> None:
        """Whether the backend continues a preempted sequence exactly (ModelInfo
        .resumes_exactly). Where it does not (vLLM: a re-added request starts its grammar,
        seeded generator and penalty counts again), a sequence that depends on them is never
        preempted here: a better priority or another key's share waits for a slot to end, and
        a full KV cache is vLLM's own to preempt, which keeps that state."""
        self.exact_resume = able

    def _movable(self, seq: Sequence) -> bool:
        """Whether preempting `seq` leaves its text as it would have been."""
        if self.exact_resume:
            return True
        p = seq.params
        return not (p.structured or p.presence_penalty or p.frequency_penalty
                    or (p.seed is not None and (p.temperature or 0.0) > 0.0))

    def set_multi_step(self, able: bool) -> None:
        """Whether the model process runs several decode passes per step (Ready.multi_step)."""
        self.multi_step = able

    def observe_pass(self, seconds: float, num_seqs: int) -> None:
        """A decode-only step's model time per pass over num_seqs sequences: the pace
        multi-step counts passes by (smoothed while the batch keeps its size)."""
        if seconds <= 0:
            return
        if self._pace is not None and self._pace[0] == num_seqs:
            seconds = 0.7 * self._pace[1] + 0.3 * seconds
        self._pace = (num_seqs, seconds)

    def _num_steps(self, out: SchedulerOutput) -> int:
        """Decode passes for this step (vLLM's multi-step scheduling). Each step costs a turn
        of the engine (the result through the pipe, update, publish, schedule, the request
        back); at one sequence a pass is a few milliseconds and that turn a sixth of it. So
        while only the running batch decodes (no newcomer, no prompt chunk) and nobody
        waits, the model process runs as many passes back to back as fit in the window; a
        newcomer that arrives meanwhile and could join cuts them short (CutShort) and waits
        for one pass. A big batch's pass is longer
        than the window and goes one a step, as before. With a KV budget, the blocks of every
        pass are reserved up front: fewer passes where they would not fit."""
        pace = self._pace
        if not (self.multi_step and self.multi_step_window_s > 0 and pace is not None
                and pace[0] == len(out.decode) and not out.prefill and not out.chunks
                and not self.waiting):
            return 1   # (a batch of a new size goes one pass first: its pace is not known)
        n = max(1, min(MAX_DECODE_PASSES, int(self.multi_step_window_s / pace[1])))
        kv = self.kv_budget
        while kv and n > 1 and sum(-(-(s.num_tokens + n - 1) // kv.block_size)
                                   for s in out.decode) > kv.num_blocks:
            n -= 1
        return n

    def would_admit(self) -> bool:
        """Whether the next step could take a waiting sequence: a slot is free, or one waits at
        a better priority than the worst running (it takes that one's slot). Cutting a
        multi-step request short for a newcomer that cannot join only costs turns."""
        if not self.waiting:
            return False
        if len(self.running) < self.max_num_seqs:
            return True
        return (min(s.priority for s in self.waiting)
                < max((s.priority for s in self.running), default=0))

    def schedule(self) -> SchedulerOutput:
        self._preempt()
        if self.policy.may_admit(len(self.running)):
            self._preempt_for_priority()
            self._preempt_for_fair_share()
        limit = self._chunk_limit()
        out = SchedulerOutput(decode=list(self.running), chunks=self._next_chunks(limit))
        budget = (self.max_num_batched_tokens - len(out.decode) + len(out.chunks)
                  - sum(out.chunks.values()))
        kv = self.kv_budget
        used = sum(kv.blocks(s) for s in self.running) if kv else 0
        guard = self._guarded_priority()
        # (After a preemption nobody joins: the front of the queue is now the oldest victim,
        # and preemption stopped as soon as the batch fit without it.)
        if self.policy.may_admit(len(self.running)):
            while self.waiting and len(self.running) + len(out.prefill) < self.max_num_seqs:
                seq = self._next_waiting(out.prefill)
                # A newcomer of a worse priority waits for the next step: the better one's
                # first token (sent after this step's prefill pass) is not held up by it.
                if out.prefill and seq.priority > out.prefill[0].priority:
                    break
                if seq.priority > guard and self._held < self.priority_hold_steps - 1:
                    break
                chunk = self._chunk(seq.num_tokens, 0, limit)
                # The first newcomer of a step is admitted whatever its size (alone among the
                # prefills, beside the running batch's decodes): a prompt bigger than what the
                # budget leaves can neither starve nor make the running batch drain first.
                if chunk > budget and out.prefill:
                    break
                if kv and used + kv.blocks(seq) > kv.num_blocks:
                    # One that can never fit goes alone into an empty batch: the model process
                    # refuses it (longer than its context, which it caps at the cache's size).
                    if kv.blocks(seq) <= kv.num_blocks or self.running or out.prefill:
                        break
                self.waiting.remove(seq)
                out.prefill.append(seq)
                budget -= chunk
                if seq.num_tokens > chunk:
                    self._prompt_left[seq.seq_id] = seq.num_tokens - chunk
                    out.first_chunks[seq.seq_id] = chunk
                used += kv.blocks(seq) if kv else 0
        self._count_held(guard, out)
        out.freed_seq_ids, self._freed = list(self._freed), {}
        out.num_steps = self._num_steps(out)
        self.stats.num_steps += 1
        self.stats.num_prefilled += len(out.prefill)
        if out.decode:
            self.stats.num_joined_running_batch += len(out.prefill)
        return out

    # --- a better priority inside a step in flight ----------------------------------------------
    def interject(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        """Newcomers that may be prefilled while `in_flight` still runs, in a pass of their own
        that the model process runs between two of its layers: those of a better priority than
        the worst of that step (an interactive request beside batch lines), whose prompt goes
        in one chunk, while slots and KV blocks are free. On a CPU a step of a busy batch
        lasts ~100 ms, and waiting for it was most of what a batch added to an interactive
        request's time to first token; its prefill pass costs the batch the same either way
        (it never shares a pass with worse priorities). They join the running batch when their
        result comes (update), and decode from the next step on. None: nobody to interject."""
        flying = in_flight.prefill + in_flight.decode
        if not (self.interjection and self.waiting and flying):
            return None
        worst = max(s.priority for s in flying)
        rows = self.running + [s for s in in_flight.prefill if s not in self.running]
        kv = self.kv_budget
        # Those that left during the step in flight hold their rows and blocks in the model
        # process until the next step frees them.
        row_ids = {s.seq_id for s in rows}
        held = len(row_ids | set(self._freed))
        used = sum(kv.blocks(s) for s in rows) + sum(self._freed.values()) if kv else 0
        longest = min(self.long_prefill_tokens or self.max_num_batched_tokens,
                      self.max_num_batched_tokens)
        budget = self.max_num_batched_tokens
        out = SchedulerOutput()
        for seq in sorted(self.waiting, key=lambda s: s.priority):   # stable: FIFO within one
            if seq.priority >= worst or held + len(out.prefill) >= self.max_num_seqs:
                break
            if (seq.num_tokens > min(longest, budget)
                    or (kv and used + kv.blocks(seq) > kv.num_blocks)
                    or seq.seq_id in self._freed or seq.seq_id in row_ids):
                continue   # a restart: its old copy is not freed yet (or is in this very step)
            self.waiting.remove(seq)
            out.prefill.append(seq)
            used += kv.blocks(seq) if kv else 0
            budget -= seq.num_tokens
        if not out.prefill:
            return None
        self._seen[out.prefill[0].priority] = self._clock()
        self.stats.num_prefilled += len(out.prefill)
        self.stats.num_joined_running_batch += len(out.prefill)
        self.stats.num_interjected += len(out.prefill)
        return out

    # --- worse priorities beside a better one ----------------------------------------------------
    def _guarded_priority(self) -> float:
        """The best priority running, waiting or seen within `priority_window_s`: newcomers of
        a worse one join only every `priority_hold_steps` steps, and only while something
        decodes (an idle batch gains nothing from waiting). Each step a newcomer joins beside
        32 decodes costs a prefill pass, about as dear as the decode's own (its fixed cost),
        and an interactive request arriving waits for the step in flight: steps without that
        pass keep the wait close to a decode's. No better priority about: no guard."""
        if self.priority_hold_steps <= 1:
            return math.inf
        now = self._clock()
        for seq in self.running + list(self.waiting):
            self._seen[seq.priority] = now
        if not self.running:
            return math.inf
        recent = [p for p, t in self._seen.items() if now - t <= self.priority_window_s]
        return min(recent, default=math.inf)

    def _count_held(self, guard: float, out: SchedulerOutput) -> None:
        """Counts the steps in a row that held worse-priority newcomers back (one that admits
        them, or no guard, starts the count again)."""
        if guard == math.inf or any(s.priority > guard for s in out.prefill):
            self._held = 0
        elif any(s.priority > guard for s in self.waiting):
            self._held += 1
            self.stats.num_held_steps += 1

    def _chunk_limit(self) -> int:
        """The most prompt tokens of one sequence this step: the whole budget, or the long
        prefill cap while decodes run or a short prompt waits to join (it would share the
        step). A wave of short prompts is never capped: none of them is long."""
        cap = min(self.long_prefill_chunk, self.max_num_batched_tokens)
        if not self.long_prefill_tokens:
            return self.max_num_batched_tokens
        if any(s.seq_id not in self._prompt_left for s in self.running):
            return cap
        if (len(self.running) < self.max_num_seqs and self.policy.may_admit(len(self.running))
                and any(s.num_tokens <= self.long_prefill_tokens for s in self.waiting)):
            return cap
        return self.max_num_batched_tokens

    def _chunk(self, left: int, done: int, limit: float) -> int:
        """The most of `left` prompt tokens, after `done` computed ones, whose cost (`_cost`)
        fits `limit`, at least 1."""
        k = self.attention_context
        if not done and left <= self.long_prefill_tokens:
            return min(left, self.max_num_batched_tokens)   # a short prompt is not capped
        if not k or left <= 1:
            return max(1, min(left, int(limit)))
        # n^2 / (2k) + n (1 + done / k) <= limit - read, solved for n.
        b = 1 + done / k
        avail = max(0.0, limit - self._read_cost(done))
        n = int(k * (math.sqrt(b * b + 2 * avail / k) - b))
        return max(1, min(left, int(limit), n))

    def _read_cost(self, done: int) -> float:
        """What any chunk after `done` computed tokens costs for reading their keys."""
        return CHUNK_READ_COST * done / self.attention_context if self.attention_context else 0.0

    def _cost(self, n: int, done: int) -> float:
        """n prompt tokens after `done` computed ones, in tokens of the model without attention:
        n (1 + (done + n / 2) / attention_context), plus reading the context once."""
        k = self.attention_context
        return n * (1 + (done + n / 2) / k) + self._read_cost(done) if k else float(n)

    def _paced_chunk(self, sid: str, left: int, done: int, limit: int) -> int:
        """This step's chunk of a running prompt: capped, it earns `limit` a step and gets a
        chunk (0 tokens otherwise) once it has earned twice the chunk's reading cost, so the
        reading is at most half of what its chunks cost, and a step carries the cap on average."""
        if limit >= self.max_num_batched_tokens or not self.attention_context:
            self._credit.pop(sid, None)
            return self._chunk(left, done, limit)
        credit = self._credit.get(sid, 0.0) + limit
        if credit < 2 * self._read_cost(done):
            self._credit[sid] = credit
            return 0
        n = self._chunk(left, done, credit)
        self._credit[sid] = max(0.0, credit - self._cost(n, done))
        return n

    def _next_chunks(self, limit: int) -> dict[str, int]:
        """This step's chunk of each running sequence still being prefilled; moves them on.
        Uncapped, each gets up to `limit` (the whole budget). Capped, the step carries the
        cap once for each such prompt, pooled and given to the oldest first (the rest get
        nothing this step): small chunks for all would each read their whole context every
        step, and all would get their first token late; one bigger chunk reads one context
        once (docs/architecture.md, "Long prompts beside a decoding batch"). One long
        prompt beside a batch gets the cap."""
        chunks = {}
        total = {s.seq_id: s.num_tokens for s in self.running}
        self._credit = {s: c for s, c in self._credit.items() if s in self._prompt_left}
        capped = limit < self.max_num_batched_tokens
        pool = float(limit * len(self._prompt_left))
        for sid, left in list(self._prompt_left.items()):
            done = total.get(sid, left) - left
            if not capped:
                chunks[sid] = self._paced_chunk(sid, left, done, limit)
            elif pool < 1:
                chunks[sid] = 0                  # waits its turn, earning nothing
            else:
                share = min(pool, self.max_num_batched_tokens)
                chunks[sid] = self._paced_chunk(sid, left, done, share)
                # What it did not spend goes on to the next only once it is done: one still
                # being computed keeps its credit (the pace of a deep prompt's chunks).
                pool = pool - self._cost(chunks[sid], done) if chunks[sid] >= left else 0.0
            if left > chunks[sid]:
                self._prompt_left[sid] = left - chunks[sid]
            else:
                del self._prompt_left[sid]
        return chunks

    def _preempt(self) -> None:
        """Makes the running batch fit the KV cache for this step: the newest sequences go
        back to the front of the waiting queue (the model process frees their blocks)."""
        kv, victims = self.kv_budget, []
        if kv is None:
            return
        used = sum(kv.blocks(s) for s in self.running)
        while used > kv.num_blocks and len(self.running) > 1:
            seq = next((s for s in reversed(self.running) if self._movable(s)), None)
            if seq is None:   # (only where the backend preempts for itself: set_exact_resume)
                break
            self.running.remove(seq)
            used -= kv.blocks(seq)
            seq.state = SequenceState.WAITING
            seq.num_preemptions += 1
            self._free(seq)
            self._prompt_left.pop(seq.seq_id, None)
            victims.append(seq)
        for seq in victims:   # newest popped first: the oldest victim ends up in front
            self.waiting.appendleft(seq)
        self.stats.num_preemptions += len(victims)

    def update(self, out: SchedulerOutput, token_ids: dict[str, int]) -> list[Sequence]:
        """Appends each sequence's new token; returns the sequences that got one, in step
        order (whether it ends them is the output processor's call)."""
        got = []
        for seq in out.prefill:
            if seq.is_finished:   # aborted while its prefill ran: the model holds its cache
                self._free(seq)
            else:
                seq.state = SequenceState.RUNNING
                self.running.append(seq)
        self.stats.max_running = max(self.stats.max_running, len(self.running))
        for seq in out.prefill + out.decode:
            if seq.is_finished or seq.seq_id not in token_ids:
                continue
            self._prompt_left.pop(seq.seq_id, None)   # its prompt is all computed
            seq.append_token(token_ids[seq.seq_id])
            got.append(seq)
        return got

    def requeue(self, out: SchedulerOutput, interjected: SchedulerOutput | None = None
                ) -> list[Sequence]:
        """After the model process died: the running batch and the step's newcomers (and
        those interjected into it) go back to the front of the queue, keeping their output so
        far (the next prefill covers both)."""
        joining = out.prefill + (interjected.prefill if interjected else [])
        seqs = [s for s in dict.fromkeys(self.running + joining) if not s.is_finished]
        self.running = []
        self._prompt_left.clear()
        for seq in reversed(seqs):
            seq.state = SequenceState.WAITING
            self.waiting.appendleft(seq)
        self._freed = {}
        return seqs

    def _free(self, seq: Sequence) -> None:
        """The model process frees the sequence's cache at the next step; until then its
        blocks stay taken (interject counts them)."""
        self._freed[seq.seq_id] = self.kv_budget.blocks(seq) if self.kv_budget else 0

    def _remove(self, seq: Sequence) -> None:
        self._prompt_left.pop(seq.seq_id, None)
        if seq in self.running:
            self.running.remove(seq)
            self._free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # --- fair share across keys ------------------------------------------------------------------
    def _next_waiting(self, joining: list[Sequence]) -> Sequence:
        """The next newcomer, of the best priority waiting: the oldest waiting sequence of the
        key that holds the fewest slots (the oldest of all when one key waits, the usual
        case)."""
        best = min(s.priority for s in self.waiting)
        firsts: dict[str, Sequence] = {}
        for seq in self.waiting:
            if seq.priority == best:
                firsts.setdefault(seq.owner, seq)
        if len(firsts) == 1:
            return next(iter(firsts.values()))
        held = Counter(s.owner for s in self.running + joining)
        return min(firsts.values(), key=lambda s: held[s.owner])   # ties: the oldest

    def _preempt_for_priority(self) -> None:
        """A full batch makes room for what waits at a better priority than it runs: the newest
        running sequence of the worst priority gives up its slot, waits (keeping its tokens)
        and is prefilled again later, one per better-priority sequence waiting. So batch lines
        never hold every slot against interactive requests."""
        if not self.waiting or len(self.running) < self.max_num_seqs:
            return
        waiting = sorted(s.priority for s in self.waiting)
        for want in waiting:
            worst = max((s.priority for s in self.running if self._movable(s)), default=want)
            if want >= worst:
                return
            # First of its priority when its turn comes (the better ones still go first).
            self._give_up_slot(next(s for s in reversed(self.running)
                                    if s.priority == worst and self._movable(s)))

    def _preempt_for_fair_share(self) -> None:
        """A full batch makes room for waiting keys below their share: the key furthest above
        its share gives up its newest running sequence, which waits (keeping its tokens) and
        is prefilled again later from prompt and output, as vLLM preempts by recomputation.
        An idle service still gives one key everything: nobody waits, nobody is preempted.
        Only waiters of the best waiting priority count, and only against sequences of that
        priority or worse: the victim would otherwise be admitted again before the waiter (it
        is of a better priority), and be preempted again, every step."""
        if not self.waiting or len(self.running) < self.max_num_seqs:
            return
        best = min(s.priority for s in self.waiting)
        held = Counter(s.owner for s in self.running)
        wanting = Counter(s.owner for s in self.waiting if s.priority == best)
        for owner, num_waiting in wanting.items():
            for _ in range(min(num_waiting, self.key_cap - held[owner])):
                victim_owner, num_held = max(held.items(), key=lambda kv: kv[1])
                if num_held <= self.key_cap:
                    return
                victim = next((s for s in reversed(self.running)
                               if s.owner == victim_owner and s.priority >= best
                               and self._movable(s)), None)
                if victim is None:
                    return
                self._give_up_slot(victim)   # first of its key when its turn comes
                held[victim_owner] -= 1
                held[owner] += 1

    def _give_up_slot(self, victim: Sequence) -> None:
        """A running sequence waits again at the front of the queue, keeping its tokens; the
        model process drops its cache, and its next prefill covers prompt and output."""
        self.running.remove(victim)
        self._free(victim)
        self._prompt_left.pop(victim.seq_id, None)
        victim.state = SequenceState.WAITING
        victim.num_preemptions += 1         # llmq_num_preemptions_total counts it too
        self.waiting.appendleft(victim)
        self.stats.num_preempted += 1
