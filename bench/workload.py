"""The mixed workload: prompts of 10-400 tokens, forced outputs, Poisson arrivals; seeded."""
from __future__ import annotations

import random

_WORDS = ("time year people way day man thing woman life child world school state family "
          "student group country problem hand part place case week company system program "
          "question work government number night point home water room mother area money story "
          "fact month lot right study book eye job word business issue side kind head house "
          "service friend father power hour game line end member law car city community name "
          "president team minute idea kid body information back parent face others level office "
          "door health person art war history party result change morning reason research girl "
          "guy moment air teacher force education river mountain garden engine light music road "
          "market paper field table window summer winter bridge island forest stone ship letter "
          "bright quiet ancient careful simple strange golden heavy narrow gentle rapid silent "
          "builds carries finds watches writes reads opens closes follows remembers explains "
          "and the of to in on with over under before after because while although").split()


def make_prompt(tokenizer, n_tokens: int, rng: random.Random, index: int) -> str:
    """A raw prompt of about n_tokens tokens (cut in token space, then decoded)."""
    words = [f"Request {index}:"]
    while True:
        words.extend(rng.choice(_WORDS) for _ in range(max(8, n_tokens)))
        ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            return tokenizer.decode(ids[:n_tokens]).strip()


def mixed_requests(tokenizer, n: int, seed: int, prompt_range=(10, 400),
                   output_range=(8, 256)) -> list[dict]:
    """n requests: {"prompt", "prompt_tokens" (target), "max_tokens"}; uniform lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randint(*prompt_range)
        o = rng.randint(*output_range)
        out.append({"prompt": make_prompt(tokenizer, p, rng, i), "prompt_tokens": p, "max_tokens": o})
    return out


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process at `rate` per second; the first arrives at 0."""
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
