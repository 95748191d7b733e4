"""Soak: many short requests through a real stack (redis-server, one Celery worker, the API under
gunicorn), with random cancels and client hang-ups, then an audit of what Redis holds.

    python -m bench.soak                      # 5,000 requests at concurrency 64, tiny model
    python -m bench.soak -n 500 -c 16         # a shorter run
    python -m bench.soak --model smollm2      # the default model instead of the tiny one

Each request is one of: a `/v1/generate` answered in full (most), a `/v1/jobs` cancelled at a
random moment, or a `/v1/generate` whose client hangs up (a read timeout) while it runs.
The audit, over every record the run made:
  lost            records that never ended (still queued or running after the settle time)
  finished_twice  event streams with more than one `done` event
  duplicated      finished records whose token events (after the last reset) do not add up
                  to their final text and completion count (a delta written twice, or lost)
  no_ttl          llmq keys the run made that have no expiry (shared singletons excepted)
and the worker's and the API's resident memory after a warm-up wave and after each fifth of the
run.
Prints one JSON object; exits 1 when any count above is not zero.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import redis
import requests

from common.keys import Keys

from .stack import Stack, wait_until

# Keys that live as long as the service (one each): not expected to expire.
SINGLETONS = {Keys.cancelled, Keys.workers, Keys.owner_secret, Keys.metrics,
              Keys.batches_active, Keys.webhooks_watch}
FINISHED = {"succeeded", "failed", "cancelled"}
PROMPTS = ["Hello", "The capital of France is", "Write a haiku about", "1, 2, 3,", "Once upon"]


class SoakStack(Stack):
    """The benchmark's stack with a chosen model (the tiny random one by default)."""

    def __init__(self, workdir: Path, model: str, **kw):
        super().__init__(workdir, **kw)
        self.model = model

    def base_env(self) -> dict:
        return {**super().base_env(), "LLMQ_MODEL": self.model}


def rss_mb(proc, part: str = "all") -> float:
    """A process group's resident memory in MB: the process and all its children (the worker's
    model process, gunicorn's workers) for "all", the root alone for "root", its children alone
    for "children" (which side grows tells a leak in the Celery worker from one in the model
    process)."""
    try:
        root = psutil.Process(proc.proc.pid)
        children = root.children(recursive=True)
    except psutil.Error:
        return 0.0
    procs = {"all": [root] + children, "root": [root], "children": children}[part]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return round(total / 2**20, 1)


def rss_sample(stack, done: int) -> dict:
    return {"done": done, "worker": rss_mb(stack.worker),
            "celery": rss_mb(stack.worker, "root"), "model": rss_mb(stack.worker, "children"),
            "api": rss_mb(stack.api)}


def one_request(session: requests.Session, url: str, rng: random.Random, counts: dict,
                lock: threading.Lock) -> None:
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, 12),
            "temperature": 0.8, "seed": rng.randrange(1 << 30)}
    kind = rng.choices(["generate", "cancel", "hang_up"], weights=[80, 10, 10])[0]
    outcome = kind
    try:
        if kind == "generate":
            r = session.post(f"{url}/v1/generate", json=body, timeout=300)
            outcome = "generate" if r.status_code == 200 else f"generate_{r.status_code}"
        elif kind == "cancel":
            r = session.post(f"{url}/v1/jobs", json={**body, "max_tokens": 64}, timeout=60)
            if r.status_code == 202:
                time.sleep(rng.random() * 0.2)   # a random moment: queued, running or ended
                session.delete(f"{url}/v1/jobs/{r.json()['id']}", timeout=60)
            else:
                outcome = f"cancel_{r.status_code}"
        else:
            # The client gives up while the request runs: its connection closes.
            session.post(f"{url}/v1/generate", json={**body, "max_tokens": 64},
                         timeout=(5, rng.uniform(0.01, 0.3)))
    except requests.Timeout:
        outcome = f"{kind}_timeout"
    except requests.RequestException as exc:
        outcome = f"{kind}_{type(exc).__name__}"
    with lock:
        counts[outcome] = counts.get(outcome, 0) + 1


def wave(url: str, n: int, concurrency: int, seed: int) -> dict:
    counts: dict[str, int] = {}
    lock = threading.Lock()
    local = threading.local()

    def run(i: int) -> None:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        one_request(local.session, url, random.Random(seed * 1_000_003 + i), counts, lock)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(run, range(n)))
    return counts


