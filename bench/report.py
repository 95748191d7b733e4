"""Summaries of request results, the targets, the printed table and the PNG plot."""
from __future__ import annotations

from pathlib import Path

from .efficiency import DTYPES, format_served
from .loadgen import RequestResult
from .peers_mixed import MIXED

FLOAT32_LABEL = "float32"   # the name's suffix of the default backend's float32 twin row


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np

    return round(float(np.percentile(values, q)), 4)


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    ttft_text = [r.ttft_text for r in ok if r.ttft_text is not None]
    itl = [g for r in ok for g in r.gaps()]
    lat = [r.latency for r in ok if r.latency is not None]
    # A request the time limit cancelled took at least its time until then. Counted at that
    # lower bound, a run that leaves many requests unfinished cannot look fast by leaving
    # its slowest out of its percentiles.
    cut = [r for r in failed if r.status == "cancelled" and r.latency is not None]
    censored = [r.latency for r in cut]
    # ... and the tokens it made before then are work done in the window.
    all_tokens = tokens + sum(r.completion_tokens for r in cut)
    cancelled_only = bool(failed) and all(r.status == "cancelled" for r in failed)
    multi = [r for r in ok if len(r.token_times) >= 2]
    # Streams whose token events all arrived at once: the server buffered the SSE response.
    buffered = sum(1 for r in multi if r.token_times[-1] - r.token_times[0] < 1e-3)
    return {
        "requests": len(results), "ok": len(ok), "failures": len(failed),
        "failure_examples": sorted({r.describe_failure() for r in failed})[:3],
        "wall_s": round(wall_s, 3), "completion_tokens": tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        # None, not 0, when nothing finished because the time limit cancelled it all.
        "tokens_per_s": (round(tokens / wall_s, 2) if wall_s > 0 and (ok or not cancelled_only)
                         else None),
        "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95), "ttft_p99_s": pct(ttft, 99),
        # The stream has an event per token; a first token without text (a special token)
        # leaves the first text later.
        "ttft_text_p50_s": pct(ttft_text, 50),
        "itl_p50_s": pct(itl, 50), "itl_p95_s": pct(itl, 95), "itl_p99_s": pct(itl, 99),
        "latency_p50_s": pct(lat, 50), "latency_p95_s": pct(lat, 95), "latency_p99_s": pct(lat, 99),
        "cut_requests": len(censored),
        "tokens_per_s_all": round(all_tokens / wall_s, 2) if wall_s > 0 else None,
        "latency_p50_all_s": pct(lat + censored, 50), "latency_p99_all_s": pct(lat + censored, 99),
        "buffered_streams": buffered,
        "mean_token_events": round(sum(len(r.token_times) for r in ok) / len(ok), 1) if ok else None,
    }


def ratio(a, b):
    """a / b to three places; None when either is missing (or b is 0)."""
    return round(a / b, 3) if a is not None and b else None


def time_split(before: dict, after: dict, wall_s: float) -> dict | None:
    """A level's worker time from the engine's StepTiming totals (worker/engine_core.py):
    shares of the level's wall time spent in model compute (prefill, decode), in the
    engine<->model-process round trip beyond that compute (pipe, pickling), in the engine's
    own work around steps, and outside any step (waiting for work)."""
    if not before or not after or wall_s <= 0:
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("steps", 0)
    if steps <= 0:
        return None
    compute = d["model_prefill_s"] + d["model_decode_s"]
    ipc = max(0.0, d["step_s"] - compute)
    out = {"steps": int(steps), "ms_per_step": round(1000 * d["step_s"] / steps, 1),
           "prefill": d["model_prefill_s"] / wall_s, "decode": d["model_decode_s"] / wall_s,
           "round_trip": ipc / wall_s, "engine": d["host_s"] / wall_s,
           "publish_overlapped": d["publish_s"] / wall_s}
    out["outside_steps"] = max(0.0, 1.0 - out["prefill"] - out["decode"] - out["round_trip"]
                               - out["engine"])
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def format_split(split: dict | None) -> str:
    if not split:
        return "n/a"
    pct = {k: f"{100 * v:.1f}%" for k, v in split.items() if isinstance(v, float) and k != "ms_per_step"}
    return (f"{split['steps']} steps of {split['ms_per_step']} ms; model prefill {pct['prefill']}, "
            f"decode {pct['decode']}, round trip {pct['round_trip']}, engine {pct['engine']}, "
            f"between steps {pct['outside_steps']} (Redis publish {pct['publish_overlapped']}, "
            f"overlapped with compute)")


def compute_ratios(raw: dict | None, served: list[dict], mixed: dict | None) -> dict:
    raw_by_batch = {}
    if raw:
        raw_by_batch = {r["batch"]: r for r in raw["results"]}
    per_level = {}
    for level in served:
        c = level["concurrency"]
        r = raw_by_batch.get(c)
        same = r is not None and r["new_tokens"] == level["max_tokens"]
        per_level[str(c)] = ratio(level["tokens_per_s"], r["tokens_per_s"]) if same else None
    out = {"served_over_raw": per_level}
    if mixed and "continuous" in mixed and "static" in mixed:
        out["continuous_over_static_throughput"] = ratio(_tps_all(mixed["continuous"]),
                                                          _tps_all(mixed["static"]))
        out["continuous_over_static_p99_latency"] = ratio(_p99_all(mixed["continuous"]),
                                                           _p99_all(mixed["static"]))
    return out


