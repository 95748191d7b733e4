"""bench/report.py: the split of a level's wall time from the engine's StepTiming totals, request
summaries (requests cut by a time limit), the mixed-workload target, and the peers table (each
row against the best peer, the issues' bars for the systems that ran)."""
import pytest

from bench.loadgen import RequestResult
from bench.report import (best_peer_ratios, compute_ratios, format_peers, format_split,
                          format_table, peer_targets, summarize, targets, time_split)
from .factories import FakeStream


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


def test_the_first_token_event_and_the_first_text_are_timed_apart(monkeypatch):
    from bench import loadgen

    clock = iter(range(100))
    monkeypatch.setattr(loadgen.time, "perf_counter", lambda: float(next(clock)))
    chunks = [b'event: token\ndata: {"text": ""}\n\n',          # <|im_end|>: no text
              b'event: token\ndata: {"text": "\\n"}\n\n',
              b'event: done\ndata: {"status": "succeeded", "usage": {"completion_tokens": 2}}\n\n']

    class Session:
        def post(self, *a, **kw):
            return FakeStream(chunks, {"X-Request-Id": "seq-1"})

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


def _system(name, role, dtype, *levels, **extra):
    return {"name": name, "role": role, "dtype": dtype, **extra, "levels": [
        {"concurrency": c, "tokens_per_s_all": tps, "ttft_p50_s": ttft, "ttft_p99_s": 2 * ttft,
         "itl_p50_s": 0.05, "itl_p99_s": 0.2, "failures": 0, "compute_fraction": frac}
        for c, tps, ttft, frac in levels]}


def _peers_result():
    systems = [_system("llmq[transformers]", "llmq", "float32", (1, 21.0, 0.1, 0.03),
                       (64, 231.0, 4.1, 0.51)),
               _system("vLLM", "peer", "float32", (1, 21.5, 0.1, 0.03), (64, 173.0, 5.3, 0.38)),
               _system("llama-server", "peer", "Q4_1", (1, 97.0, 0.02, 0.15), (64, 169.0, 6.4, 0.4)),
               _system("llmq[llama_cpp]", "llmq", "Q4_1", (1, 78.0, 0.03, 0.12),
                       (64, 160.6, 7.0, 0.37)),
               {"name": "llmq[vllm]", "role": "llmq", "dtype": "float32", "levels": [],
                "error": "RuntimeError: worker exited"}]
    return {"levels": [1, 64], "requests": [8, 128], "max_tokens": 64, "prompt_tokens": 40,
            "load_avg_start": [1.5, 1, 1], "load_avg_end": [2.0, 1, 1], "systems": systems}


def test_each_row_is_read_against_the_best_peer_at_its_level():
    peers = _peers_result()
    best = best_peer_ratios(peers["systems"])
    assert best == {1: {"name": "llama-server", "tokens_per_s": 97.0},
                    64: {"name": "vLLM", "tokens_per_s": 173.0}}
    llmq = peers["systems"][0]["levels"]
    assert llmq[0]["over_best_peer"] == pytest.approx(21 / 97, abs=1e-3)
    assert llmq[1]["over_best_peer"] == pytest.approx(231 / 173, abs=1e-3)
    assert peers["systems"][2]["levels"][0]["over_best_peer"] == 1.0
    # Without a peer that ran, there is nothing to be read against.
    alone = [_system("llmq[transformers]", "llmq", "float32", (1, 21.0, 0.1, 0.03))]
    assert best_peer_ratios(alone) == {} and alone[0]["levels"][0]["over_best_peer"] is None


def test_the_peer_targets_follow_the_issues_bars_for_the_systems_that_ran():
    peers = _peers_result()
    best_peer_ratios(peers["systems"])
    t = {x["name"]: x for x in peer_targets(peers, "transformers")}
    assert t["peers: llmq[transformers] >= best peer @64"]["met"] is True
    assert t["peers: llmq[transformers] >= best peer @16"]["met"] is None   # not measured
    assert t["peers: llmq[transformers] >= 0.5 of the compute limit @64"]["met"] is True
    same = t["peers: llmq[llama_cpp] >= 0.95 x llama-server @64"]
    assert same["value"] == pytest.approx(160.6 / 169, abs=1e-3) and same["met"] is True
    assert t["peers: llmq[llama_cpp] >= 0.95 x llama-server @1"]["met"] is False
    # llmq[vllm] failed to start: no pair target for it.
    assert not [name for name in t if "llmq[vllm]" in name]


