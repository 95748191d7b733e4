"""Stop strings, worst case (issue 23): can one request's stop strings slow every step?

Two measurements:
- `per_token_ms` (python -m bench.stop_strings): the engine's cost per token of one sequence
  whose stop strings keep text held back. One stop string matches the output so far ("a" x
  5,000 then "X"), so 5,000 characters stay held; 15 others never match. Run against an older
  tree with PYTHONPATH=<that tree> to compare.
- `stop_strings_phase` (make bench, phase 2d): the served engine's step time for the same
  requests twice, plain, then each with the most stop strings the API accepts (16 of 256
  characters), built from the text the plain run produced so that everything a sequence
  generates stays held back (greedy decoding makes the second run's text the same).
"""
from __future__ import annotations

import argparse
import json
import time

import requests

from common.protocol import SamplingParams
from worker.sequence import Sequence

from .loadgen import closed_loop
from .report import summarize


def per_token_ms(stop_chars: int, num_stops: int, tokens: int) -> float:
    stops = ["a" * stop_chars + "X"] + [chr(0x62 + k) * stop_chars for k in range(num_stops - 1)]
    seq = Sequence("s", [1], SamplingParams(max_tokens=10**6, stop=stops))
    seq.add_text("a" * stop_chars)          # hold `stop_chars` characters back
    assert len(seq.pending_text) == stop_chars and not seq.is_cut_at_stop
    t0 = time.perf_counter()
    for _ in range(tokens):
        seq.add_text("a")
    return (time.perf_counter() - t0) * 1000 / tokens


def worst_stops(text: str, num_stops: int = 16, chars: int = 256) -> list[str]:
    """Stop strings that hold back all of `text` (up to `chars` - 1 characters) and never
    complete: the text itself padded with a character it does not contain."""
    held = (text[:chars - 1] + "\x01").ljust(chars, "\x01")
    return [held] + [(text[:k] + "\x02").ljust(chars, "\x02")
                     for k in range(1, num_stops)]


def stop_strings_phase(stack, concurrency: int, n: int, tokens: int, progress=print,
                       hard_limit_s: float = 120.0) -> dict:
    base = [{"prompt": f"Once upon a time, story number {i}", "stream": True, "max_tokens": tokens,
             "min_tokens": tokens, "ignore_eos": True, "temperature": 0} for i in range(n)]
    out: dict = {"concurrency": concurrency, "requests": n, "max_tokens": tokens}
    texts: list[str] = []
    for mode in ("plain", "worst"):
        payloads = base if mode == "plain" else [
            {**p, "stop": worst_stops(t)} for p, t in zip(base, texts)]
        before = stack.worker_info()
        results, wall, _cut = closed_loop(stack.url, concurrency, payloads,
                                          hard_limit_s=hard_limit_s)
        after = stack.worker_info()
        if mode == "plain":
            texts = [requests.get(f"{stack.url}/v1/jobs/{r.seq_id}", timeout=10).json()["text"]
                     for r in results]
        steps = max(1.0, after.get("timing_steps", 0) - before.get("timing_steps", 0))
        d = {k: after.get(k, 0) - before.get(k, 0) for k in ("timing_step_s", "timing_host_s")}
        s = summarize(results, wall)
        s["step_ms"] = round(1000 * (d["timing_step_s"] + d["timing_host_s"]) / steps, 2)
        s["host_ms"] = round(1000 * d["timing_host_s"] / steps, 2)
        out[mode] = s
        progress(f"stop strings: {mode:>5}: {s['step_ms']} ms per engine step "
                 f"({s['host_ms']} ms of it host work), {s['failures']} failures")
    out["step_worst_over_plain"] = round(out["worst"]["step_ms"] / out["plain"]["step_ms"], 3)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stop-chars", type=int, default=5000)
    p.add_argument("--stops", type=int, default=16)
    p.add_argument("--tokens", type=int, default=200)
    a = p.parse_args(argv)
    print(json.dumps({"stop_chars": a.stop_chars, "stops": a.stops,
                      "ms_per_token": round(per_token_ms(a.stop_chars, a.stops, a.tokens), 4)}))


if __name__ == "__main__":
    main()