def _tps_all(s: dict):
    """Output tokens/s counting what requests cut by the time limit had made."""
    return s.get("tokens_per_s_all", s.get("tokens_per_s"))


def _p99_all(s: dict):
    """p99 latency counting requests cut by the time limit at their cut time (older results
    lack the field: the finished requests' p99)."""
    return s.get("latency_p99_all_s", s.get("latency_p99_s"))


def targets(served: list[dict], ratios: dict, mixed: dict | None,
            prefix: dict | None = None, raw: dict | None = None,
            stop_strings: dict | None = None, lengths: dict | None = None) -> list[dict]:
    by_c = {lv["concurrency"]: lv for lv in served}
    out = []
    for c in (64, 1):
        v = ratios["served_over_raw"].get(str(c))
        out.append({"name": f"served@{c} >= 0.9 x raw@{c}", "value": v,
                    "met": None if v is None else v >= 0.9})
    v = ratios.get("continuous_over_static_throughput")
    met = None
    if v is not None:
        c99, s99 = _p99_all(mixed["continuous"]), _p99_all(mixed["static"])
        met = v >= 1.5 and c99 is not None and s99 is not None and c99 < s99
    out.append({"name": "mixed: continuous >= 1.5 x static throughput, lower p99", "value": v,
                "met": met})
    lv = by_c.get(64)
    v = lv["ttft_p50_s"] if lv else None
    ttft = {"name": "TTFT p50 @64 < 1 s", "value": v, "met": None if v is None else v < 1.0}
    raw_first = {r["batch"]: r.get("first_token_s")
                 for r in (raw or {}).get("results", [])}.get(64)
    if raw_first is not None:
        # How long generate takes to give 64 prompts that arrive together their first tokens:
        # what the served figure is read against.
        ttft["raw_first_token_s"] = raw_first
    out.append(ttft)
    if prefix is not None:
        v = prefix.get("ttft_p50_with_over_without")
        out.append({"name": "stretch: prefix caching, chat TTFT p50 with / without reuse < 1",
                    "value": v, "met": None if v is None else v < 1.0})
    if stop_strings is not None:
        v = stop_strings.get("step_worst_over_plain")
        out.append({"name": "stop strings: engine step with worst-case stops / plain <= 1.1",
                    "value": v, "met": None if v is None else v <= 1.1})
    return out + lengths_targets(lengths)


def lengths_targets(lengths: dict | None) -> list[dict]:
    """The mixed-lengths phase's targets (issue 22), one pair per long prompt size."""
    out = []
    for run in (lengths or {}).get("runs", []):
        if not run["long_prompt_tokens"]:
            continue
        n = run["long_prompt_tokens"]
        v = run.get("short_p50_over_alone")
        out.append({"name": f"lengths: short p50 beside 1 x {n} tokens <= 1.5 x alone",
                    "value": v, "met": None if v is None else v <= 1.5})
        v = run.get("rss_growth_over_kv")
        out.append({"name": f"lengths: model RSS growth beside 1 x {n} <= 1.25 x its KV bytes",
                    "value": v, "met": None if v is None else v <= 1.25})
    return out


# --- the baseline comparison (bench/baseline.py) and the batch phase (bench/batch.py) -----------
# The float32 tok/s ratio against the previous main each issue asks for, per level.
BASELINE_BARS = {1: ((0.97, "issue 13"),), 64: ((0.97, "issue 13"), (0.95, "issue 22"))}


def baseline_targets(baseline: dict) -> list[dict]:
    """One row per bar: llmq at the judged dtype over the baseline's tok/s, its TTFT p50 beside;
    a baseline that did not run gives rows that say why."""
    name = baseline.get("short") or baseline["ref"]
    rows = {r["concurrency"]: r for r in baseline.get("comparison", []) if r["judged"]}
    out = []
    for c, bars in BASELINE_BARS.items():
        row = rows.get(c)
        if row and row["ttft_p50_s"] is not None and row["baseline_ttft_p50_s"] is not None:
            note = (f"TTFT p50 {row['ttft_p50_s'] * 1000:.0f} ms vs "
                    f"{row['baseline_ttft_p50_s'] * 1000:.0f} ms")
        else:
            note = f"baseline error: {baseline['error']}" if baseline.get("error") else None
        for bar, issue in bars:
            v = row["ratio"] if row else None
            out.append({"name": f"vs baseline {name} c={c}: {baseline['judged_dtype']} tok/s "
                                f"ratio >= {bar} ({issue})",
                        "value": v, "met": None if v is None else v >= bar, "note": note})
    return out


