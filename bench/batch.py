"""The batch phase: a batch of short lines through /v1/files and /v1/batches, its rate, and the
time to first token of interactive requests sent while it runs, against the same requests on
an idle queue (the Batch API must not starve interactive traffic: within 2x is the target)."""
from __future__ import annotations

import json
import time

import requests

from .loadgen import stream_generate
from .report import pct, time_split

ENDED = ("completed", "failed", "expired", "cancelled")


def probe(session: requests.Session, url: str, tokens: int) -> float | None:
    """One interactive streamed request; its time to first token (None if it failed)."""
    res = stream_generate(session, url, {"prompt": "The capital of France is",
                                         "max_tokens": tokens, "ignore_eos": True,
                                         "stream": True})
    return res.ttft if res.ok else None


def batch_phase(url: str, lines: int = 1000, tokens: int = 16, probes: int = 10,
                progress=print, info=None) -> dict:
    """info: the worker's counters and StepTiming totals (Stack.worker_info), read before and
    after the batch for its mean step time, which is what an interactive request waits for
    (the step in flight) before its prefill, and the steps that held batch newcomers back."""
    with requests.Session() as s:
        idle = [t for t in (probe(s, url, 8) for _ in range(probes)) if t is not None]
        body = "".join(json.dumps({
            "custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": f"Fact number {i}:", "max_tokens": tokens, "ignore_eos": True,
                     "temperature": 0}}) + "\n" for i in range(lines))
        before = info() if info else None
        f = s.post(f"{url}/v1/files", data={"purpose": "batch"},
                   files={"file": ("bench.jsonl", body.encode())}, timeout=60).json()
        t0 = time.perf_counter()
        batch = s.post(f"{url}/v1/batches", json={"input_file_id": f["id"],
                                                  "endpoint": "/v1/completions",
                                                  "completion_window": "24h"}, timeout=60).json()
        during = []
        while batch["status"] not in ENDED:
            ttft = probe(s, url, 8)
            if ttft is not None:
                during.append(ttft)
            batch = s.get(f"{url}/v1/batches/{batch['id']}", timeout=30).json()
        elapsed = time.perf_counter() - t0
    after = info() if info else None
    split = time_split(_timing(before), _timing(after), elapsed) if info else None
    counts = batch["request_counts"]
    out = {"lines": lines, "tokens_per_line": tokens, "status": batch["status"],
           "completed": counts["completed"], "failed": counts["failed"],
           "seconds": round(elapsed, 2), "lines_per_s": round(counts["completed"] / elapsed, 2),
           "ttft_idle_p50": pct(idle, 50), "ttft_during_p50": pct(during, 50),
           "probes_idle": len(idle), "probes_during": len(during),
           "ms_per_step": split and split["ms_per_step"], "time_split": split,
           "held_steps": _delta(before, after, "num_held_steps"),
           "interjected": _delta(before, after, "num_interjected")}
    if out["ttft_idle_p50"] and out["ttft_during_p50"]:
        out["ttft_ratio"] = round(out["ttft_during_p50"] / out["ttft_idle_p50"], 2)
        if out["ms_per_step"]:
            # What the batch adds to an interactive TTFT, in engine steps: about one (the step
            # in flight when it arrives, then its prefill) when it waits for nothing else.
            out["excess_in_steps"] = round(
                1000 * (out["ttft_during_p50"] - out["ttft_idle_p50"]) / out["ms_per_step"], 2)
    progress(f"batch of {lines} lines x {tokens} tokens: {out['status']} in {elapsed:.1f} s "
             f"({out['lines_per_s']} lines/s); interactive TTFT p50 idle "
             f"{_ms(out['ttft_idle_p50'])}, during the batch {_ms(out['ttft_during_p50'])} "
             f"({len(during)} probes; x{out.get('ttft_ratio', '?')}, target <= 2); engine step "
             f"{out['ms_per_step'] or '-'} ms on average during the batch; batch prefill held in "
             f"{out['held_steps'] if out['held_steps'] is not None else '-'} of "
             f"{split['steps'] if split else '-'} steps; "
             f"{out['interjected'] if out['interjected'] is not None else '-'} interactive "
             f"requests interjected into a step in flight")
    return out


def _timing(info: dict | None) -> dict | None:
    return info and {k[len("timing_"):]: v for k, v in info.items() if k.startswith("timing_")}


def _delta(before: dict | None, after: dict | None, key: str) -> int | None:
    if not before or not after or key not in after:
        return None
    return int(after[key] - before.get(key, 0))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"
