"""Worse priorities beside a better one (issue 16): batch lines' prefill is held while an
interactive request runs, waits or did a moment ago, so most steps it lands in are decode-only;
an idle queue still gives the batch every step. Driven by hand with hand-made token ids."""
from __future__ import annotations

import fakeredis
import pytest

from common.protocol import FinishReason
from common.settings import Settings
from common.store import SequenceStore
from worker.workload_manager import WorkloadManager

from .factories import ids, make_engine, make_seq, tokens_for


class Clock:
    """A monotonic clock a test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def manager(clock: Clock, hold_steps: int = 3, window_s: float = 2.0) -> WorkloadManager:
    return WorkloadManager(max_num_seqs=16, priority_hold_steps=hold_steps,
                           priority_window_s=window_s, clock=clock)


def seqs(priority: int, n: int, max_tokens: int = 50) -> list:
    made = [make_seq(3, max_tokens=max_tokens) for _ in range(n)]
    for s in made:
        s.priority = priority
    return made


def step(wm: WorkloadManager):
    out = wm.schedule()
    wm.update(out, tokens_for(out, 7))
    return out


def line_steps(wm: WorkloadManager, n: int) -> list[list[str]]:
    """n steps, one new batch line queued before each: which lines each step prefilled."""
    joined = []
    for _ in range(n):
        wm.add(seqs(9, 1)[0])
        joined.append([s.seq_id for s in step(wm).prefill if s.priority == 9])
    return joined


def test_beside_a_running_interactive_request_batch_lines_join_together_every_few_steps():
    wm = manager(Clock(), hold_steps=3)
    first = seqs(9, 2)
    for s in first:
        wm.add(s)
    step(wm)                                     # the batch runs
    [chat] = seqs(0, 1)
    wm.add(chat)
    assert ids(step(wm).prefill) == [chat.seq_id]
    joined = line_steps(wm, 6)
    # Two steps of decodes only, then the three lines queued meanwhile in one prefill pass.
    assert [len(j) for j in joined] == [0, 0, 3, 0, 0, 3]
    assert wm.stats.num_held_steps == 4
    assert chat in wm.running and len(wm.running) == 1 + 2 + 6


def test_an_idle_queue_gives_the_batch_every_step():
    wm = manager(Clock(), hold_steps=3)
    wm.add(seqs(9, 1)[0])
    step(wm)
    assert [len(j) for j in line_steps(wm, 5)] == [1] * 5
    assert wm.stats.num_held_steps == 0


def test_the_hold_outlasts_the_interactive_request_by_the_window_then_ends():
    clock = Clock()
    wm = manager(clock, hold_steps=3, window_s=2.0)
    wm.add(seqs(9, 1)[0])
    step(wm)
    [chat] = seqs(0, 1, max_tokens=1)
    wm.add(chat)
    step(wm)
    wm.abort(chat, FinishReason.LENGTH)
    clock.now += 1.5                              # gone, but seen within the window
    assert [len(j) for j in line_steps(wm, 3)] == [0, 0, 3]
    clock.now += 2.1                              # past the window: every step again
    assert [len(j) for j in line_steps(wm, 3)] == [1, 1, 1]


def test_batch_lines_join_at_once_when_nothing_decodes():
    """Holding a prefill with nothing to decode would only leave the model idle."""
    clock = Clock()
    wm = manager(clock, hold_steps=4)
    [chat] = seqs(0, 1)
    wm.add(chat)
    step(wm)
    wm.abort(chat, FinishReason.CANCELLED)
    lines = seqs(9, 3)
    for s in lines:
        wm.add(s)
    assert ids(step(wm).prefill) == ids(lines)


def test_hold_steps_of_one_turns_it_off():
    wm = manager(Clock(), hold_steps=1)
    wm.add(seqs(9, 1)[0])
    step(wm)
    wm.add(seqs(0, 1)[0])
    step(wm)
    assert [len(j) for j in line_steps(wm, 4)] == [1] * 4
    assert wm.stats.num_held_steps == 0


def test_the_guard_is_the_best_priority_about_not_only_zero():
    """A middle priority (5) running holds worse newcomers (9) as an interactive one does."""
    wm = manager(Clock(), hold_steps=2, window_s=0.0)
    wm.add(seqs(5, 1)[0])
    step(wm)
    assert [len(j) for j in line_steps(wm, 4)] == [0, 2, 0, 2]


def test_settings_read_and_check_the_hold(monkeypatch):
    monkeypatch.setenv("LLMQ_PRIORITY_HOLD_STEPS", "6")
    monkeypatch.setenv("LLMQ_PRIORITY_WINDOW", "0.5")
    s = Settings.from_env()
    assert (s.priority_hold_steps, s.priority_window_s) == (6, 0.5)
    monkeypatch.setenv("LLMQ_PRIORITY_HOLD_STEPS", "-1")
    with pytest.raises(ValueError, match="LLMQ_PRIORITY_HOLD_STEPS"):
        Settings.from_env()


def test_the_engine_builds_its_scheduler_with_the_hold():
    engine = make_engine(SequenceStore(fakeredis.FakeRedis(decode_responses=True)), priority_hold_steps=5, priority_window_s=0.25)
    try:
        wm = engine.workload_manager
        assert (wm.priority_hold_steps, wm.priority_window_s) == (5, 0.25)
        assert engine.stats()["num_held_steps"] == 0
    finally:
        engine.executor.stop()


def test_over_the_cost_model_the_hold_shortens_the_wait_without_slowing_the_batch():
    """bench/priority_hold.py steps the real scheduler over step costs (no clock is read): the
    step an interactive request waits out gets shorter, and the batch gets no fewer lines."""
    from bench.priority_hold import simulate

    off, on = (simulate(h, decode_ms=80, pass_ms=40, prompt_ms=3, steps=600) for h in (1, 2))
    assert off["held_steps"] == 0 < on["held_steps"]
    assert on["wait_p50_ms"] < off["wait_p50_ms"]
    assert on["lines_per_s"] >= off["lines_per_s"]


# --- interjection: a better priority prefilled inside the step in flight ------------------------
def interjecting(max_num_seqs: int = 16, **kw) -> WorkloadManager:
    return WorkloadManager(max_num_seqs=max_num_seqs, interjection=True, **kw)


def lines_in_flight(wm: WorkloadManager, n: int):
    """n batch lines prefilled, their decode scheduled (in flight), and a chat waiting."""
    lines = seqs(9, n)
    for s in lines:
        wm.add(s)
    step(wm)
    in_flight = wm.schedule()
    [chat] = seqs(0, 1)
    wm.add(chat)
    return lines, in_flight, chat


def test_an_interactive_newcomer_is_interjected_into_a_step_of_batch_lines():
    wm = interjecting()
    lines, in_flight, chat = lines_in_flight(wm, 3)
    side = wm.interject(in_flight)
    assert ids(side.prefill) == [chat.seq_id] and not side.decode and chat not in wm.waiting
    wm.update(side, tokens_for(side, 5))         # its result comes first
    wm.update(in_flight, tokens_for(in_flight, 7))
    assert chat.output_token_ids == [5] and chat in wm.running
    assert all(len(s.output_token_ids) == 2 for s in lines)
    nxt = wm.schedule()                          # from the next step on it decodes with them
    assert set(ids(nxt.decode)) == set(ids(lines + [chat])) and not nxt.prefill
    assert wm.stats.num_interjected == 1 and wm.stats.num_prefilled == 4


def test_only_a_step_holding_a_worse_priority_is_interjected_into():
    """Interactive requests among themselves join at the next step, together, as ever: an
    interjection is a pass of its own, worth it only to skip a worse priority's step. Beside
    batch lines, an interactive newcomer is interjected even while others of its priority run."""
    wm = interjecting()
    [chat] = seqs(0, 1)
    wm.add(chat)
    step(wm)
    in_flight = wm.schedule()                    # chat alone
    wm.add(seqs(0, 1)[0])
    assert wm.interject(in_flight) is None
    wm.update(in_flight, tokens_for(in_flight))
    step(wm)                                     # the second chat joins
    line = seqs(9, 1)[0]
    wm.add(line)
    step(wm)                                     # a batch line too
    in_flight = wm.schedule()                    # 0, 0 and 9
    later = seqs(9, 1)[0]
    wm.add(later)
    assert wm.interject(in_flight) is None       # a line is no better than the step's worst
    [third] = seqs(0, 1)
    wm.add(third)
    assert ids(wm.interject(in_flight).prefill) == [third.seq_id]
    assert later in wm.waiting


def two_lines_in_6_blocks(wm: WorkloadManager, n_prompt: int):
    """Two batch lines of n_prompt tokens (5 to 7: 2 blocks of 4 each once decoding) in a
    6-block cache, their decode in flight."""
    wm.set_kv_budget(num_blocks=6, block_size=4)
    lines = [make_seq(n_prompt) for _ in range(2)]
    for s in lines:
        s.priority = 9
        wm.add(s)
    step(wm)
    return lines, wm.schedule()


def test_an_interjection_needs_a_free_slot_free_blocks_and_a_one_chunk_prompt():
    wm = interjecting(max_num_seqs=3, long_prefill_tokens=16)
    _, in_flight = two_lines_in_6_blocks(wm, 5)
    long_chat = make_seq(17)                     # more than one chunk: it waits
    long_chat.priority = 0
    big_chat = make_seq(16)                      # one chunk, but 4 blocks: only 2 are free
    big_chat.priority = 0
    small = seqs(0, 2)
    for s in (long_chat, big_chat, *small):
        wm.add(s)
    side = wm.interject(in_flight)
    assert ids(side.prefill) == [small[0].seq_id]   # the one free slot
    assert {long_chat, big_chat, small[1]} <= set(wm.waiting)


def test_an_interjection_counts_the_blocks_of_those_that_left_during_the_step_in_flight():
    """A line cancelled while its decode runs keeps its blocks in the model process until the
    next step frees them: a newcomer interjected into them failed with KVCacheFull."""
    wm = interjecting()
    lines, in_flight = two_lines_in_6_blocks(wm, 7)
    wm.abort(lines[1], FinishReason.CANCELLED)
    chat = make_seq(9)                           # 3 blocks: 2 are free until the next step
    chat.priority = 0
    wm.add(chat)
    assert wm.interject(in_flight) is None and chat in wm.waiting
    wm.update(in_flight, tokens_for(in_flight))
    nxt = wm.schedule()                          # the next step frees them and takes it
    assert nxt.freed_seq_ids == [lines[1].seq_id] and ids(nxt.prefill) == [chat.seq_id]


def test_an_interjection_counts_the_rows_of_those_that_left_during_the_step_in_flight():
    """A full batch, one line cancelled while its decode runs: the model process holds its row
    until the next step, and an interjected newcomer failed with "batch is full"."""
    wm = interjecting(max_num_seqs=2)
    lines, in_flight, chat = lines_in_flight(wm, 2)
    wm.abort(lines[1], FinishReason.CANCELLED)
    assert wm.interject(in_flight) is None and chat in wm.waiting
    wm.update(in_flight, tokens_for(in_flight))
    nxt = wm.schedule()                          # the next step frees the row and takes it
    assert nxt.freed_seq_ids == [lines[1].seq_id] and ids(nxt.prefill) == [chat.seq_id]


def test_a_restarted_copy_is_not_interjected_beside_its_old_copys_cache():
    """A record restarted here while its old copy decodes in the step in flight: the new copy
    (same id) waits for the next step, which frees the old copy's cache first (the model
    process refused a second sequence under one id)."""
    wm = interjecting()
    lines, in_flight, chat = lines_in_flight(wm, 2)
    side = wm.interject(in_flight)               # the chat joins and decodes
    wm.update(side, tokens_for(side))
    wm.update(in_flight, tokens_for(in_flight))
    in_flight = wm.schedule()
    wm.abort(chat, FinishReason.CANCELLED)       # what a restart does to the old copy
    again = make_seq(4, seq_id=chat.seq_id)
    again.priority = 0
    wm.add(again)
    assert wm.interject(in_flight) is None
    wm.update(in_flight, tokens_for(in_flight))
    nxt = wm.schedule()
    assert nxt.freed_seq_ids == [chat.seq_id] and ids(nxt.prefill) == [chat.seq_id]


def test_a_restarted_copy_is_not_interjected_while_its_old_copys_prefill_is_in_flight():
    """The old copy's prefill is in the step in flight (not yet freed, not yet running): the
    model process already held it, and refused the new copy under the same id."""
    wm = interjecting()
    lines = seqs(9, 2)
    for s in lines:
        wm.add(s)
    in_flight = wm.schedule()                    # both lines' prefill
    wm.abort(lines[0], FinishReason.CANCELLED)   # what a restart does to the old copy
    again = make_seq(4, seq_id=lines[0].seq_id)
    again.priority = 0
    wm.add(again)
    assert wm.interject(in_flight) is None and again in wm.waiting
    wm.update(in_flight, tokens_for(in_flight))
    nxt = wm.schedule()
    assert lines[0].seq_id in nxt.freed_seq_ids and ids(nxt.prefill) == [again.seq_id]


def test_interjection_off_leaves_the_newcomer_for_the_next_step():
    wm = WorkloadManager(max_num_seqs=16)
    wm.add(seqs(9, 1)[0])
    step(wm)
    in_flight = wm.schedule()
    wm.add(seqs(0, 1)[0])
    assert wm.interject(in_flight) is None


def test_an_interjected_newcomer_goes_back_to_wait_if_the_model_dies():
    wm = interjecting()
    lines, in_flight, chat = lines_in_flight(wm, 2)
    side = wm.interject(in_flight)
    back = wm.requeue(in_flight, side)
    assert set(back) == set(lines + [chat]) and len(back) == 3
    assert list(wm.waiting)[0] in back and chat in wm.waiting and not wm.running
