"""The Sequence state machine, the ends a token makes (the output processor's end_on_token:
stop tokens, lengths) and the sequence's stop-string text handling."""
from __future__ import annotations

import random
import time

import pytest

from common.protocol import FinishReason, SamplingParams, SequenceStatus
from worker.output_processor import end_on_token
from worker.sequence import Sequence, SequenceState

from .factories import EOS, make_seq


# --- tokens ----------------------------------------------------------------------------------
def test_new_sequence_is_waiting_with_counters():
    s = make_seq(5)
    assert s.state is SequenceState.WAITING and not s.is_finished
    assert (s.num_prompt_tokens, s.num_output_tokens, s.num_tokens) == (5, 0, 5)
    s.append_token(9)
    assert s.num_tokens == 6 and s.all_token_ids == list(range(100, 105)) + [9]
    assert s.first_token_time is not None


def ends(seq: Sequence, *tokens: int) -> list[FinishReason | None]:
    """Appends tokens as the scheduler does; what the output processor decides after each."""
    out = []
    for t in tokens:
        seq.append_token(t)
        out.append(end_on_token(seq))
    return out


def test_appending_never_ends_a_sequence():
    s = make_seq(2, max_tokens=1)
    s.append_token(EOS)
    s.append_token(5)                                # past max_tokens: still the caller's call
    assert not s.is_finished and s.output_token_ids == [EOS, 5]


def test_eos_stops():
    s = make_seq(2)
    assert ends(s, 5, EOS) == [None, FinishReason.STOP]
    assert s.output_token_ids == [5, EOS]            # the stop token is counted


def test_any_of_several_eos_ids_stops():
    assert ends(make_seq(2, eos=(2, 3)), 3) == [FinishReason.STOP]


def test_stop_token_ids_stop():
    assert ends(make_seq(2, stop_token_ids=[42]), 41, 42) == [None, FinishReason.STOP]


def test_max_tokens_gives_length():
    assert ends(make_seq(2, max_tokens=3), 5, 6, 7) == [None, None, FinishReason.LENGTH]


def test_stop_token_on_last_allowed_token_is_stop_not_length():
    assert ends(make_seq(2, max_tokens=2), 5, EOS) == [None, FinishReason.STOP]


def test_min_tokens_suppresses_eos_stop():
    s = make_seq(2, min_tokens=3, stop_token_ids=[42])
    # 2 tokens < min_tokens: no stop yet; the 3rd token may stop
    assert ends(s, EOS, 42, EOS) == [None, None, FinishReason.STOP]
    assert s.num_output_tokens == 3


def test_a_stop_token_is_looked_up_not_scanned_for():
    """The stop ids were a tuple scanned at every token of every sequence, inside the step the
    whole batch shares (1,000,000 ids: ~11 ms a token); now a set made once per sequence, so
    200,000 of them cost what one does."""
    def cost(seq: Sequence) -> float:
        start = time.perf_counter()
        assert ends(seq, *[5] * 2000) == [None] * 2000
        return time.perf_counter() - start

    one = cost(make_seq(2, stop_token_ids=[1000], max_tokens=10**6))
    many = cost(make_seq(2, stop_token_ids=list(range(1000, 201_000)), max_tokens=10**6))
    assert many < 10 * one + 0.1, (many, one)   # a scan: ~1 ms a token, seconds in all


def test_min_tokens_does_not_override_max_tokens():
    assert ends(make_seq(2, min_tokens=2, max_tokens=2), EOS, 5) == [None, FinishReason.LENGTH]


def test_ignore_eos_keeps_going_but_stop_token_ids_still_stop():
    s = make_seq(2, ignore_eos=True, stop_token_ids=[42], max_tokens=10)
    assert s.stop_token_ids == {42}
    assert ends(s, EOS, EOS, EOS, 42) == [None, None, None, FinishReason.STOP]


def test_ignore_eos_runs_to_max_tokens():
    assert ends(make_seq(2, ignore_eos=True, max_tokens=4), *[EOS] * 4) == [None] * 3 + [
        FinishReason.LENGTH]


def test_echo_only_keeps_no_token_and_ends_at_once():
    s = make_seq(2, max_tokens=0)
    assert ends(s, EOS) == [FinishReason.LENGTH]
    assert s.output_token_ids == [] and s.first_token_time is not None


def test_stop_token_ids_include_eos_unless_ignored():
    assert make_seq(1, stop_token_ids=[9]).stop_token_ids == {EOS, 9}