def test_bfloat16_is_read_against_its_float32_twin_at_64_round_by_round():
    peers = _peers_result()
    peers["systems"][0]["dtype"] = "bfloat16"
    for lv, rounds in zip(peers["systems"][0]["levels"], ([21, 20], [231.0, 220.0])):
        lv["rounds_tokens_per_s"] = rounds
    twin = _system("llmq[transformers] float32", "llmq", "float32", (1, 20.0, 0.1, 0.03),
                   (64, 140.0, 5.0, 0.6))
    twin["levels"][1]["rounds_tokens_per_s"] = [140.0, 125.0]
    peers["systems"].insert(1, twin)
    best_peer_ratios(peers["systems"])
    t = {x["name"]: x for x in peer_targets(peers, "transformers")}
    bar = t["peers: llmq[transformers] bfloat16 >= 1.6 x float32 @64"]
    assert bar["value"] == pytest.approx(231 / 140, abs=1e-3) and bar["met"] is True
    assert bar["rounds"] == [pytest.approx(231 / 140, abs=1e-3), pytest.approx(220 / 125, abs=1e-3)]
    twin["levels"][1]["tokens_per_s_all"] = 150.0
    t = {x["name"]: x for x in peer_targets(peers, "transformers")}
    assert t["peers: llmq[transformers] bfloat16 >= 1.6 x float32 @64"]["met"] is False
    # The twin is llmq's own row: never the best peer.
    assert best_peer_ratios(peers["systems"])[64]["name"] == "vLLM"
    # No twin (a float32 host): no such bar.
    assert not [n for n in peer_targets(_peers_result(), "transformers") if "x float32" in n["name"]]


def test_the_quality_guard_is_a_target_per_judged_variant():
    from bench.report import quality_targets

    cmp = {"teacher_forced_match": 0.99, "answers_unchanged": 8, "passed": True}
    quality = {"prompts": 16, "tokens": 64, "reference": "float32", "target": 0.95,
               "answers": {"float32": "Paris"}, "decode_tokens_per_s": {"float32": 40.0},
               "bfloat16": cmp, "float32, float16 KV cache": {**cmp, "passed": False}}
    t = {x["name"]: x for x in quality_targets(quality)}
    assert list(t) == ["quality: bfloat16 >= 95% of float32's greedy tokens, Paris kept",
                       "quality: float32, float16 KV cache >= 95% of float32's greedy tokens, "
                       "Paris kept"]
    first = next(iter(t.values()))
    assert first["met"] is True and first["value"] == 0.99 and "8/16 answers" in first["note"]
    assert list(t.values())[1]["met"] is False
    assert quality_targets(None) == []


def test_the_peers_table_comes_first_with_a_row_per_system_and_level():
    peers = _peers_result()
    best_peer_ratios(peers["systems"])
    eff = {"cpu": {"model": "Xeon", "flags": ["avx2", "avx512_bf16"]}}
    table = format_table({"peers": peers, "efficiency": eff, "targets": []})
    lines = table.splitlines()
    assert lines[0].startswith("Peers: the same load for all")
    assert "flags: avx2 avx512_bf16" in lines[1]
    row = next(x for x in lines if "64 llmq[transformers]" in x)
    assert row.split()[3:] == ["231.0", "4100", "-", "8200", "50", "200", "1.33", "51%", "0"]
    assert "llmq[vllm]: error: RuntimeError: worker exited" in table
    assert table.index("vLLM") < table.index("llmq[llama_cpp]")
    assert "WARNING" not in table
    # A GGUF row past float32's limit at batch 1 reads fewer bytes: no warning for it.
    peers["systems"][2]["levels"][0]["compute_fraction"] = 2.9
    assert "WARNING" not in format_table({"peers": peers, "targets": []})
    # A float row past its limit says the rates were measured on a busy machine.
    peers["systems"][1]["levels"][0]["compute_fraction"] = 1.7
    assert "above 100% of the limit" in format_table({"peers": peers, "targets": []})


def test_the_batch_summary_shows_the_steps_that_held_batch_prefill():
    from bench.report import format_batch

    batch = {"lines": 300, "tokens_per_line": 16, "status": "completed", "completed": 300,
             "failed": 0, "seconds": 30.0, "lines_per_s": 10.0, "ttft_idle_p50": 0.1,
             "ttft_during_p50": 0.15, "probes_idle": 10, "probes_during": 20,
             "ttft_ratio": 1.5, "ms_per_step": 120.0, "excess_in_steps": 0.4,
             "time_split": {"steps": 400}, "held_steps": 300}
    assert "batch prefill held beside interactive requests in 300 of 400 steps (75%" in \
        "\n".join(format_batch(batch))
    # A result from before the hold has no such line.
    del batch["held_steps"]
    assert "held" not in "\n".join(format_batch(batch))


