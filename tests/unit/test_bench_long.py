"""The long-generations bench phase's report, from made-up samples (no stack): the figures at
each mark, tokens/s over time, the AOF's bytes per token at the start and the end, and the
targets judged on them."""
from __future__ import annotations

from bench.bench import parse_args
from bench.long import Sample, format_long, long_targets, marks_for, summarize

SEQS = 4
FINAL = 50_000


def run(tokens: int, bytes_per_step, host_ms_per_step, heartbeat_every: int = 4) -> list[Sample]:
    """A phase of SEQS sequences in lockstep, one sample per step (the heartbeat's counters
    moving every `heartbeat_every` steps), each step costing what the functions of its
    position say; at the end the final texts are written at once (FINAL bytes)."""
    samples, redis_in, aof, host = [], 0, 0, 0.0
    reported = (0, 0.0)
    for step in range(tokens + 1):
        if step:
            redis_in += bytes_per_step(step)
            aof += bytes_per_step(step) // 2
            host += host_ms_per_step(step) / 1000
        if step == tokens:
            aof += FINAL
        if step % heartbeat_every == 0:
            reported = (step, host)
        running = SEQS if step < tokens else 0
        samples.append(Sample(t=step * 0.1, tokens=step * SEQS, position=step, running=running,
                              finished=SEQS - running, redis_in=redis_in, aof=aof,
                              steps=reported[0], host_s=reported[1], publish_s=0.0,
                              model_s=0.05 * reported[0], step_s=0.06 * reported[0]))
    return samples


def test_marks_end_with_the_runs_own_length():
    assert marks_for(8000) == [100, 1000, 4000, 8000]
    assert marks_for(300) == [100, 300]
    assert marks_for(50) == [50]


def test_a_constant_cost_per_step_meets_every_bar():
    long = summarize(run(2000, lambda s: 1000, lambda s: 2.0), SEQS, 2000)
    assert [r["tokens"] for r in long["at"]] == [100, 1000, 2000]
    for row in long["at"]:
        assert row["redis_bytes_per_step"] == 1000 and row["aof_bytes_per_step"] == 500
        assert abs(row["host_ms_per_step"] - 2.0) < 0.01
        assert abs(row["model_ms_per_step"] - 50.0) < 0.01
    # (the final texts, written once at the end, count in all but not in the end's rate)
    assert long["aof"]["start_bytes_per_token"] == long["aof"]["end_bytes_per_token"] == 125.0
    assert long["aof"]["bytes"] == 2000 * 500 + FINAL
    assert long["tokens"] == 2000 * SEQS and long["tokens_per_s"] == 40.0
    rates = long["tokens_per_s_over_time"]
    assert len(rates) == 20 and all(abs(r["tokens_per_s"] - 40.0) < 0.5 for r in rates)
    assert [t["met"] for t in long_targets(long)] == [True, True, True, True]
    text = "\n".join(format_long(long))
    assert "2000" in text and "AOF" in text


def test_a_cost_that_grows_with_the_length_fails_the_bars():
    """What the whole text rewritten at every step looks like: bytes and time in proportion."""
    long = summarize(run(2000, lambda s: 100 + 4 * s * SEQS, lambda s: 1.0 + s / 200),
                     SEQS, 2000)
    first, last = long["at"][0], long["at"][-1]
    assert last["redis_bytes_per_step"] > 10 * first["redis_bytes_per_step"]
    assert long["aof"]["end_bytes_per_token"] > 5 * long["aof"]["start_bytes_per_token"]
    assert [t["met"] for t in long_targets(long)] == [False, False, False, False]


def test_a_mark_the_run_did_not_reach_is_none():
    samples = run(2000, lambda s: 1000, lambda s: 2.0)[:600]   # cut at ~600 tokens
    long = summarize(samples, SEQS, 2000)
    assert long["at"][0]["host_ms_per_step"] is not None
    assert long["at"][-1]["host_ms_per_step"] is None
    # (the AOF's is judged on what ran)
    assert [t["met"] for t in long_targets(long)] == [None, None, None, True]
    assert long_targets(None) == []


def test_only_long_runs_the_phase_alone_with_its_size():
    args = parse_args(["--only", "long", "--long-tokens", "300", "--long-seqs", "8"])
    assert args.only == "long" and not args.run_peers
    assert (args.long_tokens, args.long_seqs) == (300, 8)
    assert parse_args([]).long_tokens == 8000 and parse_args([]).long_seqs == 64