def audit(r: redis.Redis, settle_s: float) -> dict:
    """Every record the run made: ended once, its stream adding up, its keys expiring."""
    records = [k for k in r.scan_iter(Keys.record("*"), count=1000) if not k.endswith(":events")]

    def unfinished():
        return [k for k in records if r.hget(k, "status") not in FINISHED]

    try:   # cancels and hang-ups end within a step or two; the worker drains the rest
        wait_until(lambda: not unfinished(), settle_s, "every record to end", interval=0.5)
    except TimeoutError:
        pass
    lost = unfinished()
    twice, duplicated = [], []
    for key in records:
        seq_id = key[len(Keys.record("")):]
        entries = r.xrange(Keys.events(seq_id))
        kinds = [f["event"] for _i, f in entries]
        if kinds.count("done") > 1:
            twice.append(seq_id)
        last_reset = max((i for i, k in enumerate(kinds) if k == "reset"), default=-1)
        tokens = [json.loads(f["data"])["text"] for _i, f in entries[last_reset + 1:]
                  if f["event"] == "token"]
        rec = r.hgetall(key)
        if rec.get("status") in FINISHED and (
                "".join(tokens) != rec.get("text", "")
                or len(tokens) != int(rec.get("completion_tokens") or 0)):
            duplicated.append(seq_id)
    no_ttl = sorted(k for k in r.scan_iter("llmq:*", count=1000)
                    if k not in SINGLETONS and r.ttl(k) == -1)
    return {"records": len(records), "lost": len(lost), "finished_twice": len(twice),
            "duplicated": len(duplicated), "no_ttl": len(no_ttl),
            "examples": {"lost": lost[:5], "finished_twice": twice[:5],
                         "duplicated": duplicated[:5], "no_ttl": no_ttl[:5]}}


def tiny_model(workdir: Path) -> str:
    """The tests' tiny random model (two layers, the default model's tokenizer)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support import build_tiny_model
    from worker.model_manager import ModelManager

    return build_tiny_model(workdir / "tiny-model", ModelManager().resolve())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--requests", type=int, default=5000)
    ap.add_argument("-c", "--concurrency", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=200, help="requests before the first RSS")
    ap.add_argument("--model", default="", help="LLMQ_MODEL (default: the tiny random model)")
    ap.add_argument("--settle", type=float, default=120.0, help="seconds for the last to end")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="llmq-soak-"))
    stack = SoakStack(workdir, args.model or tiny_model(workdir),
                      max_num_seqs=args.concurrency, api_workers=1, api_threads=128)
    try:
        stack.start()
        r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        t0 = time.monotonic()
        print(f"soak: stack up; {args.warmup} warm-up requests, then {args.requests} at "
              f"concurrency {args.concurrency}", file=sys.stderr, flush=True)
        warm = wave(stack.url, args.warmup, args.concurrency, args.seed + 1)
        # RSS after the warm-up, then after each fifth of the run: growth that flattens is
        # caches filling; growth that goes on is a leak.
        series = [rss_sample(stack, 0)]
        counts: dict[str, int] = {}
        for part in range(5):
            n = args.requests * (part + 1) // 5 - args.requests * part // 5
            for k, v in wave(stack.url, n, args.concurrency, args.seed * 5 + part).items():
                counts[k] = counts.get(k, 0) + v
            series.append(rss_sample(stack, series[-1]["done"] + n))
            # Progress on stderr (the JSON report alone goes to stdout): a 5,000-request run
            # takes several minutes.
            print(f"soak: {series[-1]['done']}/{args.requests} requests in "
                  f"{time.monotonic() - t0:.0f} s; RSS worker {series[-1]['celery']} + model "
                  f"{series[-1]['model']} MB, "
                  f"API {series[-1]['api']} MB", file=sys.stderr, flush=True)
        print(f"soak: auditing every record (up to {args.settle:.0f} s for the last to end)",
              file=sys.stderr, flush=True)
        result = audit(r, args.settle)
        report = {"requests": args.requests, "concurrency": args.concurrency,
                  "wall_s": round(time.monotonic() - t0, 1), "outcomes": counts,
                  "warmup_outcomes": warm, **result,
                  "rss_mb": series,
                  "load": psutil.getloadavg(), "logs": str(workdir)}
        print(json.dumps(report, indent=2))
        bad = result["lost"] + result["finished_twice"] + result["duplicated"] + result["no_ttl"]
        return 1 if bad else 0
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
