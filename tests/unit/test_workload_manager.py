"""The scheduler driven by hand: schedule() -> (model step) -> update(), with hand-made tokens.

update() appends tokens and ends nothing; the output processor decides which sequences a token
ends (`end_on_token`) and ends them through abort(). `step` plays both parts, as the engine."""
from __future__ import annotations

import pytest

from common.protocol import FinishReason
from worker.output_processor import end_on_token
from worker.sequence import SequenceState
from worker.workload_manager import (CHUNK_READ_COST, MAX_DECODE_PASSES, POLICIES,
                                     ContinuousBatching, SchedulerOutput, StaticBatching,
                                     WorkloadManager)

from .factories import EOS, ids, make_manager, make_seq, tokens_for


def end_what_stops(wm: WorkloadManager, got) -> list:
    """The output processor's part of a step: each sequence its new token ends leaves."""
    finished = []
    for seq in got:
        reason = end_on_token(seq)
        if reason is not None:
            wm.abort(seq, reason)
            finished.append(seq)
    return finished


def step(wm: WorkloadManager, token: int = 7, **overrides: int):
    """One full engine step: schedule, sample `token` for everyone, update, end what stops."""
    out = wm.schedule()
    return out, end_what_stops(wm, wm.update(out, tokens_for(out, token, **overrides)))


# --- admission -------------------------------------------------------------------------------
def test_admission_is_bounded_by_max_num_seqs_and_fifo():
    wm = make_manager(max_num_seqs=3)
    seqs = [make_seq(4) for _ in range(5)]
    for s in seqs:
        wm.add(s)
    out, _ = step(wm)
    assert ids(out.prefill) == ids(seqs[:3])
    assert out.decode == []
    assert ids(wm.waiting) == ids(seqs[3:])
    assert all(s.state is SequenceState.RUNNING for s in seqs[:3])
    assert all(s.state is SequenceState.WAITING for s in seqs[3:])
    # Full: the next step only decodes, nobody joins.
    out, _ = step(wm)
    assert out.prefill == [] and ids(out.decode) == ids(seqs[:3])
    assert wm.stats.max_running == 3


def test_token_budget_limits_prefill_per_step():
    wm = make_manager(max_num_batched_tokens=10)
    a, b, c = make_seq(4), make_seq(4), make_seq(4)
    for s in (a, b, c):
        wm.add(s)
    out = wm.schedule()
    assert ids(out.prefill) == ids([a, b])          # 4 + 4 fits, + 4 would be 12 > 10
    assert out.num_batched_tokens == 8
    wm.update(out, tokens_for(out))
    out = wm.schedule()
    # Two decodes use 2 tokens of the budget; c (4 prompt tokens + 0 output) fits in 8.
    assert ids(out.prefill) == [c.seq_id] and ids(out.decode) == ids([a, b])
    assert out.num_batched_tokens <= 10


def test_decodes_count_against_the_budget():
    wm = make_manager(max_num_batched_tokens=6)
    running = [make_seq(1) for _ in range(3)]
    for s in running:
        wm.add(s)
    step(wm)
    first, second = make_seq(2), make_seq(2)       # 3 decodes + 2 = 5 fits; + 2 = 7 > 6
    wm.add(first)
    wm.add(second)
    out, _ = step(wm)
    assert ids(out.prefill) == [first.seq_id] and len(out.decode) == 3
    assert list(wm.waiting) == [second]


def test_prompt_bigger_than_whole_budget_runs_alone():
    wm = make_manager(max_num_batched_tokens=8)
    big, small = make_seq(50), make_seq(2)
    wm.add(big)
    wm.add(small)
    out = wm.schedule()
    assert ids(out.prefill) == [big.seq_id]          # alone, despite 50 > 8
    assert ids(wm.waiting) == [small.seq_id]
    wm.update(out, tokens_for(out))
    out = wm.schedule()
    assert ids(out.prefill) == [small.seq_id] and ids(out.decode) == [big.seq_id]


def test_big_prompt_joins_the_running_batch_without_waiting_for_it_to_drain():
    wm = make_manager(max_num_batched_tokens=8)
    running = [make_seq(2, max_tokens=100) for _ in range(4)]
    for s in running:
        wm.add(s)
    step(wm)
    big, small = make_seq(50), make_seq(1)
    wm.add(big)
    wm.add(small)
    out, _ = step(wm)                                # 4 decodes leave 4 tokens: big runs alone
    assert ids(out.prefill) == [big.seq_id] and ids(out.decode) == ids(running)
    out, _ = step(wm)                                # and small follows at the next step
    assert ids(out.prefill) == [small.seq_id] and len(out.decode) == 5


def test_every_step_admits_a_newcomer_while_slots_are_free():
    # Even with the whole budget taken by decodes, the queue moves one sequence per step,
    # so no prompt waits for the batch to drain.
    wm = make_manager(max_num_seqs=8, max_num_batched_tokens=4)
    for _ in range(8):
        wm.add(make_seq(3, max_tokens=100))
    admitted = [len(step(wm)[0].prefill) for _ in range(6)]
    assert admitted == [1, 1, 1, 1, 1, 1] and len(wm.running) == 6


def model_tokens(wm: WorkloadManager, out, token: int = 7) -> dict[str, int]:
    """What the model process answers: no token for a sequence whose prompt it is still
    computing in chunks (the scheduler's mirror of it: still in wm._prompt_left)."""
    return {sid: t for sid, t in tokens_for(out, token).items() if sid not in wm._prompt_left}


def test_a_long_prompts_next_chunks_take_the_budget_of_the_steps_after_it_joined():
    wm = make_manager(max_num_batched_tokens=8)
    big = make_seq(20)
    wm.add(big)
    out = wm.schedule()                              # chunk 1 of 20 -> 8 tokens
    assert ids(out.prefill) == [big.seq_id] and out.chunks == {}
    end_what_stops(wm, wm.update(out, model_tokens(wm, out)))
    assert big.output_token_ids == []
    a, b = make_seq(3), make_seq(3)
    wm.add(a)
    wm.add(b)
    out = wm.schedule()                              # chunk 2 (8 tokens) fills the step:
    assert out.chunks == {big.seq_id: 8}             # one newcomer only (at least one per step)
    assert ids(out.prefill) == [a.seq_id] and ids(out.decode) == [big.seq_id]
    assert out.num_batched_tokens == 8 + 3
    end_what_stops(wm, wm.update(out, model_tokens(wm, out)))
    out = wm.schedule()                              # the last chunk (4) + a's decode leave 3
    assert out.chunks == {big.seq_id: 4} and ids(out.prefill) == [b.seq_id]
    assert out.num_batched_tokens == 4 + 1 + 3 == 8
    end_what_stops(wm, wm.update(out, model_tokens(wm, out)))
    assert big.output_token_ids == [7]               # its first token, from the last chunk
    out = wm.schedule()
    assert out.chunks == {} and out.num_batched_tokens == 3


