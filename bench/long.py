"""Long generations (`--only long`, issue 51): many sequences generating thousands of tokens each
(ignore_eos, a short prompt), sampled while they run. What a step costs should not grow with
the length: the phase reports, at 100, 1,000, 4,000 and 8,000 tokens, the engine's host time
per step (its own work around the model's pass, and the Redis publish beside it) and the bytes
sent to Redis per step, the tokens per second over time, and the append-only file's growth
against the tokens generated (its bytes per token at the start and at the end of the phase).

Redis's append-only file is switched on for the phase (CONFIG SET, automatic rewrites off, so
its size is what was appended). The engine's step counters come from its heartbeat (every
LLMQ_WORKER_HEARTBEAT seconds); the tokens and Redis's byte counters are read at each sample.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import redis
import requests

from common.keys import Keys

MARKS = (100, 1000, 4000, 8000)
PROMPT = "Tell a long story about a lighthouse keeper and the ships she guided."
# The bars (issue 51): the last mark's figure over the first mark's.
BYTES_BAR, HOST_BAR, AOF_BAR = 1.2, 1.5, 1.2
FINISHED = {"succeeded", "failed", "cancelled"}


@dataclass
class Sample:
    """The phase at one moment."""

    t: float            # seconds since the sequences were sent
    tokens: int         # completion tokens of every sequence so far (their records)
    position: float     # the mean completion tokens of the running sequences
    running: int
    finished: int
    redis_in: int       # Redis's total_net_input_bytes
    aof: int            # Redis's aof_current_size
    steps: float        # the worker's StepTiming totals, as its last heartbeat reported them
    host_s: float
    publish_s: float
    model_s: float
    step_s: float


def marks_for(tokens: int) -> list[int]:
    """The marks a run of `tokens` tokens reaches, its own length last (a short smoke run
    still has a first and a last mark)."""
    return [m for m in MARKS if m < tokens] + [tokens]


def long_phase(stack, num_seqs: int = 64, tokens: int = 8000, time_limit_s: float = 3600.0,
               interval_s: float = 0.5, progress=print) -> dict:
    """Sends the sequences, samples them to the end (or the time limit: the rest are
    cancelled), and summarizes."""
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    try:
        _append_only(client)
        http = requests.Session()
        ids = []
        for _ in range(num_seqs):
            r = http.post(f"{stack.url}/v1/jobs", json={"prompt": PROMPT, "max_tokens": tokens,
                                                         "ignore_eos": True}, timeout=30)
            r.raise_for_status()
            ids.append(r.json()["id"])
        t0 = time.monotonic()
        samples = [_sample(client, ids, stack.worker_name, 0.0, 1)]
        next_note = 30.0
        while samples[-1].finished < len(ids):
            time.sleep(interval_s)
            samples.append(_sample(client, ids, stack.worker_name, time.monotonic() - t0,
                                   len(samples) + 1))
            s = samples[-1]
            if s.t >= next_note:
                next_note += 30.0
                progress(f"long: {s.t:.0f} s, {s.tokens} tokens, {s.running} running at "
                         f"~{s.position:.0f} tokens each, {s.finished} finished")
            if s.t > time_limit_s:
                progress(f"long: time limit {time_limit_s:.0f} s: cancelling the rest")
                for seq_id in ids:
                    http.delete(f"{stack.url}/v1/jobs/{seq_id}", timeout=30)
                break
        out = summarize(samples, num_seqs, tokens)
        out["worker"] = {k: v for k, v in client.hgetall(Keys.worker(stack.worker_name)).items()
                         if k in ("max_running", "num_preempted", "device", "dtype")}
        return out
    finally:
        client.close()


def _append_only(client) -> None:
    """Switches the append-only file on (its first rewrite done) with automatic rewrites off:
    from here its size grows by what each command appends."""
    client.config_set("auto-aof-rewrite-percentage", 0)
    client.config_set("appendonly", "yes")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = client.info("persistence")
        if (info.get("aof_enabled") and not info.get("aof_rewrite_in_progress")
                and not info.get("aof_rewrite_scheduled")):
            return
        time.sleep(0.1)
    raise TimeoutError("redis did not switch its append-only file on within 60 s")


def _resp_bytes(args) -> int:
    """What a command's arguments take on the wire (RESP)."""
    parts = [str(a).encode() for a in args]
    return len(f"*{len(parts)}\r\n") + sum(len(f"${len(p)}\r\n") + len(p) + 2 for p in parts)


