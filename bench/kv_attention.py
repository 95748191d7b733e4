"""Decode step time of the model worker with mixed lengths (`python -m bench.kv_attention`).

32 short sequences alone, then the same 32 beside one long prompt: the median time of a decode
step of the whole batch, in this process, default model (CPU: 2 threads, packed linears). Used
to choose the paged attention's layout; run it under an older checkout's PYTHONPATH to compare
(64 rows in bf16: `--short 64 --short-len 150 --dtype bfloat16 --threads 1`).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from common.protocol import SamplingParams
from common.settings import Settings
from worker.messages import NewSequence, StepRequest
from worker.model_worker import ModelWorker


def decode_step_s(worker, prompts: dict[str, list[int]], steps: int) -> float:
    """Prefills the prompts (those named z* after the others, while they decode), then times
    decode steps of them all."""
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    first = [s for s in prompts if not s.startswith("z")]
    worker.step(StepRequest(prefill=[NewSequence(s, prompts[s], greedy) for s in first]))
    later = [s for s in prompts if s.startswith("z")]
    if later:
        res = worker.step(StepRequest(prefill=[NewSequence(s, prompts[s], greedy) for s in later],
                                      decode_seq_ids=first))
        while not all(s in res.token_ids for s in later):   # a chunked prefill goes on
            res = worker.step(StepRequest(decode_seq_ids=list(prompts)))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        worker.step(StepRequest(decode_seq_ids=list(prompts)))
        times.append(time.perf_counter() - t)
    worker.step(StepRequest(free_seq_ids=list(prompts)))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--short-len", type=int, default=40)
    ap.add_argument("--long-len", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)   # 1 on a busy machine
    ap.add_argument("--dtype", default="float32", help="bfloat16: the default on AVX512-BF16/AMX")
    ap.add_argument("--group-padding", type=float, default=None,
                    help="paged cache only: max padding of a decode group (large: one group)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    worker = ModelWorker.load(Settings.from_env().replace(device="cpu", dtype=args.dtype,
                                                          prefix_cache_mb=0))
    if args.group_padding is not None:
        worker.cache.max_group_padding = args.group_padding
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(100, 40000) for _ in range(n)]   # noqa: E731
    short = {f"s{i:02d}": ids(args.short_len) for i in range(args.short)}
    alone = decode_step_s(worker, short, args.steps)
    mixed = decode_step_s(worker, {**short, "z-long": ids(args.long_len)}, args.steps)
    print(f"decode step: {args.short} x {args.short_len} tokens {alone * 1000:.0f} ms; "
          f"+ 1 x {args.long_len} {mixed * 1000:.0f} ms ({mixed / alone:.2f}x)")


if __name__ == "__main__":
    main()