def batch_targets(batch: dict) -> list[dict]:
    v = batch.get("ttft_ratio")
    return [{"name": "batch: interactive TTFT p50 during the batch <= 2 x idle (issue 16)",
             "value": v, "met": None if v is None else v <= 2.0,
             "note": f"{batch['lines']} lines at {batch['lines_per_s']} lines/s, {batch['status']}"}]


def format_baseline(baseline: dict | None) -> list[str]:
    if not baseline:
        return []
    name = baseline.get("short") or baseline["ref"]
    lines = [f"Baseline: llmq against {name} ({baseline['ref']}), each on its own stack from "
             f"its own tree; same venv, redis-server, model and prompts, "
             f"{baseline['max_tokens']} tokens per request, closed loop, "
             f"{baseline['rounds']} rounds in turn, medians; times in ms"
             + (f"; load avg {baseline['load_avg_start'][0]:.1f} -> "
                f"{baseline['load_avg_end'][0]:.1f}" if baseline.get("load_avg_end") else "")]
    if baseline.get("overlaid") or baseline.get("not_overlaid"):
        lines.append(f"  the baseline's own pins on its stack's path: "
                     f"{' '.join(baseline.get('overlaid') or []) or 'none'}; differing, left as "
                     f"this venv has them: {' '.join(baseline.get('not_overlaid') or []) or 'none'}")
    by = {(r["system"], r["concurrency"]): r for r in baseline.get("comparison", [])}
    if any(s["levels"] for s in baseline["systems"]):
        lines.append(f"  {'conc':>4} {'system':<26} {'tok/s':>7} {'rounds':>15} {'TTFT50':>7}"
                     f" {'ITL50':>6} {'fail':>4} {'x base':>6} {'TTFT x':>6}")
    for c in baseline["levels"]:
        for s in baseline["systems"]:
            lv = next((x for x in s["levels"] if x["concurrency"] == c), None)
            if lv is None:
                continue
            row = by.get((s["name"], c), {})
            rounds = "/".join(_f(v, "{:.1f}") for v in lv["rounds_tokens_per_s"])
            lines.append(f"  {c:>4} {s['name']:<26} {_f(lv['tokens_per_s']):>7} {rounds:>15}"
                         f" {_ms(lv['ttft_p50_s']):>7} {_ms(lv['itl_p50_s']):>6}"
                         f" {lv['failures']:>4} {_f(row.get('ratio'), '{:.3f}'):>6}"
                         f" {_f(row.get('ttft_ratio'), '{:.2f}'):>6}"
                         f"{'  (cut by time limit)' if lv['truncated'] else ''}")
    for s in baseline["systems"]:
        if s.get("error"):
            lines.append(f"  {s['name']}: error: {s['error']}")
        if s.get("model_restarts"):
            lines.append(f"  WARNING: {s['name']}'s model process crashed and restarted "
                         f"{s['model_restarts']} times (see its worker log): its figures are not "
                         "its speed")
    if baseline.get("error") and not any(s.get("error") for s in baseline["systems"]):
        lines.append(f"  error: {baseline['error']}")
    lines.append("")
    return lines


def format_batch(batch: dict | None) -> list[str]:
    if not batch:
        return []
    return [f"Batch API: {batch['lines']} lines x {batch['tokens_per_line']} tokens, "
            f"{batch['status']} ({batch['completed']} completed, {batch['failed']} failed) in "
            f"{batch['seconds']} s: {batch['lines_per_s']} lines/s",
            f"  interactive TTFT p50: idle {_ms(batch['ttft_idle_p50'])} ms "
            f"({batch['probes_idle']} probes), during the batch {_ms(batch['ttft_during_p50'])} ms "
            f"({batch['probes_during']} probes): x{_f(batch.get('ttft_ratio'), '{:.2f}')} "
            f"(target <= 2); engine step {_f(batch.get('ms_per_step'), '{:.0f}')} ms on average "
            f"during the batch, the difference {_f(batch.get('excess_in_steps'), '{:.2f}')} steps",
            *_held_line(batch), ""]


def _held_line(batch: dict) -> list[str]:
    """Steps whose batch newcomers waited beside interactive traffic (LLMQ_PRIORITY_HOLD_STEPS;
    absent from results before it)."""
    split, held = batch.get("time_split") or {}, batch.get("held_steps")
    if held is None or not split.get("steps"):
        return []
    lines = [f"  batch prefill held beside interactive requests in {held} of {split['steps']} "
             f"steps ({100 * held / split['steps']:.0f}%, LLMQ_PRIORITY_HOLD_STEPS)"]
    if batch.get("interjected") is not None:   # (absent from results before interjection)
        lines.append(f"  interactive requests prefilled inside a batch step in flight: "
                     f"{batch['interjected']} of {batch['probes_during']} "
                     f"(LLMQ_PRIORITY_INTERJECT)")
    return lines