def _sample(client, ids: list[str], worker: str, t: float, nth: int) -> Sample:
    """The phase now; `nth`: this sample's number (1 for the first), whose commands' bytes
    (as many as each of the samples before) come off Redis's input count, so that what is
    counted is the stack's traffic, not the sampler's."""
    pipe = client.pipeline(transaction=False)
    for seq_id in ids:
        pipe.hmget(Keys.record(seq_id), "status", "completion_tokens")
    pipe.hgetall(Keys.worker(worker))
    pipe.info("stats")
    pipe.info("persistence")
    own = sum(_resp_bytes(args) for args, _opts in pipe.command_stack)
    *recs, w, stats, pers = pipe.execute()
    counts = [int(n or 0) for _st, n in recs]
    running = [int(n or 0) for st, n in recs if st == "running"]

    def f(name: str) -> float:
        return float(w.get(f"timing_{name}") or 0.0)

    return Sample(t=round(t, 3), tokens=sum(counts),
                  position=sum(running) / len(running) if running else sum(counts) / len(ids),
                  running=len(running), finished=sum(1 for st, _n in recs if st in FINISHED),
                  redis_in=int(stats.get("total_net_input_bytes", 0)) - nth * own,
                  aof=int(pers.get("aof_current_size", 0)), steps=f("steps"), host_s=f("host_s"),
                  publish_s=f("publish_s"), model_s=f("model_prefill_s") + f("model_decode_s"),
                  step_s=f("step_s"))


# --- the report (no stack: tests/unit/test_bench_long.py) ------------------------------------
def summarize(samples: list[Sample], num_seqs: int, tokens: int) -> dict:
    """Per mark: host time and Redis bytes per step around it; tokens/s over time; the AOF's
    bytes per token over the first and the last tenth of the tokens."""
    total = samples[-1].tokens - samples[0].tokens
    wall = samples[-1].t - samples[0].t
    out = {"num_seqs": num_seqs, "tokens_per_seq": tokens, "tokens": total,
           "wall_s": round(wall, 2),
           "tokens_per_s": round(total / wall, 1) if wall > 0 else None,
           "at": [_at_mark(samples, m) for m in marks_for(tokens)],
           "tokens_per_s_over_time": _over_time(samples),
           "aof": _aof(samples)}
    out["samples"] = len(samples)
    return out


def _window(samples: list[Sample], lo: float, hi: float) -> tuple[Sample, Sample] | None:
    """The first and last samples whose position lies in [lo, hi] (or, sampled past it, the
    two around it), widened by one sample at a time until both the tokens and the heartbeat's
    step count moved between them; None when the run never got there."""
    inside = [i for i, s in enumerate(samples) if lo <= s.position <= hi and s.running]
    if not inside:
        before = [i for i, s in enumerate(samples) if s.position < lo]
        after = [i for i, s in enumerate(samples) if s.position > hi]
        if not before or not after:
            return None
        inside = [before[-1], after[0]]
    a, b = inside[0], inside[-1]
    while True:
        sa, sb = samples[a], samples[b]
        if sb.tokens > sa.tokens and sb.steps > sa.steps:
            return sa, sb
        if a == 0 and b == len(samples) - 1:
            return None
        a, b = max(0, a - 1), min(len(samples) - 1, b + 1)


def _at_mark(samples: list[Sample], mark: int) -> dict:
    span = max(20.0, 0.1 * mark)
    got = _window(samples, mark - span, mark + span)
    row: dict = {"tokens": mark}
    if got is None:
        return {**row, "host_ms_per_step": None, "redis_bytes_per_step": None}
    a, b = got
    steps = b.steps - a.steps
    per_token = (b.redis_in - a.redis_in) / (b.tokens - a.tokens)
    # One token per running sequence per step: a step's bytes are a token's times the batch.
    batch = (a.running + b.running) / 2 or 1
    return {**row, "position": [round(a.position, 1), round(b.position, 1)],
            "steps": int(steps),
            "host_ms_per_step": round(1000 * (b.host_s - a.host_s + b.publish_s - a.publish_s)
                                      / steps, 3),
            "engine_ms_per_step": round(1000 * (b.host_s - a.host_s) / steps, 3),
            "publish_ms_per_step": round(1000 * (b.publish_s - a.publish_s) / steps, 3),
            "model_ms_per_step": round(1000 * (b.model_s - a.model_s) / steps, 3),
            "step_ms": round(1000 * (b.step_s - a.step_s) / steps, 3),
            "redis_bytes_per_token": round(per_token, 1),
            "redis_bytes_per_step": round(per_token * batch),
            "aof_bytes_per_step": round((b.aof - a.aof) / (b.tokens - a.tokens) * batch)}