def test_the_batch_summary_shows_how_many_probes_were_interjected():
    from bench.report import format_batch

    batch = {"lines": 300, "tokens_per_line": 16, "status": "completed", "completed": 300,
             "failed": 0, "seconds": 30.0, "lines_per_s": 10.0, "ttft_idle_p50": 0.1,
             "ttft_during_p50": 0.15, "probes_idle": 10, "probes_during": 20,
             "ttft_ratio": 1.5, "ms_per_step": 120.0, "excess_in_steps": 0.4,
             "time_split": {"steps": 400}, "held_steps": 300, "interjected": 17}
    assert ("interactive requests prefilled inside a batch step in flight: 17 of 20"
            in "\n".join(format_batch(batch)))
    del batch["interjected"]   # a result from before interjection
    assert "inside a batch step" not in "\n".join(format_batch(batch))


def _with_mixed(peers: dict, rows: dict[str, tuple[float, float, float]]) -> dict:
    """The mixed load's row (tok/s, TTFT p50, TTFT p95) added to each named system, at 16
    streams, beside a uniform c=16 row of other numbers (the two must not be confused)."""
    peers["mixed"] = {"streams": 16, "prompts": 48, "prompt_tokens_range": [16, 3000],
                      "mean_prompt_tokens": 600.0}
    for sys_ in peers["systems"]:
        if sys_["name"] in rows:
            tps, p50, p95 = rows[sys_["name"]]
            sys_["levels"].append({"concurrency": 16, "tokens_per_s_all": 999.0,
                                   "ttft_p50_s": 0.01, "ttft_p95_s": 0.01, "ttft_p99_s": 0.01,
                                   "itl_p50_s": 0.05, "failures": 0})
            sys_["levels"].append({"concurrency": 16, "load": "mixed", "tokens_per_s_all": tps,
                                   "ttft_p50_s": p50, "ttft_p95_s": p95, "ttft_p99_s": p95,
                                   "itl_p50_s": 0.05, "failures": 1, "compute_fraction": None})
    return peers


def test_the_mixed_load_is_its_own_row_read_against_the_best_peer_on_it():
    peers = _with_mixed(_peers_result(), {"llmq[transformers]": (60.0, 5.0, 20.0),
                                          "vLLM": (35.5, 10.7, 18.7),
                                          "llama-server": (23.4, 15.1, 36.3)})
    best = best_peer_ratios(peers["systems"])
    assert best["mixed"] == {"name": "vLLM", "tokens_per_s": 35.5}
    assert best[16]["tokens_per_s"] == 999.0
    t = {x["name"]: x for x in peer_targets(peers, "transformers")}
    bar = t["peers: llmq[transformers] >= 1.5 x best peer, mixed load"]
    assert bar["value"] == pytest.approx(60 / 35.5, abs=1e-3) and bar["met"] is True
    assert t["peers: llmq[transformers] TTFT p50 below every peer's, mixed load"]["value"] == \
        pytest.approx(5.0 / 10.7, abs=1e-3)
    p95 = t["peers: llmq[transformers] TTFT p95 below every peer's, mixed load"]
    assert p95["value"] == pytest.approx(20.0 / 18.7, abs=1e-3) and p95["met"] is False
    table = "\n".join(format_peers(peers))
    assert "mixed load, 16 streams over 48 prompts of 16-3000 tokens (mean 600)" in table
    mix = [line for line in table.splitlines() if line.strip().startswith("mix ")]
    assert [line.split()[1] for line in mix] == ["llmq[transformers]", "vLLM", "llama-server"]
    assert mix[0].split()[3:6] == ["60.0", "5000", "20000"]   # tok/s, TTFT p50 and p95 (ms)
    # Without the mixed load: no such bar.
    assert not [n for n in peer_targets(_peers_result(), "transformers") if "mixed" in n["name"]]


def test_the_table_says_where_llmqs_cpu_went_per_token_by_layer():
    peers = _peers_result()
    peers["systems"][0]["levels"][1]["cpu_ms_per_token"] = {
        "model": 6.0, "engine": 1.5, "api": 2.0, "redis": 0.5, "total": 10.0}
    peers["systems"][1]["levels"][1]["cpu_ms_per_token"] = {"server": 9.0, "total": 9.0}
    lines = [x for x in format_peers(peers) if "frontend" in x]
    assert len(lines) == 2 and "by layer" in lines[0]      # a heading, llmq's one row: no peer
    assert lines[1].split() == ["llmq[transformers]", "c=64", "model", "6.00,", "engine", "1.50,",
                                "api", "2.00,", "redis", "0.50;", "total", "10.00", "(frontend",
                                "40%)"]
