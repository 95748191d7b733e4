"""Mixed lengths, measured: short requests alone, then the same short requests beside one long
prompt (3,000 tokens, then 8,000), then alone again. Reports the short ones' latency p50 with the
long one over without it, and the model process's peak RSS growth against the keys and values
its tokens need (the paged KV cache holds each sequence's own tokens, nothing padded)."""
from __future__ import annotations

import threading

import psutil

from .loadgen import closed_loop
from .raw import short_prompts
from .report import summarize

LONG_TEXT = ("The history of the lighthouse begins with fires lit on hilltops to guide ships, "
             "long before towers of stone were raised on rocks at the edge of the sea. ")


def long_prompt(tokenizer, num_tokens: int) -> str:
    """About num_tokens tokens of plain text, ending with a question, sharing no first token
    with another size's (so no cached prefix either). Decoded and encoded
    again, repeated text merges across the joins (8,000 ids gave 7,750 tokens): the body is
    grown by what is missing until the prompt is within 16 tokens of the size."""
    ids = tokenizer(LONG_TEXT, add_special_tokens=False)["input_ids"]
    want = num_tokens - 16
    # Each size begins with its own first token: the 8,000-token prompt otherwise began with
    # the 3,000-token one, whose blocks the prefix cache still held, so its prefill started
    # 3,000 tokens deep and the phase measured a 5,000-token prefill of deep chunks.
    lead = f"{num_tokens}: "
    for _ in range(4):
        body = (ids * (want // len(ids) + 1))[:want]
        text = lead + tokenizer.decode(body) + "\nWhat is this text about?"
        got = len(tokenizer(text)["input_ids"])
        if abs(got - num_tokens) <= 16:
            break
        want += num_tokens - got
    return text


def kv_bytes_per_token(model_dir: str, dtype: str = "float32") -> int:
    """Keys and values of one token over all layers in the served dtype, after the model's
    config (bfloat16 and float16 hold half of float32's bytes)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir).get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * (4 if dtype == "float32" else 2)


class PeakRSS:
    """The model process's resident memory, sampled every 0.2 s while a run goes on."""

    def __init__(self, worker_pid: int):
        kids = psutil.Process(worker_pid).children(recursive=True)
        self.proc = max(kids, key=lambda p: p.memory_info().rss)   # the model, not a tracker
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def now(self) -> int:
        return self.proc.memory_info().rss

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> "PeakRSS":
        self.peak = self.now()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._stop.clear()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def lengths_phase(stack, tokenizer, model_dir: str, num_short: int = 32, tokens: int = 64,
                  long_lengths=(3000, 8000), progress=print, hard_limit_s: float = 300.0,
                  dtype: str = "float32", kv_dtype: str | None = None) -> dict:
    kv_token = kv_bytes_per_token(model_dir, kv_dtype or dtype)   # the cache's own bytes
    shorts = [{"prompt": p, "stream": True, "max_tokens": tokens, "min_tokens": tokens,
               "ignore_eos": True, "temperature": 0} for p in short_prompts(num_short, 3000)]
    short_tokens = sum(len(tokenizer(p["prompt"])["input_ids"]) for p in shorts)
    rss = PeakRSS(stack.worker.proc.pid)
    out = {"short_requests": num_short, "max_tokens": tokens, "kv_bytes_per_token": kv_token,
           "dtype": dtype, "kv_dtype": kv_dtype or dtype,
           "rss_start_mb": round(rss.now() / 2**20, 1), "runs": []}

    def run(name: str, long_tokens: int = 0) -> dict:
        payloads = list(shorts)
        if long_tokens:
            payloads.append({**shorts[0], "prompt": long_prompt(tokenizer, long_tokens)})
        before = rss.now()
        with rss:
            results, wall, cut = closed_loop(stack.url, len(payloads), payloads,
                                             hard_limit_s=hard_limit_s)
        short = [r for r in results if r.prompt_tokens < 1000]
        s = summarize(short, wall)
        kv = kv_token * (short_tokens + num_short * tokens
                         + (long_tokens + tokens if long_tokens else 0))
        r = {"name": name, "long_prompt_tokens": long_tokens, "cut": cut,
             "short_latency_p50_s": s["latency_p50_s"], "short_failures": s["failures"],
             "long_ok": all(x.ok for x in results if x.prompt_tokens >= 1000),
             "rss_before_mb": round(before / 2**20, 1), "rss_peak_mb": round(rss.peak / 2**20, 1),
             "rss_growth_mb": round((rss.peak - before) / 2**20, 1),
             "kv_mb": round(kv / 2**20, 1)}
        out["runs"].append(r)
        progress(f"lengths: {name}: short latency p50 {r['short_latency_p50_s']} s, model RSS "
                 f"{r['rss_before_mb']:.0f} -> peak {r['rss_peak_mb']:.0f} MB (KV of its tokens "
                 f"{r['kv_mb']:.0f} MB){', CUT' if cut else ''}")
        return r

    alone = run("short alone")
    for n in long_lengths:
        r = run(f"short + 1 x {n}", n)
        if alone["short_latency_p50_s"] and r["short_latency_p50_s"]:
            r["short_p50_over_alone"] = round(r["short_latency_p50_s"]
                                              / alone["short_latency_p50_s"], 3)
        r["rss_growth_over_kv"] = round(r["rss_growth_mb"] / r["kv_mb"], 3) if r["kv_mb"] else None
        progress(f"lengths: beside 1 x {n}: short p50 {r.get('short_p50_over_alone')} x alone "
                 f"(target <= 1.5), RSS growth {r['rss_growth_over_kv']} x its KV bytes "
                 f"(target <= 1.25){'' if r['long_ok'] else '; the long request did not finish'}"
                 f"{' (cut by the time limit)' if r['cut'] else ''}")
    run("short alone again")
    out["rss_end_mb"] = round(rss.now() / 2**20, 1)
    return out