# --- peers (bench/peers.py) ---------------------------------------------------------------------
# llmq's backends against the peer that runs the same engine, and the issue's bar for each:
# (peer, minimum tok/s ratio, the levels it holds at, TTFT p50 at most this x the peer's).
SAME_ENGINE = {"llama_cpp": ("llama-server", 0.95, None, None), "vllm": ("vLLM", 0.9, (1, 64), 1.2)}
# Issue 17: where the default backend serves in a lower precision the hardware computes natively
# (bfloat16 on AVX512-BF16/AMX), it serves at least this x its float32 twin at c=64.
LOW_PRECISION_BAR = 1.6
# Issue 52: on the mixed load, the default backend serves at least this x the best peer.
MIXED_BAR = 1.5


def level_key(lv: dict):
    """What a peers row is the row of: its load's name (the mixed load), else its concurrency."""
    return lv.get("load") or lv["concurrency"]


def best_peer_ratios(systems: list[dict]) -> dict[int, dict]:
    """Marks each level of each system with its tok/s over the best peer's at that level (the
    peers' own rows too); returns {concurrency: {"name", "tokens_per_s"}} of the best peers."""
    best: dict[int, dict] = {}
    for sys_ in systems:
        for lv in sys_.get("levels", []) if sys_["role"] == "peer" else []:
            tps = lv.get("tokens_per_s_all")
            if tps and tps > best.get(level_key(lv), {}).get("tokens_per_s", 0):
                best[level_key(lv)] = {"name": sys_["name"], "tokens_per_s": tps}
    for sys_ in systems:
        for lv in sys_.get("levels", []):
            lv["over_best_peer"] = ratio(lv.get("tokens_per_s_all"),
                                          best.get(level_key(lv), {}).get("tokens_per_s"))
    return best


def _level(systems: list[dict], name: str, c: int) -> dict | None:
    sys_ = next((s for s in systems if s["name"] == name), None)
    return next((lv for lv in (sys_ or {}).get("levels", []) if level_key(lv) == c), None)


def paired_rounds(ours: dict | None, theirs: dict | None) -> dict:
    """Round by round, ours over theirs at one level: under interleaved order the two ran back
    to back, so each ratio is one like-for-like comparison, and their spread shows how far the
    best-of-rounds verdict can be trusted. {} with a single round."""
    a, b = ((x or {}).get("rounds_tokens_per_s") or [] for x in (ours, theirs))
    if len(a) < 2 or len(a) != len(b):
        return {}
    rounds = [ratio(x, y) for x, y in zip(a, b)]
    return {"rounds": rounds, "note": "round by round " + " ".join(_f(r, "{:.2f}") for r in rounds)}


def peer_targets(peers: dict, backend: str) -> list[dict]:
    """Issue 17's bars (llmq[backend] at or above the best peer at c=16 and 64, at least half
    the compute limit at c=64) and each same-engine pair's (issue 14 for vLLM, 17 for
    llama.cpp), for the systems that ran."""
    systems, out = peers["systems"], []
    best = best_peer_ratios(systems)
    for c in (16, 64):
        lv = _level(systems, f"llmq[{backend}]", c)
        v = lv and lv.get("over_best_peer")
        peer = best.get(c, {}).get("name")
        pairs = paired_rounds(lv, peer and _level(systems, peer, c))
        if peer:
            pairs["note"] = "; ".join([f"best peer {peer}"] + ([pairs["note"]] if pairs else []))
        out.append({"name": f"peers: llmq[{backend}] >= best peer @{c}", "value": v,
                    "met": None if v is None else v >= 1.0, **pairs})
    lv = _level(systems, f"llmq[{backend}]", 64)
    v = lv and lv.get("compute_fraction")
    alone = next((m for m in peers.get("model_alone") or []
                  if m["system"] == f"llmq[{backend}]" and m["concurrency"] == 64
                  and not m.get("error")), None)
    out.append({"name": f"peers: llmq[{backend}] >= 0.5 of the compute limit @64", "value": v,
                "met": None if v is None else v >= 0.5,
                **({"note": f"its model worker alone in this process on the same load: "
                            f"{_f(alone.get('compute_fraction'), '{:.3f}')}, its decode steps "
                            f"alone {_f(alone.get('decode_compute_fraction'), '{:.3f}')}"}
                   if alone else {})})
    out += low_precision_targets(systems, backend)
    out += mixed_targets(systems, backend)
    for engine, (peer, bar, at, ttft_bar) in SAME_ENGINE.items():
        name = f"llmq[{engine}]"
        if not any(s["name"] == name and s.get("levels") for s in systems):
            continue
        for c in at or peers["levels"]:
            ours, theirs = _level(systems, name, c), _level(systems, peer, c)
            v = ratio(ours and ours.get("tokens_per_s_all"), theirs and theirs.get("tokens_per_s_all"))
            out.append({"name": f"peers: {name} >= {bar} x {peer} @{c}", "value": v,
                        "met": None if v is None else v >= bar,
                        **paired_rounds(ours, theirs)})
            if ttft_bar:
                v = ratio(ours and ours.get("ttft_p50_s"), theirs and theirs.get("ttft_p50_s"))
                out.append({"name": f"peers: {name} TTFT p50 <= {ttft_bar} x {peer} @{c}",
                            "value": v, "met": None if v is None else v <= ttft_bar})
    return out