def test_a_wave_of_newcomers_is_spread_over_steps_while_the_joined_ones_decode():
    wm = make_manager(max_num_batched_tokens=16)
    wave = [make_seq(4, max_tokens=50) for _ in range(10)]
    for s in wave:
        wm.add(s)
    joined = []
    for _ in range(4):
        out = wm.schedule()
        assert ids(out.decode) == ids(joined)        # every joined one steps every step
        assert out.num_batched_tokens <= 16
        joined += out.prefill
        end_what_stops(wm, wm.update(out, model_tokens(wm, out)))
    assert [len(s.output_token_ids) for s in wave] == [4, 4, 4, 4, 3, 3, 3, 2, 2, 1]


def test_a_chunked_prompt_leaves_the_count_when_it_is_aborted_or_gets_its_token_early():
    wm = make_manager(max_num_batched_tokens=8)
    big, other = make_seq(30), make_seq(30)
    wm.add(big)
    end_what_stops(wm, wm.update(out := wm.schedule(), model_tokens(wm, out)))
    wm.abort(big, FinishReason.CANCELLED)
    wm.add(other)
    end_what_stops(wm, wm.update(out := wm.schedule(), model_tokens(wm, out)))
    out = wm.schedule()
    assert out.chunks == {other.seq_id: 8}
    wm.update(out, tokens_for(out))                  # its token came early (a cached prefix)
    assert wm.schedule().chunks == {}


def test_a_long_prompt_gets_the_capped_chunk_per_step_while_the_batch_decodes():
    wm = make_manager(max_num_batched_tokens=16, long_prefill_tokens=4)
    running = [make_seq(2, max_tokens=100) for _ in range(2)]
    for s in running:
        wm.add(s)
    step(wm)
    big = make_seq(14)
    wm.add(big)
    out = wm.schedule()
    assert ids(out.prefill) == [big.seq_id] and out.first_chunks == {big.seq_id: 4}
    assert out.prompt_chunks == {big.seq_id: 4} and out.num_batched_tokens == 2 + 4
    sizes = []
    while not big.output_token_ids:
        end_what_stops(wm, wm.update(out, model_tokens(wm, out)))
        out = wm.schedule()
        sizes.append(out.prompt_chunks.get(big.seq_id))
        assert out.num_batched_tokens <= 2 + 4       # every step grows by the cap at most
    assert sizes == [4, 4, 2, None]                  # 14 = 4 + 4 + 4 + 2, then it decodes


def test_long_prompts_in_flight_pool_their_caps_and_the_oldest_goes_first():
    """Two long prompts beside a decoding batch: the step carries the cap once for each, and
    all of it goes to the older one (one context read a step, not two), which
    gets its first token in half the steps; the younger takes the pool once it is done."""
    cap = 4
    wm = make_manager(max_num_batched_tokens=64, long_prefill_tokens=cap)
    running = make_seq(2, max_tokens=100)
    wm.add(running)
    step(wm)
    older, younger = make_seq(20), make_seq(20)
    wm.add(older)
    wm.add(younger)
    out = wm.schedule()
    assert out.first_chunks == {older.seq_id: cap, younger.seq_id: cap}
    chunks, first_token = [], {}
    while not younger.output_token_ids:
        end_what_stops(wm, wm.update(out, model_tokens(wm, out)))
        for seq in (older, younger):
            if seq.output_token_ids:
                first_token.setdefault(seq.seq_id, len(chunks))
        out = wm.schedule()
        chunks.append((out.chunks.get(older.seq_id), out.chunks.get(younger.seq_id)))
        assert sum(out.chunks.values()) <= cap * len(out.chunks)   # the cap per prompt
    assert chunks[:2] == [(2 * cap, 0), (2 * cap, 0)]   # 16 left: two steps of both caps
    assert first_token[older.seq_id] == 2                # (each alone at the cap: 4 steps)
    assert [y for _o, y in chunks[2:] if y] == [cap] * 4  # then the younger, at its own cap


def test_a_prompt_with_prompt_logprobs_is_chunked_like_any_other():
    """Prompt logprobs exempt a prompt from nothing: its 2,000 tokens go in capped chunks
    beside the decoding batch (the model process scores each chunk's positions as it goes)."""
    wm = make_manager(max_num_batched_tokens=2048, long_prefill_tokens=256)
    running = make_seq(2, max_tokens=100)
    wm.add(running)
    step(wm)
    scored = make_seq(2000)
    scored.params.prompt_logprobs = 5
    wm.add(scored)
    out, sizes = wm.schedule(), []
    while not scored.output_token_ids:
        sizes.append(out.prompt_chunks.get(scored.seq_id, 0))
        assert out.num_batched_tokens <= 1 + 256
        end_what_stops(wm, wm.update(out, model_tokens(wm, out)))
        out = wm.schedule()
    assert sum(sizes) == 2000 and max(sizes) == 256 and len(sizes) == 8


def test_a_long_prompt_alone_gets_the_whole_budget_and_the_cap_lifts_when_decodes_end():
    wm = make_manager(max_num_batched_tokens=16, long_prefill_tokens=4)
    big = make_seq(40)
    wm.add(big)
    out = wm.schedule()
    assert out.first_chunks == {big.seq_id: 16}      # nothing else in the step: no cap
    end_what_stops(wm, wm.update(out, model_tokens(wm, out)))
    short = make_seq(2, max_tokens=2)
    wm.add(short)                                    # a short one waits: the chunk is capped
    out = wm.schedule()
    assert ids(out.prefill) == [short.seq_id] and out.chunks == {big.seq_id: 4}
    end_what_stops(wm, wm.update(out, model_tokens(wm, out)))
    out = wm.schedule()                              # short decodes: still capped
    assert out.chunks == {big.seq_id: 4}
    end_what_stops(wm, wm.update(out, model_tokens(wm, out)))
    assert short.is_finished
    out = wm.schedule()                              # alone again: the rest in one chunk
    assert out.chunks == {big.seq_id: 40 - 16 - 4 - 4}