def test_finish_is_idempotent_first_reason_wins():
    s = make_seq(2)
    s.finish(FinishReason.CANCELLED)
    s.finish(FinishReason.ERROR, "late")
    assert s.finish_reason is FinishReason.CANCELLED and s.error is None


def test_finish_records_error():
    s = make_seq(2)
    s.finish(FinishReason.ERROR, "out of memory")
    assert (s.finish_reason, s.error, s.is_finished) == (FinishReason.ERROR, "out of memory", True)


# --- stop strings ----------------------------------------------------------------------------
def feed(seq: Sequence, deltas, final_last: bool = False) -> list[str]:
    out = []
    for i, d in enumerate(deltas):
        out.append(seq.add_text(d, final=final_last and i == len(deltas) - 1))
        if seq.is_cut_at_stop and not (final_last and i == len(deltas) - 1):
            break
    return out


def test_without_stop_strings_text_passes_through():
    s = make_seq(1)
    assert feed(s, ["Hel", "lo", ""]) == ["Hel", "lo", ""]
    assert s.text == "Hello" and s.pending_text == "" and not s.is_cut_at_stop


def test_stop_string_cuts_text_before_it_and_stops():
    s = make_seq(1, stop=["END"])
    assert s.add_text("Hello END and more") == "Hello "
    assert s.text == "Hello " and s.is_cut_at_stop


def test_stop_string_at_the_very_start_yields_empty_text():
    s = make_seq(1, stop=["###"])
    assert s.add_text("###x") == "" and s.text == "" and s.is_cut_at_stop


def test_stop_string_split_across_deltas():
    s = make_seq(1, stop=["STOP"])
    pieces = feed(s, ["abc S", "T", "O", "P tail"])
    assert pieces == ["abc ", "", "", ""]
    assert s.text == "abc " and s.is_cut_at_stop
    assert "S" not in "".join(pieces)


def test_held_back_text_is_released_when_not_a_stop_string():
    s = make_seq(1, stop=["STOP"])
    assert s.add_text("a ST") == "a "
    assert s.pending_text == "ST"
    assert s.add_text("ART") == "START"
    assert s.text == "a START" and not s.is_cut_at_stop and s.pending_text == ""


def test_final_releases_held_back_text():
    s = make_seq(1, stop=["</s>"])
    assert s.add_text("answer </") == "answer "
    s.finish(FinishReason.LENGTH)
    assert s.add_text("", final=True) == "</"
    assert s.text == "answer </" and s.finish_reason is FinishReason.LENGTH


def test_earliest_of_several_stop_strings_wins():
    s = make_seq(1, stop=["world", "lo"])
    assert s.add_text("hello world") == "hel"
    assert s.text == "hel"


def test_overlapping_prefix_is_held_until_resolved():
    s = make_seq(1, stop=["aab"])
    assert s.add_text("xa") == "x"
    assert s.add_text("a") == ""                     # "aa" could still become "aab"
    assert s.add_text("a") == "a"                    # "aaa": only the last "aa" may start it
    assert s.add_text("b!") == ""
    assert s.text == "xa" and s.is_cut_at_stop


def test_stop_string_found_in_final_delta():
    s = make_seq(1, stop=["\n\n"])
    s.finish(FinishReason.LENGTH)
    assert s.add_text("line\n\nnext", final=True) == "line"
    assert s.text == "line"


def test_stop_string_completed_by_the_last_allowed_token_is_cut():
    """The sequence reports the cut; the output processor makes the reason "stop" even on the
    last token (tests/unit/test_engine_core.py: a stop string and the length at once)."""
    s = make_seq(1, stop=["END"], max_tokens=2)
    assert ends(s, 5) == [None]
    assert s.add_text("ok EN") == "ok "
    assert ends(s, 6) == [FinishReason.LENGTH]       # hits max_tokens
    assert s.add_text("D", final=True) == ""
    assert s.text == "ok " and s.is_cut_at_stop


def test_stop_strings_count_only_once_min_tokens_are_out():
    """vLLM checks stop strings once len(output) > min_tokens: one that ends earlier is text,
    and one that begins before and ends after is still found."""
    s = make_seq(1, stop=[" w5", "ab"], min_tokens=3)
    for token, delta in [(5, " w5"), (6, " w6 a")]:
        s.append_token(token)
        s.add_text(delta)
        assert not s.is_cut_at_stop
    s.append_token(7)
    s.add_text("x w5")                                 # token 3: still within min_tokens
    assert not s.is_cut_at_stop
    s.append_token(8)
    assert s.add_text(" w5 w9") == "" and s.is_cut_at_stop   # token 4: the stop counts
    assert s.text == " w5 w6 ax w5"
    t = make_seq(1, stop=["ab"], min_tokens=1)
    t.append_token(5)
    t.add_text("xa")                                   # "a" may begin "ab": held back
    t.append_token(6)
    t.add_text("b")                                    # it ends past min_tokens: found
    assert t.is_cut_at_stop and t.text == "x"