def mixed_targets(systems: list[dict], backend: str) -> list[dict]:
    """Issue 52's bars on the mixed load: llmq[backend] at least MIXED_BAR x the best peer's
    output tok/s, and its TTFT p50 and p95 each below every peer's (the value: over the
    lowest peer's). [] where the mixed load did not run."""
    ours = _level(systems, f"llmq[{backend}]", MIXED)
    if ours is None:
        return []
    peers = [lv for s in systems if s["role"] == "peer"
             for lv in s.get("levels", []) if level_key(lv) == MIXED]
    v = ours.get("over_best_peer")
    out = [{"name": f"peers: llmq[{backend}] >= {MIXED_BAR} x best peer, mixed load",
            "value": v, "met": None if v is None else v >= MIXED_BAR}]
    for p in (50, 95):
        key = f"ttft_p{p}_s"
        lowest = min((lv[key] for lv in peers if lv.get(key) is not None), default=None)
        v = ratio(ours.get(key), lowest)
        out.append({"name": f"peers: llmq[{backend}] TTFT p{p} below every peer's, mixed load",
                    "value": v, "met": None if v is None else v < 1.0})
    return out


def low_precision_targets(systems: list[dict], backend: str) -> list[dict]:
    """The default backend in its dtype over its float32 twin (bench/peers.py adds that row
    where the two differ) at c=64, round by round beside the best-of-rounds ratio; [] where
    there is no twin (a float32 host, or --skip-float32-row)."""

    main = next((s for s in systems if s["name"] == f"llmq[{backend}]"), None)
    twin = f"llmq[{backend}] {FLOAT32_LABEL}"
    if main is None or not any(s["name"] == twin for s in systems):
        return []
    ours, theirs = _level(systems, main["name"], 64), _level(systems, twin, 64)
    v = ratio(ours and ours.get("tokens_per_s_all"), theirs and theirs.get("tokens_per_s_all"))
    return [{"name": f"peers: llmq[{backend}] {main['dtype']} >= {LOW_PRECISION_BAR} x float32 @64",
             "value": v, "met": None if v is None else v >= LOW_PRECISION_BAR,
             **paired_rounds(ours, theirs)}]


def quality_targets(quality: dict | None) -> list[dict]:
    """The quality guard's verdict per judged variant (bench/quality.py): its greedy tokens
    teacher-forced against float32's at least the target share, and the Paris answer kept;
    how many of the answers came out word for word the same goes beside it."""
    if not quality:
        return []
    out = []
    for name, cmp in quality.items():
        if not isinstance(cmp, dict) or "teacher_forced_match" not in cmp:
            continue
        out.append({"name": f"quality: {name} >= {quality['target']:.0%} of {quality['reference']}'s "
                            "greedy tokens, Paris kept",
                    "value": cmp["teacher_forced_match"], "met": bool(cmp["passed"]),
                    "note": f"{cmp['answers_unchanged']}/{quality['prompts']} answers unchanged"})
    return out