def test_short_newcomers_join_beside_a_long_newcomer_whose_chunk_is_capped():
    wm = make_manager(max_num_batched_tokens=16, long_prefill_tokens=4)
    big, a, b = make_seq(40), make_seq(3), make_seq(3)
    for s in (big, a, b):
        wm.add(s)
    out = wm.schedule()
    assert ids(out.prefill) == ids([big, a, b]) and out.first_chunks == {big.seq_id: 4}
    assert out.num_batched_tokens == 4 + 3 + 3


def test_a_wave_of_short_prompts_is_not_capped():
    wm = make_manager(max_num_batched_tokens=64, long_prefill_tokens=8, long_prefill_chunk=2,
                      attention_context=4)
    running = make_seq(2, max_tokens=100)
    wm.add(running)
    step(wm)
    wave = [make_seq(8) for _ in range(6)]           # at the threshold: not long
    for s in wave:
        wm.add(s)
    out = wm.schedule()
    assert ids(out.prefill) == ids(wave) and out.prompt_chunks == {}
    assert out.num_batched_tokens == 1 + 6 * 8
    big = make_seq(9)                                # one more token: long, 2 per step at most
    wm.add(big)
    end_what_stops(wm, wm.update(out, model_tokens(wm, out)))
    out = wm.schedule()
    assert 1 <= out.first_chunks[big.seq_id] <= 2


def test_a_long_prompts_chunks_shrink_with_the_context_they_attend_over():
    k, cap = 8, 8
    wm = make_manager(max_num_batched_tokens=64, long_prefill_tokens=cap, attention_context=k)
    running = make_seq(2, max_tokens=200)
    wm.add(running)
    step(wm)
    big, short = make_seq(60), make_seq(cap)
    wm.add(big)
    wm.add(short)
    out = wm.schedule()
    assert out.first_chunks[big.seq_id] < cap        # its own causal attention counts too
    assert short.seq_id not in out.prompt_chunks     # a prompt at the cap goes whole
    per_token = []
    for done, n in paced_chunks(wm, out, big):
        if n:
            per_token.append(n * (1 + (done + n / 2) / k) / n)
    assert per_token == sorted(per_token)            # each token costs more, deeper in


def paced_chunks(wm, out, seq) -> list[tuple[int, int]]:
    """(tokens computed before, chunk) of each step until `seq` has its first token."""
    steps, done = [], 0
    while not seq.output_token_ids:
        n = out.prompt_chunks.get(seq.seq_id, 0)
        steps.append((done, n))
        done += n
        end_what_stops(wm, wm.update(out, model_tokens(wm, out)))
        out = wm.schedule()
    assert done == seq.num_prompt_tokens
    return steps


def test_deep_into_a_long_prompt_a_chunk_comes_every_few_steps_at_the_caps_average_cost():
    """Any chunk reads its whole context once: deep in, that alone costs more than a step's
    cap, so the prompt gets a chunk only every few steps, and the decodes' steps carry the cap
    on average, not one deep chunk each."""
    k, cap = 8, 8
    wm = make_manager(max_num_batched_tokens=64, long_prefill_tokens=cap, attention_context=k)
    running = make_seq(2, max_tokens=500)
    wm.add(running)
    step(wm)
    big = make_seq(60)
    wm.add(big)
    steps = paced_chunks(wm, wm.schedule(), big)
    read = lambda done: CHUNK_READ_COST * done / k                      # noqa: E731
    cost = lambda done, n: n * (1 + (done + n / 2) / k) + read(done)    # noqa: E731
    spent = 0.0
    for i, (done, n) in enumerate(steps, 1):
        spent += cost(done, n) if n else 0.0
        assert spent <= cap * i + 1e-9                  # never more than the cap a step
        if n and done and i < len(steps):               # (the last is what the prompt has left)
            assert cost(done, n + 1) > 2 * read(done)   # it waited to earn twice its reading
    gaps = [n for _d, n in steps[1:]]
    assert 0 in gaps and len(steps) > 2 * sum(1 for n in gaps if n)   # mostly steps without


def test_a_long_prompt_alone_is_weighted_against_the_whole_budget():
    wm = make_manager(max_num_batched_tokens=64, long_prefill_tokens=8, attention_context=32)
    big = make_seq(400)
    wm.add(big)
    out, sizes, done = wm.schedule(), [], 0
    while not big.output_token_ids:
        n = out.prompt_chunks[big.seq_id]
        assert n * (1 + (done + n / 2) / 32) <= 64       # not the cap of 8: nothing decodes
        sizes.append(n)
        done += n
        end_what_stops(wm, wm.update(out, model_tokens(wm, out)))
        out = wm.schedule()
    assert sum(sizes) == 400 and sizes[0] > 8 and sizes[0] > sizes[-2]


def test_fifo_is_kept_even_when_a_later_prompt_would_fit():
    wm = make_manager(max_num_batched_tokens=10)
    a, big, small = make_seq(6), make_seq(8), make_seq(1)
    for s in (a, big, small):
        wm.add(s)
    out = wm.schedule()
    # big does not fit after a; small would, but it must not overtake big.
    assert ids(out.prefill) == [a.seq_id]
    assert ids(wm.waiting) == ids([big, small])


def test_requeued_sequence_prefill_counts_its_output_tokens():
    wm = make_manager(max_num_batched_tokens=10)
    a = make_seq(4)
    wm.add(a)
    out, _ = step(wm)
    for _ in range(4):
        step(wm)
    assert a.num_output_tokens == 5
    wm.requeue(wm.schedule())
    b = make_seq(2)
    wm.add(b)
    out = wm.schedule()
    assert ids(out.prefill) == [a.seq_id] and out.num_batched_tokens == 9   # 4 prompt + 5 out
    assert list(wm.waiting) == [b]                                          # 9 + 2 > 10


