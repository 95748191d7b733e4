"""Stream capacity: N SSE streams open at once on the API, and how other requests fare meanwhile.

Submits N short jobs in batches, opens one GET /v1/jobs/<id>/stream per job (one thread each),
and while they are open measures /healthz round trips. Reports how many streams ended with
their done event, failures, and the /healthz latency percentiles.
"""
from __future__ import annotations

import threading
import time

import requests

from .report import pct as percentile


def streams_phase(url: str, n: int = 256, max_tokens: int = 16, progress=print) -> dict:
    ids: list[str] = []
    for i in range(0, n, 64):
        batch = [f"Stream {j}: say something." for j in range(i, min(n, i + 64))]
        r = requests.post(f"{url}/v1/jobs", json={"prompts": batch, "max_tokens": max_tokens,
                                                 "min_tokens": max_tokens, "ignore_eos": True,
                                                 "temperature": 0}, timeout=60)
        r.raise_for_status()
        ids += [j["id"] for j in r.json()["jobs"]]
    done, errors, opened = [0], [], [0]
    lock = threading.Lock()
    all_open = threading.Event()

    def follow(seq_id: str) -> None:
        try:
            with requests.get(f"{url}/v1/jobs/{seq_id}/stream", stream=True,
                              timeout=(10, 300)) as resp:
                resp.raise_for_status()
                with lock:
                    opened[0] += 1
                    if opened[0] == len(ids):
                        all_open.set()
                for line in resp.iter_lines():
                    if line == b"event: done":
                        with lock:
                            done[0] += 1
                        return
            errors.append(f"{seq_id}: stream ended without done")
        except Exception as exc:  # noqa: BLE001 - counted, reported
            errors.append(f"{seq_id}: {type(exc).__name__}: {exc}")

    t0 = time.monotonic()
    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in ids]
    for t in threads:
        t.start()
    health = []
    while any(t.is_alive() for t in threads) and time.monotonic() - t0 < 600:
        h = time.perf_counter()
        try:
            requests.get(f"{url}/healthz", timeout=10).raise_for_status()
            health.append(time.perf_counter() - h)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"healthz: {exc}")
        time.sleep(0.05)
    for t in threads:
        t.join(5)
    out = {"streams": len(ids), "max_open_at_once": opened[0], "all_open_at_once": all_open.is_set(),
           "completed": done[0], "failures": len(errors), "errors": errors[:5],
           "healthz_p50_ms": round(1000 * (percentile(health, 50) or 0), 1),
           "healthz_p99_ms": round(1000 * (percentile(health, 99) or 0), 1),
           "healthz_probes": len(health), "elapsed_s": round(time.monotonic() - t0, 1)}
    progress(f"streams: {out['completed']}/{n} completed, {out['failures']} failures, /healthz "
             f"p50 {out['healthz_p50_ms']} ms p99 {out['healthz_p99_ms']} ms during")
    return out
