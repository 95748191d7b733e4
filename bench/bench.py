"""`make bench` / `python -m bench.bench [--quick]`: one run, results in bench/results/.

Phases, all on the default model, greedy, with the output length forced:
  0. quality  bfloat16's, a float16 cache's, int8 / int4 weights' greedy tokens against
              float32's (bench/quality.py; --only quality)
  0. peers    llmq and its peers (vLLM's own server, llama.cpp's llama-server) on the same load,
              all kept up and taking turns at each level, two rounds, with the fraction of this
              machine's compute limit each reached (the first table; --only peers runs it
              alone, in about 20 minutes on 2 cores), then the mixed load (16 streams over
              48 prompts of 16-3,000 tokens; bench/peers_mixed.py) as one more row each
  1. raw      model.generate in this process (before the stack starts, then freed)
  2. served   own redis-server + one worker + gunicorn API; closed-loop SSE clients per level
  2c. prefix  chat requests sharing the template's system turn: TTFT without, then with reuse
  2d. stops   the same requests plain, then with worst-case stop strings: engine step time
  2e. batch   a batch of short lines through /v1/files and /v1/batches: its rate, and
              interactive TTFT p50 while it runs against an idle queue (--only batch)
  2g. lengths 32 short requests alone, then beside one 3,000-token prompt (and one of 8,000):
              the short ones' latency p50 ratio, the model process's RSS against its KV bytes
              (--only lengths runs it alone)
  2i. tools  chat requests at the top level three times: free text, a named tool_choice, and
              "required" with two tools, the answers the same length: tool calls' tok/s against
              free text's, bar 0.90 (--only tools runs it alone; --skip-tools leaves it out)
  3. mixed    prompts 10-400 tokens, outputs 8-256, Poisson arrivals near saturation:
              continuous batching, then the worker restarted with LLMQ_BATCH_POLICY=static
  2h. long   64 sequences generating 8,000 tokens each (ignore_eos): host time and Redis bytes
              per step at 100, 1,000, 4,000 and 8,000 tokens, tok/s over time, the AOF's growth
              against the tokens (--only long runs it, alone; --long-tokens 300 --long-seqs 8
              for a smoke run)
  2i. attacks key b's 16-token chat requests alone, beside a plain flood from key a (the control)
              and beside each of issue 48's attacks from key a: p50, x alone, x the control,
              b's errors (--only attacks runs it, alone; --attack-seconds 10 for a smoke run)
  4. baseline with --baseline REF: REF's own stack (from a temporary copy of its tree) against
              this checkout's at the same levels, prompts and dtype (float32), in turn
              (--only baseline runs it alone)
Writes <out>/<timestamp>.json and .png and prints a summary table with the targets.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from . import report
from .efficiency import measure as measure_efficiency, merge_probe
from .attacks import ROWS as ATTACK_ROWS, attack_targets, attacks_phase, format_attacks
from .attacks import METRICS_KEY, stack_env as attack_stack_env
from .baseline import baseline_phase
from .batch import batch_phase
from .loadgen import closed_loop, open_loop, payload
from .peers import (LLAMA_SERVER, PEER_NAMES, add_model_alone, build_systems, peers_phase,
                    refresh_fractions)
from .lengths import lengths_phase
from .peers_mixed import MIXED_PROMPTS
from .long import format_long, long_phase, long_targets
from .prefix import prefix_phase
from .quality import quality_phase
from .raw import run_raw, run_raw_backend, short_prompts
from .stack import ROOT, Stack
from .stop_strings import stop_strings_phase
from .streams import streams_phase
from .structured import format_lines as structured_lines, structured_phase
from .tools import format_lines as tools_lines, tools_phase, tools_targets
from .workload import mixed_requests, poisson_offsets
from worker.model_manager import resolve_dtype

T0 = time.monotonic()


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


class Budget:
    """The whole run's time budget; phases ask how much is left."""

    def __init__(self, seconds: float, start: float = T0):
        self.deadline = start + seconds
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, what: str, need_s: float) -> bool:
        if self.left() >= need_s:
            return True
        self.skipped.append(what)
        progress(f"SKIPPED {what}: {max(0.0, self.left()):.0f} s of the time budget left, "
                 f"{need_s:.0f} s needed")
        return False


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smaller run (raw batch 1,8; served 1,8,32; 32 tokens; 12 mixed requests)")
    p.add_argument("--concurrency", help="served concurrency levels, e.g. 1,8,32,64")
    p.add_argument("--raw-batches", help="raw generate batch sizes (default: the levels, "
                                         "quick: those <= 8)")
    p.add_argument("--tokens", type=int, help="new tokens per request (default 64, quick 32)")
    p.add_argument("--requests-per-level", type=int,
                   help="closed-loop requests per level (default max(2c, 8); quick max(c, 2))")
    p.add_argument("--level-time-limit", type=float,
                   help="stop sending new requests in a level after this many seconds, cancel "
                        "the running ones after twice that (default 120, quick 20)")
    p.add_argument("--raw-time-limit", type=float,
                   help="seconds for the whole raw phase; a batch out of time stops early "
                        "(default: a fifth of the budget)")
    p.add_argument("--mixed-requests", type=int, help="mixed workload size (default 40, quick 12)")
    p.add_argument("--mixed-time-limit", type=float,
                   help="cancel what still runs after this many seconds of one mixed run "
                        "(default 210, quick 35)")
    p.add_argument("--budget", type=float,
                   help="whole-run time budget in seconds: later levels/phases are cut or "
                        "skipped to stay within it (default 850, quick 165)")
    p.add_argument("--seed", type=int, default=1234, help="mixed workload seed")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results folder")
    p.add_argument("--skip-raw", action="store_true", help="skip the raw model.generate phase")
    p.add_argument("--skip-mixed", action="store_true", help="skip the mixed workload phase")
    p.add_argument("--skip-quality", action="store_true",
                   help="skip the quality guard (bfloat16's greedy tokens against float32's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="LLMQ_DTYPE of the raw phase and the served worker (auto: bfloat16 on "
                        "CPUs with native bf16)")
    p.add_argument("--skip-structured", action="store_true",
                   help="skip the structured-output phase (its cost at the top concurrency)")
    p.add_argument("--skip-tools", action="store_true",
                   help="skip the tool-calling phase (its cost at the top concurrency)")
    p.add_argument("--tools-rounds", type=int, default=3,
                   help="rounds of the tools phase, its arms in turn (default 3; medians)")
    p.add_argument("--tools-items", type=int, default=24,
                   help="digits in each tool call's arguments (default 24, ~96 tokens an "
                        "answer; 4 for a smoke run)")
    p.add_argument("--streams", type=int, default=None,
                   help="SSE streams to hold open at once (default 256; quick 64; 0 skips)")
    p.add_argument("--prefix-requests", type=int, default=None,
                   help="chat requests per prefix-caching run (default 32; quick 16; 0 skips)")
    p.add_argument("--batch-lines", type=int, default=None,
                   help="lines of the Batch API phase (default 1000, quick 200; 0 skips it)")
    p.add_argument("--lengths", default=None,
                   help="long prompt sizes of the mixed-lengths phase, e.g. 3000,8000 (default; "
                        "quick: 3000; 0 skips)")
    p.add_argument("--backend", default="transformers",
                   choices=["transformers", "llama_cpp", "vllm"],
                   help="LLMQ_BACKEND of the worker; the raw phase is then model.generate "
                        "(transformers) or the backend stepped in-process (llama_cpp, vllm)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda, for raw and served")
    p.add_argument("--api-app", default="app.wsgi:application",
                   help="the WSGI app gunicorn serves (module:variable, importable from the repo)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="LLMQ_MAX_NUM_SEQS of the worker")
    p.add_argument("--only", choices=["peers", "quality", "baseline", "batch", "lengths", "long",
                                      "attacks", "tools"],
                   help="run only this phase (peers: the peers table, ~10 min; quality: the "
                        "bfloat16 quality guard, ~2 min; baseline: the --baseline comparison; "
                        "batch: the Batch API phase; lengths: the mixed-lengths phase, ~5 min; "
                        "long: the long-generations phase, which runs only so; attacks: one "
                        "key's attacks against another's latency, which runs only so; tools: "
                        "the tool-calling phase at the top --concurrency level)")
    for flag, kind, default, what in (
            ("--long-seqs", int, 64, "sequences of the long-generations phase"),
            ("--long-tokens", int, 8000, "tokens each long sequence generates (300: a smoke run)"),
            ("--long-time-limit", float, 3600.0,
             "seconds after which the long phase cancels what still runs, and reports"),
            ("--attack-seconds", float, 60.0, "seconds key b is measured under each attack row"),
            ("--attack-tokens", int, 0,
             "output tokens of key a's requests (0: the issue's, 256 a flood, 200 a wave; "
             "fewer for a smoke run on a small machine)")):
        p.add_argument(flag, type=kind, default=default, help=f"{what} (default {default:g})")
    p.add_argument("--attacks", default=",".join(ATTACK_ROWS),
                   help="rows of the attacks phase, of " + ",".join(ATTACK_ROWS) + " (default: "
                        "all; alone and control are what the others are divided by)")
    p.add_argument("--baseline", metavar="REF",
                   help="also run the uniform levels on REF's own stack (a commit, branch or "
                        "tag of this repository, e.g. bb17313) and report llmq's float32 tok/s "
                        "over REF's (default: none)")
    p.add_argument("--baseline-rounds", type=int, default=2,
                   help="rounds of the baseline comparison, the systems in turn (default 2)")
    p.add_argument("--skip-peers", action="store_true",
                   help="skip the peers table (quick runs skip it unless --only peers)")
    p.add_argument("--skip-float32-row", action="store_true",
                   help="leave out the default backend's float32 twin in the peers table (it "
                        "runs where --dtype resolves to another dtype, for the bf16 >= 1.6x "
                        "float32 bar)")
    p.add_argument("--peers", default=",".join(PEER_NAMES),
                   help=f"peers to compare against, of {','.join(PEER_NAMES)} (default: all; "
                        "an absent one is reported as skipped)")
    p.add_argument("--llmq-backends", default="auto",
                   help="more llmq backends for the peers table besides --backend, e.g. "
                        "llama_cpp,vllm; auto (the default): llama_cpp, whose bar against "
                        "llama-server the table judges (skipped where it is not installed); "
                        "'' for none")
    p.add_argument("--peers-concurrency", default="1,16,64", help="the peers table's levels")
    # 16 at c=1: a llama.cpp level of 8 lasted ~10 s, and one hiccup moved it by 10%.
    p.add_argument("--peers-requests", default="16,64,128",
                   help="requests per peers level (one per level, or one for all)")
    p.add_argument("--peers-tokens", type=int, default=64, help="output tokens per peers request")
    p.add_argument("--peers-mixed", type=int, default=MIXED_PROMPTS,
                   help="prompts of the peers table's mixed load: 16 streams, 16-3,000 tokens, "
                        f"mean ~600 (default {MIXED_PROMPTS}; 0 skips it)")
    p.add_argument("--peers-level-time-limit", type=float, default=45.0,
                   help="per peers level: no new request after this many seconds, streams "
                        "closed after twice that (default 45)")
    p.add_argument("--peers-rounds", type=int, default=2,
                   help="rounds of the peers table, the systems in turn; each level's row is "
                        "the best of its rounds, and each round pairs the systems (default 2)")
    p.add_argument("--peers-order", choices=["interleaved", "sequential"],
                   help="interleaved: every system kept up, taking turns at each level (the "
                        "default on CPU); sequential: one system up at a time, all its levels "
                        "(the default with --device cuda, where two engines contend for memory)")
    p.add_argument("--llama-server", default=str(LLAMA_SERVER),
                   help="the llama-server binary (`make peers` builds it there)")
    args = p.parse_args(argv)
    _peers_args(p, args)
    if args.only == "baseline" and not args.baseline:
        p.error("--only baseline needs --baseline REF")
    if args.baseline_rounds < 1 or args.peers_rounds < 1:
        p.error("--baseline-rounds and --peers-rounds: at least 1")
    if args.long_seqs < 1 or args.long_tokens < 2:
        p.error("--long-seqs: at least 1; --long-tokens: at least 2")
    args.attacks = [x for x in args.attacks.replace(" ", "").split(",") if x]
    if bad := [x for x in args.attacks if x not in ATTACK_ROWS]:
        p.error(f"--attacks: unknown {bad}; choose from {list(ATTACK_ROWS)}")
    if args.attack_seconds <= 0:
        p.error("--attack-seconds: more than 0")
    q = args.quick
    args.levels = _ints(args.concurrency) if args.concurrency else ([1, 8, 32] if q else [1, 8, 32, 64])
    # The levels the issues judge against the baseline, unless levels are asked for.
    args.baseline_levels = args.levels if args.concurrency else [1, 64]
    if args.raw_batches:
        args.raw = _ints(args.raw_batches)
    else:
        args.raw = [b for b in args.levels if b <= 8] if q else list(args.levels)
    args.tokens = args.tokens or (32 if q else 64)
    args.level_time_limit = args.level_time_limit or (20.0 if q else 120.0)
    # 40 requests: at the arrival rate used, the last arrives at ~100 s and continuous
    # batching can finish it within the limit, so both policies' percentiles are over (nearly)
    # every request rather than over the ones that happened to finish.
    args.mixed_requests = args.mixed_requests or (12 if q else 40)
    args.mixed_time_limit = args.mixed_time_limit or (35.0 if q else 210.0)
    args.budget = args.budget or (165.0 if q else 850.0)
    args.raw_time_limit = args.raw_time_limit or args.budget / 5
    args.output_range = (8, 64) if q else (8, 256)
    args.streams = (64 if q else 256) if args.streams is None else args.streams
    args.prompt_range = (10, 400)
    args.prefix_requests = ((16 if q else 32) if args.prefix_requests is None
                            else args.prefix_requests)
    lengths = args.lengths or ("3000" if q else "3000,8000")
    args.lengths = [] if lengths.strip() == "0" else _ints(lengths)
    return args


def _peers_args(p: argparse.ArgumentParser, args) -> None:
    """Checks the peers options against each other and the backend choices."""
    args.peers = [x for x in args.peers.replace(" ", "").split(",") if x]
    if bad := [x for x in args.peers if x not in PEER_NAMES]:
        p.error(f"--peers: unknown {bad}; choose from {list(PEER_NAMES)}")
    backends = p._option_string_actions["--backend"].choices
    if args.llmq_backends == "auto":
        args.llmq_backends = "llama_cpp"
    args.llmq_backends = [x for x in args.llmq_backends.replace(" ", "").split(",") if x]
    if bad := [x for x in args.llmq_backends if x not in backends]:
        p.error(f"--llmq-backends: unknown {bad}; choose from {list(backends)}")
    args.peers_concurrency = _ints(args.peers_concurrency)
    requests = _ints(args.peers_requests)
    if len(requests) == 1:
        requests *= len(args.peers_concurrency)
    if len(requests) != len(args.peers_concurrency):
        p.error("--peers-requests: one number, or one per --peers-concurrency level")
    args.peers_requests = requests
    args.peers_order = args.peers_order or ("interleaved" if args.device == "cpu"
                                            else "sequential")
    args.run_peers = args.only == "peers" or not (args.only or args.skip_peers or args.quick)


def _ints(s: str) -> list[int]:
    vals = [int(x) for x in s.replace(" ", "").split(",") if x]
    if not vals or any(v < 1 for v in vals):
        raise SystemExit(f"bad list of positive integers: {s!r}")
    return vals


def requests_for(level: int, args) -> int:
    if args.requests_per_level:
        return args.requests_per_level
    return max(level, 2) if args.quick else max(2 * level, 8)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                               text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# --- phases -------------------------------------------------------------------------------------
def served_phase(stack: Stack, args, budget: Budget, reserve_s: float) -> list[dict]:
    """reserve_s: time kept back for the phases after this one."""
    levels = []
    # One warm-up round (not measured) before the levels: connections, kernels, allocator.
    warm = min(8, max(args.levels))
    results, wall, _ = closed_loop(stack.url, warm, [payload(p, 8) for p in short_prompts(warm, 500)],
                                   hard_limit_s=max(10.0, (budget.left() - reserve_s) / 5))
    bad = [r for r in results if not r.ok]
    progress(f"served: warm-up {warm} requests x 8 tokens in {wall:.1f} s"
             f"{f' ({len(bad)} failed: {bad[0].describe_failure()})' if bad else ''}")
    offset = 0
    for i, c in enumerate(args.levels):
        n = requests_for(c, args)
        left = budget.left() - reserve_s
        # What is left is shared by this level and the ones after it.
        share = left / (len(args.levels) - i)
        if not budget.allows(f"served concurrency {c}", reserve_s + min(10.0, args.level_time_limit)):
            continue
        hard = min(2 * args.level_time_limit, max(share, 10.0))
        soft = min(args.level_time_limit, hard / 2)
        payloads = [payload(p, args.tokens) for p in short_prompts(n, offset)]
        offset += n
        before = stack.worker_timing()
        results, wall, truncated = closed_loop(stack.url, c, payloads, soft, hard)
        s = report.summarize(results, wall)
        s.update(concurrency=c, max_tokens=args.tokens, truncated=truncated,
                 time_split=report.time_split(before, stack.worker_timing(), wall))
        levels.append(s)
        _warn_buffered(s)
        fail = f", {s['failures']} FAILED ({'; '.join(s['failure_examples'])})" if s["failures"] else ""
        progress(f"served: concurrency {c:>3}: {s['requests']} requests, {s['completion_tokens']} "
                 f"tokens in {wall:.1f} s -> {s['tokens_per_s']} tok/s, TTFT p50 "
                 f"{_fmt_s(s['ttft_p50_s'])} (first text {_fmt_s(s['ttft_text_p50_s'])}), "
                 f"ITL p50 {_fmt_s(s['itl_p50_s'])}, "
                 f"latency p99 {_fmt_s(s['latency_p99_s'])}{fail}"
                 f"{' (cut by the time limit)' if truncated else ''}")
        progress(f"served: concurrency {c:>3}: where the worker's time went: "
                 f"{report.format_split(s['time_split'])}")
    return levels


def _warn_buffered(s: dict) -> None:
    if s["ok"] and s["buffered_streams"] > s["ok"] // 2:
        progress(f"WARNING: {s['buffered_streams']} of {s['ok']} streams delivered every token "
                 "event at once: the API buffers the SSE response, so TTFT ~ request latency")


def _fmt_s(v) -> str:
    return "-" if v is None else f"{v:.3f} s"


PROMPT_TOKEN_WEIGHT = 0.5


def mixed_phase(stack: Stack, args, served: list[dict], budget: Budget) -> dict:
    from transformers import AutoTokenizer

    # The reference is the closed-loop throughput at concurrency 32 (else the nearest level
    # below): the mixed workload's batch holds some 20-40 sequences, not 64, and its long
    # prompts make each step dearer, so the c=64 rate overloads even continuous batching (its
    # p50 latency reached 79 s at 0.544 req/s, 5 of 60 unfinished at the cut).
    ok = [lv for lv in served if lv["tokens_per_s"]]
    ref = ([lv for lv in ok if lv["concurrency"] <= 32] or ok)
    if not ref:
        budget.skipped.append("mixed workload")
        progress("SKIPPED mixed workload: no served throughput to derive the arrival rate from")
        return None
    ref_tps = max(ref, key=lambda lv: lv["concurrency"])["tokens_per_s"]
    tok = AutoTokenizer.from_pretrained(_model_manager().resolve())
    reqs = mixed_requests(tok, args.mixed_requests, args.seed, args.prompt_range, args.output_range)
    mean_out = sum(r["max_tokens"] for r in reqs) / len(reqs)
    mean_prompt = sum(r["prompt_tokens"] for r in reqs) / len(reqs)
    # Near saturation: the served decode rate, with a prompt token counted as half an output
    # token (prefill is batched matmul work; on a CPU it is not free, and 10-400-token prompts
    # outweigh the outputs here).
    rate = 0.9 * ref_tps / (mean_out + PROMPT_TOKEN_WEIGHT * mean_prompt)
    offsets = poisson_offsets(len(reqs), rate, args.seed)
    arrivals = [(off, payload(r["prompt"], r["max_tokens"])) for off, r in zip(offsets, reqs)]
    out = {"num_requests": len(reqs), "seed": args.seed, "rate_per_s": round(rate, 4),
           "reference_tokens_per_s": ref_tps, "mean_output_tokens": round(mean_out, 1),
           "mean_prompt_tokens": round(mean_prompt, 1), "prompt_token_weight": PROMPT_TOKEN_WEIGHT,
           "prompt_tokens_range": list(args.prompt_range),
           "output_tokens_range": list(args.output_range),
           "arrival_span_s": round(offsets[-1], 2)}
    progress(f"mixed: {len(reqs)} requests, mean output {mean_out:.0f} tokens, Poisson rate "
             f"{rate:.3f}/s (0.9 x {ref_tps:.0f} tok/s), arrivals over {offsets[-1]:.0f} s")
    # A worker restart (model load and warm-up): as long as this run's first start, with room.
    restart_s = max(10.0, 1.5 * (stack.worker_start_s or 20.0))
    for policy in ("continuous", "static"):
        runs_left = 2 if policy == "continuous" else 1
        need = (restart_s + 10.0) * runs_left   # (a restart) and at least 10 s of running
        if not budget.allows(f"mixed {policy}", need):
            if policy == "continuous":
                budget.skipped.append("mixed static")
                break
            continue
        limit = min(args.mixed_time_limit, (budget.left() - restart_s) / runs_left)
        if policy == "static":
            t = time.monotonic()
            stack.restart_worker("static", timeout_s=max(60.0, budget.left()))
            closed_loop(stack.url, 1, [payload("Warm up.", 4)], hard_limit_s=20)
            progress(f"mixed: worker restarted with LLMQ_BATCH_POLICY=static in "
                     f"{time.monotonic() - t:.1f} s")
            limit = min(args.mixed_time_limit, budget.left() - 5.0)
        results, wall, cut = open_loop(stack.url, arrivals, limit)
        s = report.summarize(results, wall)
        s["cut"] = cut
        out[policy] = s
        _warn_buffered(s)
        fail = f", {s['failures']} FAILED ({'; '.join(s['failure_examples'])})" if s["failures"] else ""
        progress(f"mixed: {policy:>10}: {s['completion_tokens']} tokens in {wall:.1f} s -> "
                 f"{s['tokens_per_s_all']} tok/s, latency p50 {_fmt_s(s['latency_p50_all_s'])} p99 "
                 f"{_fmt_s(s['latency_p99_all_s'])} (cut requests at their cut time){fail}{' (cut by the time limit)' if cut else ''}")
    return out


def _lengths(stack: Stack, args, progress) -> dict:
    from transformers import AutoTokenizer

    model_dir = _model_manager().resolve()
    return lengths_phase(stack, AutoTokenizer.from_pretrained(model_dir), model_dir,
                         tokens=args.tokens, long_lengths=args.lengths, progress=progress,
                         dtype=stack.dtype, kv_dtype=served_kv_dtype(stack))


def _tools(stack: Stack, args) -> dict:
    c = max(args.levels)
    progress(f"phase 2i: tool calls at concurrency {c}: free text, a named tool_choice, "
             "required with two tools")
    return tools_phase(stack.url, c, requests_for(c, args), 2 * args.level_time_limit,
                       progress=progress, items=args.tools_items, rounds=args.tools_rounds)


def served_kv_dtype(stack) -> str:
    """The KV cache dtype the stack's worker chose (LLMQ_KV_CACHE_DTYPE; auto: float16 under
    float32 on a CPU with the decode kernel), as its heartbeat reports it."""
    return stack.worker_report().get("kv_cache_dtype") or stack.dtype


# --- main ---------------------------------------------------------------------------------------
def _on_term(signum, _frame):
    raise SystemExit(128 + signum)   # unwinds through the finally that stops the stack


def _model_manager():
    from common.settings import Settings
    from worker.model_manager import ModelManager

    return ModelManager(cache_dir=Settings.from_env().model_cache_dir)


def served_dtype(args) -> str:
    """What --backend serves in: --dtype resolved for that backend (auto: bfloat16 where the
    CPU computes it, but float32 for vLLM on CPU, whose bfloat16 path answers gibberish)."""
    return resolve_dtype(args.dtype, args.device, args.backend)


def _peers(args, workdir: Path, model_dir: str, dtype: str, eff: dict) -> dict:
    from transformers import AutoTokenizer

    systems = build_systems(args, workdir, model_dir, _model_manager().gguf_file(), dtype)
    return peers_phase(systems, AutoTokenizer.from_pretrained(model_dir), args.peers_concurrency,
                       args.peers_requests, args.peers_tokens, args.peers_level_time_limit,
                       eff=eff, progress=progress, rounds=args.peers_rounds,
                       order=args.peers_order, mixed=args.peers_mixed)


def llmq_phases(args, result: dict, budget: Budget, workdir: Path) -> str | None:
    """Raw, served and the phases after it on llmq's own stack (--only batch or lengths: that
    phase alone); returns the error, if any."""
    full = args.only is None
    if full and not args.skip_raw and args.backend == "transformers":
        progress("phase 1/3: raw model.generate (in-process, before the stack starts)")
        result["raw"] = run_raw(args.raw, args.tokens, device=args.device, dtype=args.dtype,
                                progress=progress, time_limit_s=args.raw_time_limit)
    elif full and not args.skip_raw:
        progress(f"phase 1/3: raw {args.backend} backend (in-process, before the stack starts)")
        result["raw"] = run_raw_backend(args.backend, args.raw, args.tokens, progress=progress,
                                        time_limit_s=args.raw_time_limit,
                                        max_num_seqs=args.max_num_seqs)
    # The long phase asks for more tokens than the API's default cap allows.
    extra_env = ({"LLMQ_MAX_TOKENS_LIMIT": str(max(4096, args.long_tokens))}
                 if args.only == "long" else attack_stack_env() if args.only == "attacks" else {})
    stack = Stack(workdir, max_num_seqs=args.max_num_seqs, device=args.device, backend=args.backend,
                  dtype=result["meta"]["dtype"], api_app=args.api_app, extra_env=extra_env,
                  metrics_key=METRICS_KEY if args.only == "attacks" else None,
                  task_threads=(args.max_num_seqs + (args.max_num_seqs + 3) // 4
                                if args.only == "attacks" else None))
    error = None
    try:
        progress(f"phase 2/3: starting redis-server :{stack.redis_port}, a worker and the API "
                 f"{stack.url} (logs in {workdir})")
        t = time.monotonic()
        stack.start("continuous")
        progress(f"stack ready in {time.monotonic() - t:.1f} s")
        if args.only == "lengths":
            result["lengths"] = _lengths(stack, args, progress)
            return None
        if args.only == "attacks":
            stack.start_delivery_worker()
            progress(f"phase 2j: key b's latency beside key a's attacks {args.attacks}, "
                     f"{args.attack_seconds:g} s each")
            result["attacks"] = attacks_phase(stack, args.attack_seconds, args.attacks,
                                              progress=progress,
                                              tokens=args.attack_tokens or None)
            return None
        if args.only == "tools":
            result["tools"] = _tools(stack, args)
            return None
        if args.only == "long":
            progress(f"phase 2h: {args.long_seqs} sequences generating {args.long_tokens} "
                     "tokens each (ignore_eos)")
            result["long"] = long_phase(stack, args.long_seqs, args.long_tokens,
                                        args.long_time_limit, progress=progress)
            return None
        mixed_reserve = 0.0 if args.skip_mixed else max(0.0, min(budget.left() * 0.4,
                                                                 30.0 + 2 * args.mixed_time_limit))
        if full:
            result["served"] = served_phase(stack, args, budget, mixed_reserve)
        if full and args.streams and budget.allows("stream capacity", 60):
            progress(f"phase 2b: {args.streams} SSE streams open at once")
            result["streams"] = streams_phase(stack.url, args.streams, progress=progress)
        if full and args.prefix_requests and args.backend == "transformers" and budget.allows(
                "prefix caching", 60):
            c = 8 if args.quick else 16
            progress(f"phase 2c: prefix caching, {args.prefix_requests} chat requests at "
                     f"concurrency {c}, without and with reuse")
            result["prefix"] = prefix_phase(stack, c, args.prefix_requests, 8 if args.quick else 16,
                                            progress=progress)
        if full and args.backend == "transformers" and budget.allows("stop strings", 60):
            c, n = (8, 16) if args.quick else (16, 32)
            progress(f"phase 2d: stop strings, {n} requests at concurrency {c}, plain then "
                     "with 16 stop strings of 256 characters that hold all their text back")
            result["stop_strings"] = stop_strings_phase(stack, c, n, 32, progress=progress)
        batch_lines = args.batch_lines if args.batch_lines is not None else (
            200 if args.quick else 1000)
        if batch_lines and budget.allows("batch API", 60):
            progress(f"phase 2e: a batch of {batch_lines} lines, interactive TTFT meanwhile")
            result["batch"] = batch_phase(stack.url, batch_lines, progress=progress,
                                          info=stack.worker_info)
        if full and not args.skip_structured and budget.allows("structured output", 60):
            c = max(args.levels)
            progress(f"phase 2f: structured output at concurrency {c}, without and with a JSON "
                     "response format on half the requests")
            result["structured"] = structured_phase(
                stack.url, c, requests_for(c, args), lambda p: payload(p, args.tokens),
                2 * args.level_time_limit, progress=progress)
        if full and not args.skip_tools and budget.allows("tool calls", 90):
            result["tools"] = _tools(stack, args)
        if full and args.lengths and args.backend == "transformers" and budget.allows(
                "mixed lengths", 120 * (len(args.lengths) + 2)):
            progress(f"phase 2g: mixed lengths, 32 short requests alone and beside one long "
                     f"prompt of {args.lengths} tokens")
            result["lengths"] = _lengths(stack, args, progress)
        if full and not args.skip_mixed:
            progress("phase 3/3: mixed workload, continuous vs static batching")
            mixed = mixed_phase(stack, args, result["served"], budget)
            if mixed:
                result["mixed"] = mixed
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - write what we have
        error = f"{type(exc).__name__}: {exc}"
        progress(f"ERROR: {error}")
    finally:
        progress("stopping the stack")
        stack.stop()
    return error


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGHUP, _on_term)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = served_dtype(args)
    result = {"meta": {
        "timestamp": stamp, "quick": args.quick, "git": git_commit(), "python": sys.version.split()[0],
        "platform": platform.platform(), "cpus": os.cpu_count(), "dtype": dtype,
        "load_avg_start": list(os.getloadavg()),
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, tuple, type(None)))},
    }}
    progress(f"llmq bench{' (quick)' if args.quick else ''}, backend {args.backend}: "
             + (f"mixed-lengths phase only, long prompts {args.lengths}, {args.tokens} "
                f"tokens/request" if args.only == "lengths" else
                f"{args.only} only" if args.only else
                f"levels {args.levels}, {args.tokens} tokens/request, raw batches "
                f"{[] if args.skip_raw else args.raw}, {0 if args.skip_mixed else args.mixed_requests} "
                f"mixed requests, budget {args.budget:.0f} s")
             + f"; load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        progress("WARNING: the machine is already busy; the numbers will be noisy and low")
    workdir = Path(tempfile.mkdtemp(prefix=f"llmq-bench-{stamp}-"))
    error, budget = None, None
    try:
        model_dir = _model_manager().resolve()
        if args.only == "quality" or not (args.only or args.skip_quality
                                          or args.backend != "transformers"):
            progress("phase 0: quality guard, greedy tokens of bfloat16, a float16 KV cache and "
                     "int8 / int4 weights against float32")
            result["quality"] = quality_phase(progress=progress)
        batches = args.peers_concurrency if args.run_peers else []
        batches = batches + (args.levels if args.only is None else [])
        if batches:
            progress("phase 0: this machine's fp32 and bf16 matmul rates at the model's decode "
                     "shapes")
            result["efficiency"] = measure_efficiency(model_dir, batches, progress)
        if args.run_peers:
            progress(f"phase 0: peers table at concurrency {args.peers_concurrency} "
                     f"(logs in {workdir})")
            result["peers"] = _peers(args, workdir, model_dir, args.dtype, result["efficiency"])
        if args.only in (None, "batch", "lengths", "long", "attacks", "tools"):
            # The budget covers the llmq phases; the peers table and the baseline comparison
            # have their own per-level limits.
            budget = Budget(args.budget, start=time.monotonic())
            error = llmq_phases(args, result, budget, workdir)
        if args.baseline and args.only in (None, "baseline"):
            progress(f"phase 4: against the baseline {args.baseline} at concurrency "
                     f"{args.baseline_levels}, {args.baseline_rounds} rounds")
            result["baseline"] = baseline_phase(
                args.baseline, levels=args.baseline_levels, tokens=args.tokens,
                requests_for=lambda c: requests_for(c, args), rounds=args.baseline_rounds,
                level_time_limit=args.level_time_limit, default_dtype=dtype,
                backend=args.backend, device=args.device, max_num_seqs=args.max_num_seqs,
                workdir=workdir, progress=progress)
        if result.get("efficiency"):
            progress("phase 5: the matmul rates again, the limit being the higher of the two "
                     "probes")
            result["efficiency"] = merge_probe(result["efficiency"],
                                               measure_efficiency(model_dir, batches, progress))
            if result.get("peers"):
                refresh_fractions(result["peers"], result["efficiency"])
        if result.get("peers") and args.device == "cpu":
            progress("phase 6: llmq's model worker alone in this process on the peers' load at "
                     f"c={max(args.peers_concurrency)}: the ceiling of its served rows")
            from transformers import AutoTokenizer

            add_model_alone(result["peers"], result.get("efficiency"),
                            AutoTokenizer.from_pretrained(model_dir), model_dir, progress)
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - write what we have
        error = f"{type(exc).__name__}: {exc}"
        progress(f"ERROR: {error}")
    result.setdefault("served", [])
    result["meta"]["load_avg_end"] = list(os.getloadavg())
    result["meta"]["elapsed_s"] = round(time.monotonic() - T0, 1)
    result["meta"]["logs"] = str(workdir)
    result["meta"]["skipped"] = budget.skipped if budget else []
    if error:
        result["error"] = error
    result["ratios"] = report.compute_ratios(result.get("raw"), result["served"], result.get("mixed"))
    result["targets"] = report.lengths_targets(result.get("lengths")) if args.only == "lengths" \
        else [] if args.only else report.targets(
        result["served"], result["ratios"], result.get("mixed"), result.get("prefix"),
        result.get("raw"), result.get("stop_strings"), result.get("lengths"))
    if result.get("peers"):
        result["targets"] += report.peer_targets(result["peers"], args.backend)
    result["targets"] += report.quality_targets(result.get("quality"))
    if result.get("batch"):
        result["targets"] += report.batch_targets(result["batch"])
    result["targets"] += long_targets(result.get("long"))
    result["targets"] += attack_targets(result.get("attacks"))
    result["targets"] += tools_targets(result.get("tools"))
    if result.get("baseline"):
        result["targets"] += report.baseline_targets(result["baseline"])
    json_path = out_dir / f"{stamp}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    png_path = out_dir / f"{stamp}.png" if result["served"] or result.get("raw") else None
    try:
        if png_path:
            report.plot(result, png_path)
    except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
        progress(f"plot failed: {type(exc).__name__}: {exc}")
        png_path = None
    print()
    print(report.format_table(result))
    print("\n".join(format_long(result.get("long"))))
    print("\n".join(format_attacks(result.get("attacks"))))
    print("\n".join(structured_lines(result.get("structured"))))
    print("\n".join(tools_lines(result.get("tools"))))
    progress(f"results: {json_path}" + (f" and {png_path}" if png_path else ""))
    # --only baseline: a baseline that did not run is this run's failure (the row says why).
    failed = args.only == "baseline" and (result.get("baseline") or {}).get("error")
    return 1 if error or failed else 0


if __name__ == "__main__":
    sys.exit(main())