# --- joining and leaving the batch -----------------------------------------------------------
def test_newcomer_joins_running_batch_at_next_step():
    wm = make_manager()
    a = make_seq(3, max_tokens=100)
    wm.add(a)
    step(wm)
    assert wm.stats.num_joined_running_batch == 0
    b = make_seq(3)
    wm.add(b)
    out, _ = step(wm)
    assert ids(out.prefill) == [b.seq_id] and ids(out.decode) == [a.seq_id]
    assert wm.stats.num_joined_running_batch == 1
    assert wm.stats.num_prefilled == 2
    out, _ = step(wm)
    assert ids(out.decode) == ids([a, b])            # both decode together now
    assert wm.stats.max_running == 2
    assert wm.stats.num_steps == 3


def test_finished_sequence_leaves_at_once_and_frees_its_slot():
    wm = make_manager(max_num_seqs=1)
    a, b = make_seq(2), make_seq(2)
    wm.add(a)
    wm.add(b)
    out, finished = step(wm, token=EOS)              # a's first token is EOS
    assert finished == [a] and a.finish_reason is FinishReason.STOP
    assert a not in wm.running and a.is_finished
    out = wm.schedule()
    assert out.freed_seq_ids == [a.seq_id]           # the model frees a's cache
    assert ids(out.prefill) == [b.seq_id]            # and b takes the slot this very step
    wm.update(out, tokens_for(out))
    assert wm.schedule().freed_seq_ids == []         # reported once


def test_finish_on_max_tokens_in_the_step():
    wm = make_manager()
    a = make_seq(2, max_tokens=3)
    wm.add(a)
    results = [step(wm)[1] for _ in range(3)]
    assert results[:2] == [[], []] and results[2] == [a]
    assert a.output_token_ids == [7, 7, 7] and a.finish_reason is FinishReason.LENGTH
    assert wm.num_unfinished == 0


def test_update_appends_and_ends_nothing():
    """Even a stop token or the last allowed token leaves the sequence running until the
    output processor ends it: the scheduler decides no end."""
    wm = make_manager()
    a, b = make_seq(2, max_tokens=1), make_seq(2)
    wm.add(a)
    wm.add(b)
    out = wm.schedule()
    got = wm.update(out, tokens_for(out, 5, **{b.seq_id: EOS}))
    assert got == [a, b] and not a.is_finished and not b.is_finished
    assert ids(wm.running) == ids([a, b]) and b.output_token_ids == [EOS]
    wm.abort(b, FinishReason.STOP)                   # the output processor's call
    assert ids(wm.running) == [a.seq_id] and wm.schedule().freed_seq_ids == [b.seq_id]


def test_only_sequences_with_a_token_advance():
    wm = make_manager()
    a, b = make_seq(2), make_seq(2)
    wm.add(a)
    wm.add(b)
    out = wm.schedule()
    got = wm.update(out, {a.seq_id: 5})              # b errored / got no token this step
    assert got == [a] and a.output_token_ids == [5] and b.output_token_ids == []
    assert ids(wm.running) == ids([a, b])


# --- abort -----------------------------------------------------------------------------------
def test_abort_waiting_sequence():
    wm = make_manager(max_num_seqs=1)
    a, b = make_seq(2), make_seq(2)
    wm.add(a)
    wm.add(b)
    step(wm)
    wm.abort(b, FinishReason.CANCELLED)
    assert b.is_finished and b.finish_reason is FinishReason.CANCELLED
    assert list(wm.waiting) == []
    out = wm.schedule()
    assert out.freed_seq_ids == []                   # never reached the model: nothing to free
    assert b not in out.prefill


def test_abort_running_sequence_frees_it_next_step():
    wm = make_manager()
    a, b = make_seq(2), make_seq(2)
    wm.add(a)
    wm.add(b)
    step(wm)
    wm.abort(a, FinishReason.CANCELLED)
    assert ids(wm.running) == [b.seq_id]
    out = wm.schedule()
    assert out.freed_seq_ids == [a.seq_id] and ids(out.decode) == [b.seq_id]


def test_abort_while_decode_in_flight_ignores_its_token():
    wm = make_manager()
    a = make_seq(2)
    wm.add(a)
    step(wm)
    out = wm.schedule()                              # a decodes in this step...
    wm.abort(a, FinishReason.CANCELLED)              # ...and is cancelled meanwhile
    got = wm.update(out, tokens_for(out, 9))
    assert got == [] and a.output_token_ids == [7]
    assert a.finish_reason is FinishReason.CANCELLED
    assert wm.schedule().freed_seq_ids == [a.seq_id]


def test_abort_while_prefill_in_flight_is_freed_after_update():
    wm = make_manager()
    a, b = make_seq(2), make_seq(2)
    wm.add(a)
    wm.add(b)
    out = wm.schedule()
    wm.abort(a, FinishReason.CANCELLED)              # in neither queue: its prefill is running
    assert a.is_finished
    got = wm.update(out, tokens_for(out))
    assert got == [b] and a.output_token_ids == []
    assert a not in wm.running and ids(wm.running) == [b.seq_id]
    assert wm.num_unfinished == 1
    nxt = wm.schedule()
    assert nxt.freed_seq_ids == [a.seq_id]           # the model holds its cache: free it
    assert ids(nxt.decode) == [b.seq_id]


def test_abort_twice_frees_once():
    wm = make_manager()
    a = make_seq(2)
    wm.add(a)
    step(wm)
    wm.abort(a, FinishReason.CANCELLED)
    wm.abort(a, FinishReason.ERROR, "late")
    assert a.finish_reason is FinishReason.CANCELLED and a.error is None
    assert wm.schedule().freed_seq_ids == [a.seq_id]


def test_abort_with_error_records_it():
    wm = make_manager()
    a = make_seq(2)
    wm.add(a)
    wm.abort(a, FinishReason.ERROR, "boom")
    assert (a.finish_reason, a.error) == (FinishReason.ERROR, "boom")
    assert wm.num_unfinished == 0