def format_peers(peers: dict | None, eff: dict | None = None) -> list[str]:
    """The bench's first table: every system at each level, same load, same client."""
    if not peers:
        return []
    how = ("all kept up, taking turns at each level" if peers.get("order") == "interleaved"
           else "one system at a time")
    lines = [f"Peers: the same load for all, {how} (streaming /v1/completions, "
             f"{peers['prompt_tokens']}-token prompts, {peers['max_tokens']} tokens each, closed "
             f"loop; requests {'/'.join(map(str, peers['requests']))}; load avg "
             f"{peers['load_avg_start'][0]:.1f} -> {peers['load_avg_end'][0]:.1f}; times in ms)"]
    if eff:
        lines.append(f"  CPU: {eff['cpu']['model']}; flags: {' '.join(eff['cpu']['flags'])}")
    mixed = peers.get("mixed")
    if mixed:
        lines.append(f"  mix: the mixed load, {mixed['streams']} streams over {mixed['prompts']} "
                     f"prompts of {mixed['prompt_tokens_range'][0]}-"
                     f"{mixed['prompt_tokens_range'][1]} tokens (mean "
                     f"{mixed['mean_prompt_tokens']:.0f}), {peers['max_tokens']} tokens each")
    lines.append(f"  {'conc':>4} {'system':<26} {'dtype':<8} {'tok/s':>7} {'TTFT50':>7} {'TTFT95':>7}"
                 f" {'TTFT99':>7} {'ITL50':>6} {'ITL99':>6} {'x best':>6} {'limit':>6} {'fail':>4}")
    for c in peers["levels"] + ([MIXED] if mixed else []):
        for sys_ in peers["systems"]:
            lv = next((x for x in sys_.get("levels", []) if level_key(x) == c), None)
            if lv is None:
                continue
            label = "mix" if c == MIXED else c
            lines.append(
                f"  {label:>4} {sys_['name']:<26} {sys_['dtype']:<8} {_f(lv['tokens_per_s_all']):>7}"
                f" {_ms(lv['ttft_p50_s']):>7} {_ms(lv.get('ttft_p95_s')):>7}"
                f" {_ms(lv['ttft_p99_s']):>7} {_ms(lv['itl_p50_s']):>6}"
                f" {_ms(lv.get('itl_p99_s')):>6} {_f(lv.get('over_best_peer'), '{:.2f}'):>6}"
                f" {_f(lv.get('compute_fraction') and 100 * lv['compute_fraction'], '{:.0f}%'):>6}"
                f" {lv['failures']:>4}{'  (cut by time limit)' if lv.get('truncated') else ''}")
    for sys_ in peers["systems"]:
        if sys_.get("skipped") or sys_.get("error"):
            what = f"skipped: {sys_['skipped']}" if sys_.get("skipped") else f"error: {sys_['error']}"
            lines.append(f"  {sys_['name']}: {what}")
    # Only rows in a probed dtype: a GGUF row is read against float32's rate, and at batch 1,
    # where a step is bound by reading the weights, Q4 weights (a sixth of float32's bytes) go
    # past it honestly (293% for llama-server at c=1 on an AVX2-only EPYC).
    if any((lv.get("compute_fraction") or 0) > 1 for x in peers["systems"]
           if x["dtype"] in DTYPES for lv in x["levels"]):
        lines.append("  WARNING: a row is above 100% of the limit: the matmul rates were measured "
                     "while other processes held the CPU; the limit column is not to be trusted")
    if peers.get("rounds", 1) > 1:
        lines.append(f"  each row is the best of {peers['rounds']} rounds, the systems in turn; "
                     "tok/s of every round (others idle: their CPU meanwhile, % of a core):")
        for sys_ in peers["systems"]:
            for lv in sys_.get("levels", []):
                idle = lv.get("bystanders_cpu_pct")
                lines.append(f"    {sys_['name']:<26} c={level_key(lv)!s:<3} "
                             + " ".join(_f(t) for t in lv.get("rounds_tokens_per_s", []))
                             + (f"  (others idle: {idle}%)" if idle is not None else ""))
    lines.append("  (x best: tok/s over the best peer's at that concurrency; limit: tok/s x "
                 "FLOPs/token over this machine's matmul rate at that batch, in the row's dtype; "
                 "GGUF rows against float32's)")
    lines.extend(format_cpu_per_token(peers["systems"]))
    lines.extend(format_model_alone(peers.get("model_alone")))
    lines.append("")
    return lines


def format_cpu_per_token(systems: list[dict]) -> list[str]:
    """Where llmq's CPU went per output token, by layer (the model process; the Celery worker
    around it, whose engine loop feeds it; the API; Redis), each row of the table: the part
    beside the model is the frontend's cost, on the cores the model computes on."""
    lines = []
    for sys_ in systems:
        for lv in sys_.get("levels", []) if sys_["role"] == "llmq" else []:
            cpu = lv.get("cpu_ms_per_token") or {}
            if not cpu.get("total"):
                continue
            parts = ", ".join(f"{k} {cpu.get(k, 0):.2f}" for k in ("model", "engine", "api", "redis"))
            front = 1 - cpu.get("model", 0) / cpu["total"]
            lines.append(f"    {sys_['name']:<26} c={level_key(lv)!s:<5} {parts}; total "
                         f"{cpu['total']:.2f} (frontend {front:.0%})")
    return (["  CPU ms per output token by layer (the frontend: all but the model):"] + lines
            if lines else [])


def format_model_alone(alone: list[dict] | None) -> list[str]:
    """The peers load's ceiling (bench/raw.model_alone), a line per llmq[transformers] row."""
    lines = []
    for m in alone or []:
        if m.get("error"):
            lines.append(f"  model alone ({m['system']}, c={m['concurrency']}): {m['error']}")
            continue
        lines.append(
            f"  {m['system']} c={m['concurrency']}, its model worker alone in this process (the "
            f"same {m['rows']} prompts x {m['new_tokens']} tokens, no stack, best of "
            f"{m['rounds']}): {_f(m['tokens_per_s'])} tok/s = {_pct(m.get('compute_fraction'))} "
            f"of the limit: prefill {m['prefill_s']:.2f} s, then decode steps of "
            f"{_ms(m.get('decode_step_p50_s'))} ms ({_f(m.get('decode_tokens_per_s'))} tok/s = "
            f"{_pct(m.get('decode_compute_fraction'))}); served: "
            f"{_f(m.get('served_over_alone'), '{:.2f}')} of it")
    return lines


# --- the table ----------------------------------------------------------------------------------
def _f(v, fmt="{:.1f}", none="-"):
    return none if v is None else fmt.format(v)


def _pct(fraction):
    return _f(fraction and 100 * fraction, "{:.0f}%")


def _ms(v):
    return "-" if v is None else f"{v * 1000:.0f}"


