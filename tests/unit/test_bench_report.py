"""bench/report.py's split of a level's wall time from the engine's StepTiming totals."""
import pytest

from bench.report import format_split, time_split


def totals(steps, step_s, prefill, decode, publish, host):
    return {"steps": steps, "step_s": step_s, "model_prefill_s": prefill,
            "model_decode_s": decode, "publish_s": publish, "host_s": host}


def test_split_is_the_difference_of_the_totals_over_the_wall_time():
    before = totals(10, 5.0, 1.0, 3.0, 0.5, 0.2)
    after = totals(110, 15.0, 2.0, 11.0, 1.0, 0.7)     # 100 steps, 10 s of steps in 20 s
    s = time_split(before, after, wall_s=20.0)
    assert s["steps"] == 100 and s["ms_per_step"] == 100.0
    assert s["prefill"] == pytest.approx(0.05) and s["decode"] == pytest.approx(0.40)
    assert s["round_trip"] == pytest.approx(0.05)     # 10 s of steps - 9 s of compute
    assert s["engine"] == pytest.approx(0.025)
    assert s["outside_steps"] == pytest.approx(1 - 0.05 - 0.40 - 0.05 - 0.025)
    assert "100 steps of 100.0 ms" in format_split(s)


def test_no_steps_or_no_timing_gives_no_split():
    t = totals(5, 1.0, 0.1, 0.5, 0.1, 0.1)
    assert time_split(t, t, 10.0) is None
    assert time_split({}, t, 10.0) is None
    assert format_split(None) == "n/a"
