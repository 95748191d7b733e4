"""bench/report.py: the split of a level's wall time from the engine's StepTiming totals, request
summaries (requests cut by a time limit), and the mixed-workload target."""
import pytest

from bench.loadgen import RequestResult
from bench.report import compute_ratios, format_split, format_table, summarize, targets, time_split


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


def result(start, end, status="succeeded", tokens=4):
    return RequestResult(start=start, first_token=start + 0.1, end=end, status=status,
                         completion_tokens=tokens if status == "succeeded" else 1,
                         expected_tokens=tokens)


def test_requests_cut_by_the_time_limit_count_in_latency_at_their_cut_time():
    finished = [result(0.0, 10.0 + i) for i in range(8)]             # 10 .. 17 s
    cut = [result(0.0, 100.0, status="cancelled") for _ in range(2)]  # still running at 100 s
    s = summarize(finished + cut, wall_s=100.0)
    assert s["failures"] == s["cut_requests"] == 2
    assert s["latency_p99_s"] < 20                  # the finished ones only
    assert s["latency_p99_all_s"] == pytest.approx(100.0)
    assert s["latency_p50_all_s"] > s["latency_p50_s"]
    # The cut requests' tokens (one each here) count as work done in the window.
    assert s["tokens_per_s"] == pytest.approx(32 / 100.0)
    assert s["tokens_per_s_all"] == pytest.approx(34 / 100.0)


def test_mixed_target_compares_p99_with_the_cut_requests_counted():
    def policy(p99_finished, p99_all, tps):
        return {"tokens_per_s": tps, "latency_p99_s": p99_finished, "latency_p99_all_s": p99_all}
    # Static finished few requests, so its finished-only p99 looks better than it is.
    mixed = {"continuous": policy(130.0, 140.0, 40.0), "static": policy(120.0, 185.0, 18.0)}
    ratios = compute_ratios(None, [], mixed)
    assert ratios["continuous_over_static_p99_latency"] == pytest.approx(140 / 185, abs=1e-3)
    t = {x["name"]: x for x in targets([], ratios, mixed)}
    assert t["mixed: continuous >= 1.5 x static throughput, lower p99"]["met"] is True
    mixed["static"]["latency_p99_all_s"] = 139.0
    assert not {x["name"]: x for x in targets([], ratios, mixed)}[
        "mixed: continuous >= 1.5 x static throughput, lower p99"]["met"]


def test_the_ttft_target_is_printed_beside_raw_generates_first_tokens_of_64_prompts():
    raw = {"new_tokens": 64, "info": {}, "results": [
        {"batch": 1, "new_tokens": 64, "generated_tokens": 64, "elapsed_s": 7.0,
         "tokens_per_s": 9.1, "first_token_s": 0.11},
        {"batch": 64, "new_tokens": 64, "generated_tokens": 64, "elapsed_s": 30.0,
         "tokens_per_s": 136.5, "first_token_s": 1.234}]}
    served = [{"concurrency": 64, "ttft_p50_s": 1.8}]
    ratios = compute_ratios(raw, [], None)
    ttft = {x["name"]: x for x in targets(served, ratios, None, raw=raw)}["TTFT p50 @64 < 1 s"]
    assert ttft["met"] is False and ttft["raw_first_token_s"] == 1.234
    table = format_table({"raw": raw, "targets": [ttft]})
    assert "1234" in table.splitlines()[3]          # the batch-64 row's first-token column
    assert "TTFT p50 @64 < 1 s: 1.800 (raw generate, first tokens of 64 prompts at once: 1.234 s)" in table
    # A run without the raw phase (or an older result) has no raw figure to print.
    assert "raw_first_token_s" not in targets(served, ratios, None)[-1]


class _FakeStream:
    """What requests gives for POST /v1/generate with stream: SSE in HTTP chunks."""

    status_code = 200
    headers = {"X-Request-Id": "seq-1"}

    def __init__(self, chunks):
        self.chunks = chunks

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def iter_content(self, chunk_size=None):
        yield from self.chunks


def test_the_first_token_event_and_the_first_text_are_timed_apart(monkeypatch):
    from bench import loadgen

    clock = iter(range(100))
    monkeypatch.setattr(loadgen.time, "perf_counter", lambda: float(next(clock)))
    chunks = [b'event: token\ndata: {"text": ""}\n\n',          # <|im_end|>: no text
              b'event: token\ndata: {"text": "\\n"}\n\n',
              b'event: done\ndata: {"status": "succeeded", "usage": {"completion_tokens": 2}}\n\n']

    class Session:
        def post(self, *a, **kw):
            return _FakeStream(chunks)

    r = loadgen.stream_generate(Session(), "http://x", {"max_tokens": 2}, start=-1.0)
    assert r.ok and r.ttft == 1.0 and r.ttft_text == 2.0
    s = summarize([r], wall_s=3.0)
    assert s["ttft_p50_s"] == 1.0 and s["ttft_text_p50_s"] == 2.0


def test_the_mixed_lengths_targets_read_each_long_run():
    runs = [{"name": "short alone", "long_prompt_tokens": 0, "short_latency_p50_s": 10.0,
             "rss_before_mb": 900, "rss_peak_mb": 910, "kv_mb": 10},
            {"name": "short + 1 x 3000", "long_prompt_tokens": 3000, "short_latency_p50_s": 12.0,
             "short_p50_over_alone": 1.2, "rss_before_mb": 900, "rss_peak_mb": 1100,
             "kv_mb": 150, "rss_growth_over_kv": 1.33}]
    lengths = {"short_requests": 32, "max_tokens": 64, "runs": runs}
    got = {x["name"]: x["met"] for x in targets([], {"served_over_raw": {}}, None,
                                                lengths=lengths)}
    assert got["lengths: short p50 beside 1 x 3000 tokens <= 1.5 x alone"] is True
    assert got["lengths: model RSS growth beside 1 x 3000 <= 1.25 x its KV bytes"] is False
    table = format_table({"lengths": lengths, "targets": []})
    assert "short + 1 x 3000" in table and "1.20" in table