@pytest.mark.parametrize("seed", range(40))
def test_pieces_always_add_up_to_text(seed):
    rng = random.Random(seed)
    alphabet = "ab c\nxé🎉"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
             for _ in range(rng.randint(0, 3))]
    full = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    cuts = sorted(rng.sample(range(len(full) + 1), k=min(len(full) + 1, rng.randint(0, 12))))
    deltas = [full[i:j] for i, j in zip([0] + cuts, cuts + [len(full)])]
    s = make_seq(1, stop=stops)
    pieces = []
    for i, d in enumerate(deltas):
        pieces.append(s.add_text(d, final=i == len(deltas) - 1))
        assert "".join(pieces) == s.text
        if s.is_cut_at_stop:
            break
    # The streamed text is a prefix of the full text that ends right before a stop string, or
    # the whole text when none occurs; a stop string never leaks into it.
    assert full.startswith(s.text)
    if any(x in full for x in stops):
        assert s.is_cut_at_stop
        assert any(full[len(s.text):].startswith(x) for x in stops)
    else:
        assert s.text == full and not s.is_cut_at_stop
    assert not any(x in s.text for x in stops)


# --- protocol --------------------------------------------------------------------------------
@pytest.mark.parametrize("reason,status", [
    (FinishReason.STOP, SequenceStatus.SUCCEEDED),
    (FinishReason.LENGTH, SequenceStatus.SUCCEEDED),
    (FinishReason.CANCELLED, SequenceStatus.CANCELLED),
    (FinishReason.TIMEOUT, SequenceStatus.CANCELLED),
    (FinishReason.ERROR, SequenceStatus.FAILED),
])
def test_finish_reason_status(reason, status):
    assert reason.status is status
    assert status.is_finished


def test_every_finish_reason_has_a_status():
    assert {r.status for r in FinishReason} <= {s for s in SequenceStatus if s.is_finished}


def test_unfinished_statuses():
    assert not SequenceStatus.QUEUED.is_finished and not SequenceStatus.RUNNING.is_finished


def test_sampling_params_round_trip_ignores_unknown_keys():
    p = SamplingParams(max_tokens=5, temperature=0.5, stop=["x"], stop_token_ids=[3],
                       min_tokens=1, ignore_eos=True, seed=7)
    assert SamplingParams.from_dict({**p.to_dict(), "future_field": 1}) == p


def _reference_cut(text: str, stops: list[str]) -> int | None:
    """Where the text is cut: before the stop string that ends first (the longest on a tie)."""
    ends = [(i + len(s), -len(s)) for s in stops for i in range(len(text))
            if text.startswith(s, i)]
    if not ends:
        return None
    end, neg_len = min(ends)
    return end + neg_len


@pytest.mark.parametrize("seed", range(200))
def test_incremental_stop_matching_agrees_with_a_full_rescan(seed):
    """The matcher reads each piece once; a brute-force search of the whole text must agree
    on where the text ends, for overlapping, repetitive stop strings and any split."""
    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
             for _ in range(rng.randint(1, 4))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    s = make_seq(1, stop=stops)
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 4)
        pieces.append(text[i:i + n])
        i += n
    for piece in pieces:
        s.add_text(piece)
        if s.is_cut_at_stop:
            break
    else:
        s.add_text("", final=True)
    cut = _reference_cut(text, stops)
    assert s.text == (text if cut is None else text[:cut]), (stops, pieces)
    assert s.is_cut_at_stop == (cut is not None)


def test_a_stop_string_after_a_long_text_is_still_found_across_pieces():
    """8,000 pieces of text (some that begin the stop string and break off), then the stop
    string split over three pieces: found, and the text is everything before it."""
    s = make_seq(1, stop=["</answer>"])
    pieces = [" w", "</ans", "w", "</", "x"] * 1600
    assert "".join(feed(s, pieces)) == s.text == "".join(pieces)
    assert not s.is_cut_at_stop and s.pending_text == ""
    assert feed(s, [" done </an", "swe", "r> and more"]) == [" done ", "", ""]
    assert s.is_cut_at_stop and s.text == "".join(pieces) + " done "
