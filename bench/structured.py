"""The cost of structured output, served: the same closed-loop workload at one concurrency twice,
without and then with a JSON response format on every other request (constrained and free
sequences in one batch), so the difference is what the token mask costs the whole batch."""
from __future__ import annotations

from . import report
from .loadgen import closed_loop
from .raw import short_prompts

JSON_OBJECT = {"type": "json_object"}


def structured_phase(url: str, concurrency: int, num_requests: int, payload, time_limit_s: float,
                     progress=print, prompt_offset: int = 2000) -> dict:
    """`payload(prompt)` makes one free request; returns both runs' summaries and the ratio."""
    prompts = short_prompts(num_requests, prompt_offset)
    # Untimed: the worker builds its grammar tokenizer at the first structured request (~1 s).
    closed_loop(url, 1, [{**payload(prompts[0]), "response_format": JSON_OBJECT}],
                time_limit_s / 2, time_limit_s)
    runs = {}
    for name, every in (("free", 0), ("half_structured", 2)):
        payloads = [{**payload(p), **({"response_format": JSON_OBJECT}
                                      if every and i % every else {})}
                    for i, p in enumerate(prompts)]
        results, wall, truncated = closed_loop(url, concurrency, payloads, time_limit_s / 2,
                                               time_limit_s)
        s = report.summarize(results, wall)
        s.update(truncated=truncated)
        runs[name] = s
        progress(f"structured: concurrency {concurrency}, {name.replace('_', ' ')}: "
                 f"{s['tokens_per_s']} tok/s, ITL p50 {s['itl_p50_s']}, "
                 f"{s['failures']} failed{' (cut by the time limit)' if truncated else ''}")
    free, half = runs["free"]["tokens_per_s"], runs["half_structured"]["tokens_per_s"]
    return {"concurrency": concurrency, **runs,
            "throughput_ratio": round(half / free, 3) if free and half else None}


def format_lines(result: dict | None) -> list[str]:
    if not result:
        return []
    free, half = result["free"], result["half_structured"]
    return [f"Structured output at concurrency {result['concurrency']} (json_object on every "
            "other request)",
            f"  free {report._f(free['tokens_per_s'])} tok/s, half structured "
            f"{report._f(half['tokens_per_s'])} tok/s: ratio "
            f"{report._f(result['throughput_ratio'], '{:.2f}')}", ""]