def _over_time(samples: list[Sample], buckets: int = 20) -> list[dict]:
    """Tokens per second in (about) `buckets` equal stretches of the phase."""
    end = samples[-1].t
    if end <= 0:
        return []
    rows, prev = [], samples[0]
    for k in range(1, buckets + 1):
        upto = [s for s in samples if s.t <= end * k / buckets]
        cur = upto[-1] if upto else prev
        if cur.t > prev.t:
            rows.append({"t": cur.t, "position": round(cur.position, 1),
                         "tokens_per_s": round((cur.tokens - prev.tokens) / (cur.t - prev.t), 1)})
            prev = cur
    return rows


def _aof(samples: list[Sample]) -> dict:
    """The AOF's growth against the tokens: in all (the final texts included, each written
    once), and in bytes per token over the first and the last tenth of the tokens generated
    before the first sequence ended (equal when each token costs the same)."""
    first, last = samples[0], samples[-1]
    total = last.tokens - first.tokens
    out = {"bytes": last.aof - first.aof, "tokens": total,
           "bytes_per_token": round((last.aof - first.aof) / total, 1) if total else None}
    running = [s for s in samples if not s.finished] or samples
    first, last = running[0], running[-1]
    total = last.tokens - first.tokens
    if total <= 0:
        return {**out, "start_bytes_per_token": None, "end_bytes_per_token": None}
    head_end = next(s for s in running if s.tokens >= first.tokens + total / 10)
    tail_start = [s for s in running if s.tokens <= last.tokens - total / 10][-1]

    def rate(a: Sample, b: Sample):
        return round((b.aof - a.aof) / (b.tokens - a.tokens), 1) if b.tokens > a.tokens else None

    return {**out, "start_bytes_per_token": rate(first, head_end),
            "end_bytes_per_token": rate(tail_start, last)}


def long_targets(long: dict | None) -> list[dict]:
    """Issue 51's bars: bytes and host time per step at the last mark against the first, and
    the AOF's bytes per token at the end against the start."""
    if not long or not long.get("at"):
        return []
    first, last = long["at"][0], long["at"][-1]
    out = []
    for key, bar, what in (("redis_bytes_per_step", BYTES_BAR, "Redis bytes sent per step"),
                           ("aof_bytes_per_step", BYTES_BAR, "AOF bytes written per step"),
                           ("host_ms_per_step", HOST_BAR, "host time per step")):
        v = _ratio(last.get(key), first.get(key))
        out.append({"name": f"long: {what} at {last['tokens']} tokens <= {bar} x at "
                            f"{first['tokens']}", "value": v,
                    "met": None if v is None else v <= bar})
    aof = long.get("aof") or {}
    v = _ratio(aof.get("end_bytes_per_token"), aof.get("start_bytes_per_token"))
    out.append({"name": f"long: AOF bytes per token at the end <= {AOF_BAR} x at the start "
                        "(linear growth)", "value": v, "met": None if v is None else v <= AOF_BAR})
    return out


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def format_long(long: dict | None) -> list[str]:
    """The phase's lines of the summary."""
    if not long:
        return []
    lines = [f"Long generations: {long['num_seqs']} x {long['tokens_per_seq']} tokens "
             f"(ignore_eos), {long['tokens']} tokens in {long['wall_s']} s "
             f"({long['tokens_per_s']} tok/s)",
             f"  {'tokens':>6}  {'host ms/step':>12}  {'publish ms':>10}  {'model ms':>8}  "
             f"{'redis B/step':>12}  {'aof B/step':>10}"]
    for row in long["at"]:
        if row.get("steps") is None:
            lines.append(f"  {row['tokens']:>6}  (not reached)")
            continue
        lines.append(f"  {row['tokens']:>6}  {row['host_ms_per_step']:>12}  "
                     f"{row['publish_ms_per_step']:>10}  {row['model_ms_per_step']:>8}  "
                     f"{row['redis_bytes_per_step']:>12}  {row['aof_bytes_per_step']:>10}")
    aof = long["aof"]
    lines.append(f"  AOF: {aof['bytes']} bytes for {aof['tokens']} tokens "
                 f"({aof['bytes_per_token']} B/token; first tenth "
                 f"{aof['start_bytes_per_token']}, last tenth {aof['end_bytes_per_token']})")
    tps = ", ".join(f"{r['tokens_per_s']}@{r['position']:.0f}"
                    for r in long["tokens_per_s_over_time"])
    lines.append(f"  tok/s over time (at position): {tps}")
    return lines