def format_table(result: dict) -> str:
    lines = format_peers(result.get("peers"), result.get("efficiency"))
    raw = result.get("raw")
    if raw:
        what = raw.get("info", {}).get("method", "model.generate")
        lines.append(f"Raw {what} ({raw['new_tokens']} new tokens, greedy, batch = prompts)")
        lines.append(f"  {'batch':>5}  {'tok/s':>8}  {'time s':>7}  {'1st tok ms':>10}")
        for r in raw["results"]:
            cut = f"  (cut: {r['generated_tokens']} of {r['new_tokens']} steps)" if r.get("cut") else ""
            lines.append(f"  {r['batch']:>5}  {r['tokens_per_s']:>8.1f}  {r['elapsed_s']:>7.1f}"
                         f"  {_ms(r.get('first_token_s')):>10}{cut}")
        lines.append("  (1st tok: generate's time to the batch's first tokens, the raw "
                     "counterpart of the served TTFT at that concurrency)")
        lines.append("")
    served = result.get("served") or []
    if served:
        ratios = result["ratios"]["served_over_raw"]
        raw_by = {r["batch"]: r for r in (raw or {}).get("results", [])}
        lines.append(f"Served, closed loop ({served[0]['max_tokens']} tokens per request, "
                     "SSE through gunicorn; times in ms)")
        lines.append(f"  {'conc':>4} {'reqs':>4} {'fail':>4} {'tok/s':>7} {'raw':>7} {'ratio':>5}"
                     f" {'TTFT50':>7} {'TTFT95':>7} {'text50':>7} {'ITL50':>6} {'ITL95':>6}"
                     f" {'lat50':>7} {'lat99':>7}")
        for lv in served:
            c = lv["concurrency"]
            r = raw_by.get(c)
            lines.append(
                f"  {c:>4} {lv['requests']:>4} {lv['failures']:>4} {_f(lv['tokens_per_s']):>7}"
                f" {_f(r['tokens_per_s'] if r else None):>7} {_f(ratios.get(str(c)), '{:.2f}'):>5}"
                f" {_ms(lv['ttft_p50_s']):>7} {_ms(lv['ttft_p95_s']):>7}"
                f" {_ms(lv.get('ttft_text_p50_s')):>7} {_ms(lv['itl_p50_s']):>6}"
                f" {_ms(lv['itl_p95_s']):>6} {_ms(lv['latency_p50_s']):>7}"
                f" {_ms(lv['latency_p99_s']):>7}{'  (cut by time limit)' if lv.get('truncated') else ''}")
        lines.extend(format_served(result.get("efficiency"), served,
                                   result.get("meta", {}).get("dtype", "float32")))
        lines.append("")
    mixed = result.get("mixed")
    if mixed:
        lines.append(f"Mixed workload: {mixed['num_requests']} requests, prompts "
                     f"{mixed['prompt_tokens_range'][0]}-{mixed['prompt_tokens_range'][1]} tokens, "
                     f"outputs {mixed['output_tokens_range'][0]}-{mixed['output_tokens_range'][1]}, "
                     f"Poisson {mixed['rate_per_s']:.3f} req/s, seed {mixed['seed']}")
        lines.append("  (tok/s and lat*: over all requests, those cut by the time limit counted "
                     "with the tokens they had and at their cut time, a lower bound; fin: finished only)")
        lines.append(f"  {'policy':>10} {'reqs':>4} {'cut':>4} {'tok/s':>7} {'wall s':>7}"
                     f" {'lat50 s':>8} {'lat99 s':>8} {'fin p99':>8} {'TTFT50 s':>8} {'TTFT99 s':>8}")
        for name in ("continuous", "static"):
            m = mixed.get(name)
            if not m:
                continue
            lines.append(f"  {name:>10} {m['requests']:>4} {m.get('cut_requests', m['failures']):>4}"
                         f" {_f(_tps_all(m)):>7} {_f(m['wall_s']):>7}"
                         f" {_f(m.get('latency_p50_all_s', m['latency_p50_s']), '{:.2f}'):>8}"
                         f" {_f(_p99_all(m), '{:.2f}'):>8} {_f(m['latency_p99_s'], '{:.2f}'):>8}"
                         f" {_f(m['ttft_p50_s'], '{:.2f}'):>8} {_f(m['ttft_p99_s'], '{:.2f}'):>8}")
        r = result["ratios"].get("continuous_over_static_throughput")
        lines.append(f"  continuous/static throughput: {_f(r, '{:.2f}x')}")
        lines.append("")
    prefix = result.get("prefix")
    if prefix:
        lines.append(f"Prefix caching: chat requests (the template's system turn in common), "
                     f"concurrency {prefix['concurrency']}, {prefix['max_tokens']} tokens each")
        lines.append(f"  {'reuse':>7} {'reqs':>4} {'fail':>4} {'TTFT50':>7} {'TTFT95':>7}"
                     f" {'prompt tokens from cache':>25}")
        for name in ("without", "with"):
            m = prefix.get(name)
            if m:
                lines.append(f"  {name:>7} {m['requests']:>4} {m['failures']:>4}"
                             f" {_ms(m['ttft_p50_s']):>7} {_ms(m['ttft_p95_s']):>7}"
                             f" {m['cached_tokens']:>12} of {m['prefill_tokens']:<9}")
        lines.append("")
    lengths = result.get("lengths")
    if lengths:
        lines.append(f"Mixed lengths: {lengths['short_requests']} short requests "
                     f"({lengths['max_tokens']} tokens each), alone and beside one long prompt")
        lines.append(f"  {'run':>22} {'short lat50 s':>13} {'x alone':>8} {'RSS before MB':>13}"
                     f" {'peak MB':>8} {'KV MB':>6}")
        for r in lengths["runs"]:
            lines.append(f"  {r['name']:>22} {_f(r['short_latency_p50_s'], '{:.2f}'):>13}"
                         f" {_f(r.get('short_p50_over_alone'), '{:.2f}'):>8}"
                         f" {r['rss_before_mb']:>13.0f} {r['rss_peak_mb']:>8.0f} {r['kv_mb']:>6.0f}")
        lines.append("")
    lines.extend(format_batch(result.get("batch")))
    lines.extend(format_baseline(result.get("baseline")))
    skipped = result.get("meta", {}).get("skipped")
    if skipped:
        lines.append(f"Skipped to stay within the time budget: {', '.join(skipped)}")
        lines.append("")
    if result.get("error"):
        lines.append(f"Run error: {result['error']}")
        lines.append("")
    lines.append("Targets")
    for t in result.get("targets", []):
        mark = {True: "MET   ", False: "MISSED", None: "n/a   "}[t["met"]]
        v = t["value"]
        raw_first = t.get("raw_first_token_s")
        lines.append(f"  [{mark}] {t['name']}: {_f(v, '{:.3f}', 'not measured')}"
                     + (f" (raw generate, first tokens of 64 prompts at once: {raw_first:.3f} s)"
                        if raw_first else "") + (f" ({t['note']})" if t.get("note") else ""))
    return "\n".join(lines)


