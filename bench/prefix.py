"""Prefix caching, measured: chat requests, every one beginning with the chat template's system
turn, run twice on the same worker: first each with its own `cache_salt` (nothing can be reused:
the cache off, as far as these requests go), then without (the system turn's blocks are reused).
Reports TTFT and how many prompt tokens the worker took from its cache."""
from __future__ import annotations

from .loadgen import closed_loop
from .report import summarize

QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "How many legs does a spider have?", "What does a compiler do?",
             "Why is the sky blue?", "Give me a word that rhymes with moon.",
             "What is the boiling point of water?", "Who wrote Hamlet?"]


def chat_payload(i: int, tokens: int, salt: str | None = None) -> dict:
    p = {"messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}],
         "stream": True, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
         "temperature": 0}
    if salt:
        p["cache_salt"] = salt
    return p


def prefix_phase(stack, concurrency: int, n: int, tokens: int, progress=print,
                 hard_limit_s: float = 120.0) -> dict:
    out = {"concurrency": concurrency, "requests": n, "max_tokens": tokens}
    for mode in ("without", "with"):
        before = stack.worker_info()
        payloads = [chat_payload(i, tokens, f"bench-{i}" if mode == "without" else None)
                    for i in range(n)]
        results, wall, _cut = closed_loop(stack.url, concurrency, payloads,
                                          hard_limit_s=hard_limit_s)
        after = stack.worker_info()
        s = summarize(results, wall)
        s["prefill_tokens"] = int(after.get("prefill_tokens", 0) - before.get("prefill_tokens", 0))
        s["cached_tokens"] = int(after.get("prefix_cached_tokens", 0)
                                 - before.get("prefix_cached_tokens", 0))
        out[mode] = s
        fail = f", {s['failures']} FAILED" if s["failures"] else ""
        progress(f"prefix: {mode:>7} reuse: TTFT p50 {s['ttft_p50_s']} s p95 {s['ttft_p95_s']} s, "
                 f"{s['cached_tokens']} of {s['prefill_tokens']} prompt tokens from the cache"
                 f"{fail}")
    w, wo = out["with"]["ttft_p50_s"], out["without"]["ttft_p50_s"]
    out["ttft_p50_with_over_without"] = round(w / wo, 3) if w and wo else None
    return out