# --- no starvation ---------------------------------------------------------------------------
def test_long_running_sequence_does_not_block_waiting_ones():
    wm = make_manager(max_num_seqs=2)
    long = make_seq(2, max_tokens=1000)
    wm.add(long)
    step(wm)
    shorts = [make_seq(2, max_tokens=2) for _ in range(3)]
    for s in shorts:
        wm.add(s)
    done = []
    for _ in range(20):
        before = list(wm.running)
        out, finished = step(wm)
        assert ids(out.decode) == ids(before)        # everyone running decodes every step
        assert long in out.decode
        done += finished
        if len(done) == 3:
            break
    assert done == shorts                            # all served, in order, while long runs
    assert not long.is_finished


def test_every_running_sequence_decodes_every_step():
    wm = make_manager(max_num_seqs=4)
    seqs = [make_seq(2, max_tokens=50) for _ in range(4)]
    for s in seqs:
        wm.add(s)
    for n in range(1, 11):
        step(wm)
        assert [s.num_output_tokens for s in seqs] == [n] * 4


# --- policies --------------------------------------------------------------------------------
def test_static_batching_admits_only_when_batch_is_empty():
    wm = make_manager(policy=StaticBatching())
    a = make_seq(2, max_tokens=2)
    b = make_seq(2, max_tokens=3)
    wm.add(a)
    wm.add(b)
    out, _ = step(wm)
    assert ids(out.prefill) == ids([a, b])
    c = make_seq(2, max_tokens=1)
    wm.add(c)
    out, finished = step(wm)                         # a finishes, but b still runs
    assert out.prefill == [] and finished == [a]
    out, finished = step(wm)                         # c still waits for b
    assert out.prefill == [] and finished == [b]
    out, _ = step(wm)
    assert ids(out.prefill) == [c.seq_id]
    assert wm.stats.num_joined_running_batch == 0


def test_continuous_batching_is_the_default_and_policies_are_registered():
    assert isinstance(make_manager().policy, ContinuousBatching)
    assert POLICIES == {"continuous": ContinuousBatching, "static": StaticBatching}
    assert StaticBatching().may_admit(0) and not StaticBatching().may_admit(1)
    assert ContinuousBatching().may_admit(63)


# --- requeue after a model crash -------------------------------------------------------------
def test_requeue_keeps_outputs_and_puts_sequences_at_front():
    wm = make_manager()
    a, b = make_seq(2), make_seq(2)
    wm.add(a)
    wm.add(b)
    step(wm, 11)
    step(wm, 12)
    c = make_seq(2)
    d = make_seq(2)
    wm.add(c)
    out = wm.schedule()                              # c joins; the model dies in this step
    wm.add(d)
    wm.abort(b, FinishReason.CANCELLED)              # its cache is gone anyway
    seqs = wm.requeue(out)
    assert ids(seqs) == ids([a, c])
    assert ids(wm.waiting) == ids([a, c, d])         # at the front, d stays behind them
    assert wm.running == []
    assert a.output_token_ids == [11, 12] and a.state is SequenceState.WAITING
    out = wm.schedule()
    assert out.freed_seq_ids == []                   # the new model process holds nothing
    assert ids(out.prefill) == ids([a, c, d])
    wm.update(out, tokens_for(out, 13))
    assert a.output_token_ids == [11, 12, 13]


def test_a_step_answered_in_two_pieces_updates_newcomers_first():
    """The model process sends the newcomers' first tokens ahead of the running batch's: the
    engine updates the two parts of the step one after the other."""
    wm = make_manager()
    a, b = make_seq(2, max_tokens=100), make_seq(2, max_tokens=100)
    wm.add(a)
    step(wm, 11)
    wm.add(b)
    out = wm.schedule()
    joined, rest = out.split({b.seq_id})
    assert ids(joined.prefill) == [b.seq_id] and joined.decode == []
    assert ids(rest.decode) == [a.seq_id] and rest.prefill == []
    wm.update(joined, {b.seq_id: 21})
    assert b.output_token_ids == [21] and a.output_token_ids == [11]
    assert ids(wm.running) == ids([a, b])
    # The model dies before the rest arrives: each sequence goes back once, with its tokens.
    seqs = wm.requeue(rest)
    assert ids(seqs) == ids([a, b]) and ids(wm.waiting) == ids([a, b])
    assert b.output_token_ids == [21]


def test_a_step_answered_pass_by_pass_updates_each_newcomer_once():
    """Newcomers prefilled in several passes are answered a pass at a time: each partial takes
    the newcomers it answers out of the step, the last piece holds the rest and the batch."""
    wm = make_manager()
    a = make_seq(2, max_tokens=100)
    wm.add(a)
    step(wm, 11)
    b, c, d = (make_seq(2, max_tokens=100) for _ in range(3))
    for s in (b, c, d):
        wm.add(s)
    out = wm.schedule()
    first, out = out.split({b.seq_id})
    second, out = out.split({c.seq_id})
    assert [ids(first.prefill), ids(second.prefill), ids(out.prefill)] == [
        [b.seq_id], [c.seq_id], [d.seq_id]]
    assert ids(out.decode) == [a.seq_id] and first.decode == second.decode == []
    wm.update(first, {b.seq_id: 21})
    wm.update(second, {c.seq_id: 31})
    wm.update(out, {d.seq_id: 41, a.seq_id: 12})
    assert [s.output_token_ids for s in (a, b, c, d)] == [[11, 12], [21], [31], [41]]
    assert ids(wm.running) == ids([a, b, c, d])


def test_requeue_of_empty_output_is_harmless():
    wm = make_manager()
    out = wm.requeue(SchedulerOutput())
    assert out == [] and wm.num_unfinished == 0
    assert wm.schedule().is_empty


def test_scheduler_output_accounting():
    a, b = make_seq(5), make_seq(3)
    a.output_token_ids = [1, 2]
    out = SchedulerOutput(prefill=[a], decode=[b])
    assert out.num_batched_tokens == 7 + 1 and not out.is_empty
    assert SchedulerOutput().is_empty


@pytest.mark.parametrize("max_num_seqs", [1, 2, 5])
def test_running_never_exceeds_max_num_seqs(max_num_seqs):
    wm = make_manager(max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    seqs = [make_seq(1 + i % 4, max_tokens=1 + i % 3) for i in range(12)]
    for s in seqs:
        wm.add(s)
    finished = []
    for _ in range(100):
        if not wm.num_unfinished:
            break
        out, f = step(wm)
        assert len(out.prefill) + len(out.decode) <= max_num_seqs
        assert len(wm.running) <= max_num_seqs
        finished += f
    assert sorted(ids(finished)) == sorted(ids(seqs))
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)


