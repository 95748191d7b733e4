"""Service metrics shared through Redis: workers record, any API replica exports.

Why Redis: the figures that matter (time to first token, time per output token, queue time)
are known only in the worker, which is another process and usually another host. Each worker
adds a run sequence's observations to one Redis hash with HINCRBY right after the round trip
that finishes it; a sequence that ends without running (cancelled while queued, rejected at
admission) is counted in request_success_total by the store's finish script itself. Every
API replica's /metrics reads that hash, the live workers' heartbeats (running and waiting
gauges) and the queue length, so one scrape of any replica shows the whole service and nothing
is lost when a worker restarts. (Prometheus' multiprocess mode only covers
processes that share a disk; per-worker exporters would need service discovery of workers.)
"""
from __future__ import annotations

import math

from .keys import Keys

METRICS_KEY = Keys.metrics

# vLLM's metric names (vllm:*), with the llmq_ prefix.
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "time_to_first_token_seconds": (
        "Time from submission to the first generated token.",
        (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)),
    "time_per_output_token_seconds": (
        "Mean time between output tokens of a sequence (inter-token latency).",
        (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)),
    "e2e_request_latency_seconds": (
        "Time from submission to the end of the sequence.",
        (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)),
    "request_queue_time_seconds": (
        "Time a sequence waited before a worker started it.",
        (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)),
}
COUNTERS = {
    "prompt_tokens_total": "Prompt tokens processed.",
    "generation_tokens_total": "Tokens generated.",
    "prompt_tokens_cached_total": "Prompt tokens whose keys and values came from the prefix cache.",
    "num_preemptions_total": "Times a running sequence was sent back to wait (for KV cache "
                             "blocks, a fair share or a better priority; counted when the "
                             "sequence finishes).",
}
SUCCESS_COUNTER = "request_success_total"


def _bucket_index(buckets: tuple[float, ...], value: float) -> int:
    for i, le in enumerate(buckets):
        if value <= le:
            return i
    return len(buckets)   # +Inf


def record_finished(pipe, *, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                    cached_tokens: int = 0, preemptions: int = 0,
                    queue_s: float | None, ttft_s: float | None, tpot_s: float | None,
                    e2e_s: float | None) -> None:
    """Adds one finished sequence's figures to a redis-py pipeline (the caller executes it)."""
    values = {"time_to_first_token_seconds": ttft_s, "time_per_output_token_seconds": tpot_s,
              "e2e_request_latency_seconds": e2e_s, "request_queue_time_seconds": queue_s}
    for name, value in values.items():
        if value is None or math.isnan(value):
            continue
        value = max(0.0, value)
        idx = _bucket_index(HISTOGRAMS[name][1], value)
        pipe.hincrby(METRICS_KEY, f"h:{name}:{idx}", 1)
        pipe.hincrbyfloat(METRICS_KEY, f"h:{name}:sum", value)
    pipe.hincrby(METRICS_KEY, "c:prompt_tokens_total", prompt_tokens)
    pipe.hincrby(METRICS_KEY, "c:generation_tokens_total", generation_tokens)
    if cached_tokens:
        pipe.hincrby(METRICS_KEY, "c:prompt_tokens_cached_total", cached_tokens)
    if preemptions:
        pipe.hincrby(METRICS_KEY, "c:num_preemptions_total", preemptions)
    pipe.hincrby(METRICS_KEY, f"c:{SUCCESS_COUNTER}:{finish_reason}", 1)


def read_snapshot(client) -> dict:
    """The recorded figures as plain data: {"histograms": {name: (cumulative buckets, sum,
    count)}, "counters": {name: value}, "success": {reason: n}}."""
    raw = client.hgetall(METRICS_KEY) or {}
    raw = {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}
    hists = {}
    for name, (_help, buckets) in HISTOGRAMS.items():
        counts = [raw.get(f"h:{name}:{i}", 0.0) for i in range(len(buckets) + 1)]
        cumulative, acc = [], 0.0
        for le, c in zip(list(buckets) + [math.inf], counts):
            acc += c
            cumulative.append((le, acc))
        hists[name] = (cumulative, raw.get(f"h:{name}:sum", 0.0), acc)
    counters = {name: raw.get(f"c:{name}", 0.0) for name in COUNTERS}
    prefix = f"c:{SUCCESS_COUNTER}:"
    success = {k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)}
    return {"histograms": hists, "counters": counters, "success": success}
