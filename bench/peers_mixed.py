"""The peers table's mixed load (issue 52): retrieval-augmented traffic's shape, 16 streams over
48 prompts of 16-3,000 tokens (mean ~600), 64 output tokens each, the same for every system.

Most prompts are short and a few are long: the lengths follow a power of the uniform quantile
on a log scale (log-uniform for power 1, mean ~570 over 16-3,000), the power found so that the
mean is the one asked for. The quantiles are evenly spaced from 0 to 1 (both ends in), not drawn, so every run and every
system gets the same lengths (only their order is shuffled by the seed).
"""
from __future__ import annotations

import random

MIXED_STREAMS = 16
MIXED_PROMPTS = 48
MIXED_RANGE = (16, 3000)
MIXED_MEAN = 600
# Its level's time limit at least: 48 x 64 tokens at the ~40 tok/s the mixed load saw here take
# ~80 s, past the uniform levels' 45.
MIXED_TIME_LIMIT_S = 150.0
MIXED = "mixed"   # the level key of the mixed load's rows (the uniform ones: their concurrency)


def _lengths(n: int, lo: int, hi: int, power: float) -> list[int]:
    return [round(lo * (hi / lo) ** ((i / max(1, n - 1)) ** power)) for i in range(n)]


def mixed_prompt_lengths(n: int = MIXED_PROMPTS, lo: int = MIXED_RANGE[0],
                         hi: int = MIXED_RANGE[1], mean: float = MIXED_MEAN,
                         seed: int = 52) -> list[int]:
    """n prompt lengths in [lo, hi] whose mean is about `mean`, in a seeded order."""
    if not lo <= mean <= hi:
        raise ValueError(f"mean {mean} is outside {lo}-{hi}")
    # The mean falls as the power grows (the quantiles are below 1): bisect on it.
    small, big = 1e-3, 1e3
    for _ in range(60):
        mid = (small * big) ** 0.5
        if sum(_lengths(n, lo, hi, mid)) / n > mean:
            small = mid
        else:
            big = mid
    out = _lengths(n, lo, hi, (small * big) ** 0.5)
    random.Random(seed).shuffle(out)
    return out


def mixed_prompts(tokenizer, synthetic, lengths: list[int], offset: int) -> list[str]:
    """One synthetic prompt (peers.synthetic_prompts) of each length, each distinct from its
    first token (no prefix cache helps)."""
    return [synthetic(tokenizer, 1, num_tokens=n, offset=offset + i)[0]
            for i, n in enumerate(lengths)]