# --- fair share across keys (docs/security.md) -----------------------------------------------
def made(n: int, n_prompt: int = 4, **attrs) -> list:
    """n sequences with these attributes set (owner, priority)."""
    seqs = [make_seq(n_prompt) for _ in range(n)]
    for s in seqs:
        for k, v in attrs.items():
            setattr(s, k, v)
    return seqs


def keyed(owner: str, n: int, n_prompt: int = 4) -> list:
    return made(n, n_prompt, owner=owner)


def test_one_key_alone_gets_the_whole_batch():
    wm = make_manager(max_num_seqs=4)
    wm.key_cap = 2
    for s in keyed("b", 6):
        wm.add(s)
    step(wm)
    out, _ = step(wm)
    assert len(wm.running) == 4 and out.prefill == [] and wm.stats.num_preempted == 0


def test_a_waiting_key_below_its_share_takes_the_newest_slot_of_the_key_above_it():
    wm = make_manager(max_num_seqs=4, policy=None)
    wm.key_cap = 2
    flood = keyed("b", 6)
    for s in flood:
        wm.add(s)
    step(wm)
    step(wm)                                         # b holds all 4 slots, 2 tokens each
    [a] = keyed("a", 1)
    wm.add(a)
    out, _ = step(wm)
    assert ids(out.prefill) == [a.seq_id]            # the very next step
    assert flood[3].seq_id in out.freed_seq_ids      # b's newest left; its cache is freed
    assert ids(out.decode) == ids(flood[:3])
    assert flood[3].state is SequenceState.WAITING and wm.waiting[0] is flood[3]
    assert flood[3].num_output_tokens == 2           # it keeps what it generated
    assert wm.stats.num_preempted == 1


def test_a_key_waiting_at_a_worse_priority_takes_no_slot_from_a_better_one():
    """Key a's interactive sequences (priority 0) hold the batch; key b's batch line (9)
    waits. b is below its share, but preempting a's newest would only see it admitted again
    first (its priority is better) and preempted again, every step: it runs on instead."""
    wm = make_manager(max_num_seqs=2)
    wm.key_cap = 1
    a = keyed("a", 2)
    for s in a:
        s.priority = 0
        wm.add(s)
    step(wm)
    [b] = keyed("b", 1)
    b.priority = 9
    wm.add(b)
    for _ in range(4):
        out, _ = step(wm)
        assert out.freed_seq_ids == [] and out.prefill == []
    assert wm.stats.num_preempted == 0 and a[1].num_output_tokens == 5
    wm.abort(a[0], FinishReason.CANCELLED)            # a free slot: b is admitted
    out, _ = step(wm)
    assert ids(out.prefill) == [b.seq_id]


def test_keys_share_the_batch_then_the_preempted_sequence_resumes_from_its_tokens():
    wm = make_manager(max_num_seqs=4)
    wm.key_cap = 2
    flood = keyed("b", 4)
    for s in flood:
        wm.add(s)
    step(wm)
    others = keyed("a", 3)
    for s in others:
        wm.add(s)
    out, _ = step(wm)
    # a may hold its share (2) while b waits; its third sequence waits for a free slot.
    assert ids(out.prefill) == ids(others[:2]) and ids(out.decode) == ids(flood[:2])
    assert sorted(s.owner for s in wm.running) == ["a", "a", "b", "b"]
    step(wm)
    assert wm.stats.num_preempted == 2               # a at its share: nobody else moves
    # b's first sequence ends: the freed slot goes to the key holding fewer (a: 2, b: 1 -> b).
    wm.abort(flood[0], FinishReason.CANCELLED)
    out = wm.schedule()
    [resumed] = out.prefill
    assert resumed.owner == "b" and resumed.num_output_tokens == 1
    assert resumed.num_tokens == 5                   # prompt and output prefilled again


def test_one_owner_keeps_fifo_order():
    wm = make_manager(max_num_seqs=2)
    seqs = keyed("", 4)
    for s in seqs:
        wm.add(s)
    out, _ = step(wm)
    assert ids(out.prefill) == ids(seqs[:2]) and ids(wm.waiting) == ids(seqs[2:])


# --- the KV cache budget (blocks of 4 tokens) ---------------------------------------------------
def kv_manager(num_blocks: int, **kw) -> WorkloadManager:
    wm = make_manager(**kw)
    wm.set_kv_budget(num_blocks, 4)
    return wm


def blocks_in_use(wm: WorkloadManager) -> int:
    return sum(wm.kv_budget.blocks(s) for s in wm.running)


def test_admission_counts_free_blocks_not_rows():
    wm = kv_manager(10)
    seqs = [make_seq(11) for _ in range(4)]               # 3 blocks each, with a first token
    for s in seqs:
        wm.add(s)
    out, _ = step(wm)
    assert ids(out.prefill) == ids(seqs[:3]) and ids(wm.waiting) == [seqs[3].seq_id]
    assert blocks_in_use(wm) == 9
    # A short one behind it does not jump the queue (FIFO), though it would fit.
    wm.add(make_seq(2))
    out, _ = step(wm)
    assert out.prefill == [] and ids(out.decode) == ids(seqs[:3])


def test_running_out_of_blocks_mid_decode_preempts_the_newest():
    wm = kv_manager(7)
    a, b, c = make_seq(8, max_tokens=20), make_seq(8, max_tokens=20), make_seq(3, max_tokens=20)
    for s in (a, b, c):
        wm.add(s)
    while True:
        out = wm.schedule()
        # What the step computes always fits: 2 + 2 + 1 blocks, then 3 + 3 + 1, then ...
        assert sum(wm.kv_budget.blocks(s) for s in out.decode + out.prefill) <= 7
        if wm.stats.num_preemptions:
            break
        wm.update(out, tokens_for(out))
    # ... a and b reach their third blocks and c its second (3 + 3 + 2 > 7): c, the newest,
    # goes back to the front of the queue and the model process frees it in this very step.
    assert ids(out.decode) == ids([a, b]) and out.prefill == []
    assert out.freed_seq_ids == [c.seq_id]
    assert list(wm.waiting) == [c] and c.state is SequenceState.WAITING
    assert c.num_preemptions == 1 and c.output_token_ids == [7, 7]
    wm.update(out, tokens_for(out))
    out, _ = step(wm)
    assert out.prefill == [] and list(wm.waiting) == [c]   # 3 + 3 + 2 still too many
    # Blocks free again: it comes back, output kept; its prefill covers prompt and output.
    wm.abort(a, FinishReason.STOP)
    out = wm.schedule()
    assert ids(out.prefill) == [c.seq_id] and out.num_batched_tokens == 1 + 5