# --- the plot -----------------------------------------------------------------------------------
def _ticks(ax, values) -> None:
    vals = sorted(set(values))
    if vals:
        ax.set_xticks(vals)
        ax.set_xticklabels([str(v) for v in vals])
        from matplotlib.ticker import NullLocator

        ax.xaxis.set_minor_locator(NullLocator())
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = result.get("served") or []
    raw = (result.get("raw") or {}).get("results", [])
    mixed = result.get("mixed")
    ncols = 3 if mixed and mixed.get("static") else 2
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.6))
    ax = axes[0]
    if served:
        ax.plot([lv["concurrency"] for lv in served], [lv["tokens_per_s"] or 0 for lv in served],
                "o-", label=f"served ({served[0]['max_tokens']} tok/request)")
    if raw:
        ax.plot([r["batch"] for r in raw], [r["tokens_per_s"] for r in raw], "s--",
                label=f"raw {(result['raw'].get('info') or {}).get('backend', 'generate')} "
                      f"(batch, {raw[0]['new_tokens']} tok)")
    ax.set_xscale("log", base=2)
    _ticks(ax, [lv["concurrency"] for lv in served] + [r["batch"] for r in raw])
    ax.set_xlabel("concurrency / batch size")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()

    ax = axes[1]
    xs = [lv["concurrency"] for lv in served]
    for key, label, style in (("ttft_p50_s", "TTFT p50", "o-"), ("ttft_p95_s", "TTFT p95", "o--"),
                              ("itl_p50_s", "ITL p50", "^-"), ("itl_p95_s", "ITL p95", "^--"),
                              ("latency_p50_s", "request p50", "s-"),
                              ("latency_p99_s", "request p99", "s--")):
        ys = [lv[key] for lv in served]
        if any(y is not None for y in ys):
            ax.plot(xs, [y if y is not None else float("nan") for y in ys], style, label=label)
    first = [(r["batch"], r["first_token_s"]) for r in raw if r.get("first_token_s")]
    if first:
        ax.plot(*zip(*first), "x:", color="gray", label="raw: batch's first tokens")
    ax.set_xscale("log", base=2)
    _ticks(ax, xs)
    ax.set_yscale("log")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("seconds")
    ax.set_title("Latency (served, closed loop)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)

    if ncols == 3:
        ax = axes[2]
        names = ["continuous", "static"]
        tps = [_tps_all(mixed[n]) or 0 for n in names]
        p99 = [_p99_all(mixed[n]) or 0 for n in names]
        p50 = [mixed[n].get("latency_p50_all_s", mixed[n]["latency_p50_s"]) or 0 for n in names]
        bars = ax.bar(names, tps, color=["tab:blue", "tab:gray"])
        ax.bar_label(bars, fmt="%.0f tok/s")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"Mixed workload ({mixed['num_requests']} req, Poisson)")
        ax2 = ax.twinx()
        ax2.plot(names, p99, "rD", label="latency p99 (s)")
        ax2.plot(names, p50, "r.", label="latency p50 (s)")
        ax2.set_ylabel("seconds")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"llmq benchmark {result['meta']['timestamp']}"
                 f"{' (quick)' if result['meta']['quick'] else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