def test_several_preempted_keep_their_order_at_the_front_of_the_queue():
    wm = kv_manager(5)
    a, b = make_seq(7, max_tokens=20), make_seq(7, max_tokens=20)   # 2 blocks each
    wm.add(a)
    wm.add(b)
    step(wm)
    newcomer, later = make_seq(1, max_tokens=20), make_seq(1)
    wm.add(newcomer)
    wm.add(later)
    out, _ = step(wm)                                     # 2 + 2 + 1 = 5: the newcomer fits
    assert ids(out.prefill) == [newcomer.seq_id]
    out = wm.schedule()                                   # 3 + 3 + 1 > 5: two must go
    assert wm.stats.num_preemptions == 2 and ids(out.decode) == [a.seq_id]
    assert ids(wm.waiting) == ids([b, newcomer, later]) and out.prefill == []
    assert sorted(out.freed_seq_ids) == sorted(ids([b, newcomer]))


def test_the_oldest_sequence_is_never_preempted():
    wm = kv_manager(2)
    a = make_seq(7, max_tokens=3)
    wm.add(a)
    for _ in range(3):
        out, finished = step(wm)
    assert finished == [a] and wm.stats.num_preemptions == 0


def test_a_prompt_bigger_than_the_whole_cache_goes_alone_to_be_refused():
    wm = kv_manager(2)
    small, huge, after = make_seq(4, max_tokens=2), make_seq(9), make_seq(4)
    for s in (small, huge, after):
        wm.add(s)
    out, _ = step(wm)
    assert ids(out.prefill) == [small.seq_id]             # huge waits for an empty batch
    out, finished = step(wm)
    assert out.prefill == [] and finished == [small]
    out = wm.schedule()
    assert ids(out.prefill) == [huge.seq_id] and out.decode == []
    wm.abort(huge, FinishReason.ERROR, "longer than the context")   # what the model answers
    wm.update(out, {})
    out, _ = step(wm)
    assert ids(out.prefill) == [after.seq_id]


def test_without_a_budget_blocks_are_not_counted():
    wm = make_manager(max_num_seqs=4, max_num_batched_tokens=8000)
    wm.set_kv_budget(0, 0)
    for _ in range(4):
        wm.add(make_seq(1000))
    out, _ = step(wm)
    assert len(out.prefill) == 4 and wm.kv_budget is None


def test_preemptions_reach_the_metrics_when_the_sequence_finishes():
    import fakeredis

    from common import metrics

    wm = kv_manager(3)
    old, new = make_seq(4, max_tokens=6), make_seq(4, max_tokens=6)
    wm.add(old)
    wm.add(new)
    finished = []
    for _ in range(30):
        if not wm.num_unfinished:
            break
        finished += step(wm)[1]
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    assert wm.stats.num_preemptions == new.num_preemptions and len(finished) == 2
    r = fakeredis.FakeRedis()
    pipe = r.pipeline()
    for s in finished:
        metrics.record_finished(pipe, finish_reason="length", prompt_tokens=4,
                                generation_tokens=6, preemptions=s.num_preemptions,
                                queue_s=None, ttft_s=None, tpot_s=None, e2e_s=None)
    pipe.execute()
    assert metrics.read_snapshot(r)["counters"]["num_preemptions_total"] == new.num_preemptions


# --- priorities (interactive requests before batch lines) ------------------------------------
def prioritized(priority: int, n: int) -> list:
    return made(n, priority=priority)


def test_the_best_priority_waiting_joins_first_whatever_came_before_it():
    wm = make_manager(max_num_seqs=3)
    lines = prioritized(9, 4)
    for s in lines:
        wm.add(s)
    [interactive] = prioritized(0, 1)
    wm.add(interactive)
    out, _ = step(wm)
    # Alone in its step's prefill: the lines behind it wait for the next step.
    assert ids(out.prefill) == [interactive.seq_id]
    out, _ = step(wm)
    assert ids(out.prefill) == ids(lines[:2])


def test_batch_lines_that_hold_every_slot_give_the_newest_one_to_an_interactive_request():
    wm = make_manager(max_num_seqs=4)
    lines = prioritized(9, 6)
    for s in lines:
        wm.add(s)
    for _ in range(4):
        step(wm)
    assert ids(wm.running) == ids(lines[:4])
    [interactive] = prioritized(0, 1)
    wm.add(interactive)
    out, _ = step(wm)
    assert ids(out.prefill) == [interactive.seq_id]   # the very next step
    assert lines[3].seq_id in out.freed_seq_ids and ids(out.decode) == ids(lines[:3])
    assert lines[3].state is SequenceState.WAITING and lines[3].num_output_tokens == 4
    assert lines[3].num_preemptions == 1 and wm.stats.num_preempted == 1
    # The preempted line comes back before the lines that never ran, once a slot is free.
    wm.abort(lines[0], FinishReason.CANCELLED)
    out, _ = step(wm)
    assert ids(out.prefill) == [lines[3].seq_id] and wm.stats.num_preempted == 1


def test_equal_priorities_never_preempt_each_other():
    wm = make_manager(max_num_seqs=2)
    first, later = prioritized(3, 2), prioritized(3, 1)
    for s in first + later:
        wm.add(s)
    step(wm)
    out, _ = step(wm)
    assert out.prefill == [] and out.freed_seq_ids == [] and wm.stats.num_preempted == 0
    assert ids(wm.waiting) == ids(later)


# --- a backend that cannot resume every sequence exactly (vLLM) ----------------------------------
def pinned(seq, how: str = "structured"):
    """A sequence whose text a vLLM re-admission would change: structured, seeded or with
    frequency/presence penalties."""
    p = seq.params
    if how == "structured":
        p.structured = {"regex": "[0-9]{4}"}
    elif how == "seeded":
        p.seed, p.temperature = 3, 1.0
    else:
        p.presence_penalty = 1.0
    return seq


@pytest.mark.parametrize("how", ["structured", "seeded", "penalised"])
def test_without_exact_resume_a_full_kv_cache_preempts_only_what_resumes_exactly(how):
    """vLLM's backend re-adds a preempted sequence as a new request: its grammar, seeded
    generator and penalty counts start again (a 4-digit regex answered 6 digits). Such a
    sequence is not llmq's to preempt there; the newest of the others goes instead."""
    wm = kv_manager(7)
    wm.set_exact_resume(False)
    a, b = make_seq(8, max_tokens=20), make_seq(8, max_tokens=20)
    c = pinned(make_seq(3, max_tokens=20), how)
    for s in (a, b, c):
        wm.add(s)
    while not wm.stats.num_preemptions:
        out = wm.schedule()
        wm.update(out, tokens_for(out))
    assert out.freed_seq_ids == [b.seq_id] and list(wm.waiting) == [b]
    assert c in wm.running and c.num_preemptions == 0


def test_without_exact_resume_nothing_left_to_preempt_leaves_the_cache_to_the_backend():
    wm = kv_manager(3)
    wm.set_exact_resume(False)
    a, b = pinned(make_seq(4, max_tokens=20)), pinned(make_seq(4, max_tokens=20), "seeded")
    for s in (a, b):
        wm.add(s)
    for _ in range(6):
        out, _ = step(wm)
    assert wm.stats.num_preemptions == 0 and ids(wm.running) == ids([a, b])


def test_without_exact_resume_a_better_priority_or_a_share_takes_only_a_movable_slot():
    wm = make_manager(max_num_seqs=2)
    wm.set_exact_resume(False)
    old, new = prioritized(9, 2)
    pinned(new)
    for s in (old, new):
        wm.add(s)
    step(wm)
    [urgent] = prioritized(0, 1)
    wm.add(urgent)
    out, _ = step(wm)
    assert out.freed_seq_ids == [old.seq_id] and new in wm.running   # not the newest: pinned
    [later] = prioritized(0, 1)
    wm.add(later)
    out, _ = step(wm)
    assert out.freed_seq_ids == [] and list(wm.waiting) == [old, later]   # waits for a slot

    wm = make_manager(max_num_seqs=4)
    wm.set_exact_resume(False)
    wm.key_cap = 2
    flood = keyed("b", 4)
    for s in flood[1:]:
        pinned(s)
    for s in flood:
        wm.add(s)
    step(wm)
    for s in keyed("a", 2):
        wm.add(s)
    out, _ = step(wm)
    assert out.freed_seq_ids == [flood[0].seq_id] and wm.stats.num_preempted == 1


# --- multi-step: several decode passes a step -------------------------------------------------
def multi_step_manager(window_s: float = 0.03, **kw) -> WorkloadManager:
    wm = make_manager(**kw)
    wm.multi_step_window_s = window_s
    wm.set_multi_step(True)
    return wm


def test_a_decode_only_step_runs_as_many_passes_as_fit_in_the_window():
    wm = multi_step_manager(0.03)
    a = make_seq(4, max_tokens=100)
    wm.add(a)
    out, _ = step(wm)
    assert out.num_steps == 1                     # a prefill: one pass
    out, _ = step(wm)
    assert out.num_steps == 1                     # its pace is not known yet
    wm.observe_pass(0.008, 1)
    assert wm.schedule().num_steps == 3           # 30 ms at 8 ms a pass
    wm.observe_pass(0.0001, 1)
    assert wm.schedule().num_steps == 5           # smoothed: 5.6 ms
    for _ in range(30):
        wm.observe_pass(0.0001, 1)
    assert wm.schedule().num_steps == MAX_DECODE_PASSES   # capped, however fast


def test_multi_step_gives_way_to_newcomers_a_new_batch_size_and_the_kv_budget():
    wm = multi_step_manager(0.03)
    a, b = make_seq(4, max_tokens=100), make_seq(4, max_tokens=100)
    wm.add(a)
    step(wm)
    wm.observe_pass(0.005, 1)
    wm.add(b)
    out, _ = step(wm)
    assert ids(out.prefill) == ids([b]) and out.num_steps == 1   # b joins: one pass
    out = wm.schedule()
    assert ids(out.decode) == ids([a, b]) and out.num_steps == 1  # pace known for 1 row, not 2
    wm.observe_pass(0.006, 2)
    assert wm.schedule().num_steps == 5
    wm.max_num_seqs = 2
    wm.add(make_seq(4))                  # waits for a slot: a burst would make it wait longer
    assert wm.schedule().num_steps == 1
    wm.waiting.clear()
    wm.observe_pass(0.2, 2)
    assert wm.schedule().num_steps == 1  # a pass longer than the window: one a step


def test_multi_step_passes_are_reserved_in_the_kv_budget():
    wm = multi_step_manager(0.03)
    a, b = make_seq(4, max_tokens=100), make_seq(4, max_tokens=100)
    wm.add(a)
    wm.add(b)
    step(wm)
    for _ in range(30):
        wm.observe_pass(0.001, 2)
    wm.set_kv_budget(1000, 16)           # room for every pass: as many as fit in the window
    assert wm.schedule().num_steps == MAX_DECODE_PASSES
    # One cell a block (llama.cpp's pool): room for 3 tokens more each, after this step's.
    wm.set_kv_budget(a.num_tokens + b.num_tokens + 2 * 3, 1)
    assert wm.schedule().num_steps == 4
    wm.set_kv_budget(a.num_tokens + b.num_tokens, 1)
    assert wm.schedule().num_steps == 1


def test_no_multi_step_unless_the_backend_runs_it_and_the_window_is_set():
    for able, window in ((False, 0.03), (True, 0.0)):
        wm = make_manager()
        wm.multi_step_window_s = window
        wm.set_multi_step(able)
        wm.add(make_seq(4))
        step(wm)
        wm.observe_pass(0.001, 1)
        assert wm.schedule().num_steps == 1
