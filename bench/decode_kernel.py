"""Decode attention alone, torch path against the C++ kernel (`python -m bench.decode_kernel`).

64 rows of 150-300 tokens of context, their blocks interleaved (as rows joined in waves leave
them), SmolLM2-135M's shapes (9 query heads, 3 kv heads, 64 dims), bf16 by default: the
median time of one layer's paged_attention_forward over the decode rows (new keys written,
then attention), and of 30 layers (30 pools: the step's keys and values do not fit in the
caches), the two paths alternated each round; then the largest difference of their outputs.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from worker.model.transformers import cpu_kernels
from worker.model.transformers.kv_cache import PagedKVCache
from worker.model.transformers.paged_attention import paged_attention_forward

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 8


class Layer:
    """Stands in for a decoder layer's attention module: paged attention reads layer_idx."""

    def __init__(self, idx: int):
        self.layer_idx = idx


def make_cache(rows: int, lo: int, hi: int, layers: int, dtype, group_slots: int, seed: int = 0):
    rng = random.Random(seed)
    lengths = {f"s{i}": rng.randint(lo, hi) for i in range(rows)}
    cache = PagedKVCache(num_blocks=rows * (hi // BLOCK + 8), block_size=BLOCK, max_rows=rows,
                         max_group_slots=group_slots)
    for sid in lengths:
        cache.add(sid)
    # Grow in waves of 8 rows a token at a time for a while, so blocks interleave.
    grown = dict.fromkeys(lengths, 0)
    while any(grown[s] < lengths[s] for s in lengths):
        step = [(s, min(rng.randint(1, 16), lengths[s] - grown[s])) for s in lengths
                if grown[s] < lengths[s]]
        cache.commit(cache.plan(step))
        for s, n in step:
            grown[s] += n
    like = torch.empty(1, KV_HEADS, 1, DIM, dtype=dtype)
    for i in range(layers):
        k, v = cache.layer(i, like)
        k.copy_(torch.randn(k.shape)), v.copy_(torch.randn(v.shape))
    return cache, list(lengths)


def attend_all(plan, layers, q, k, v, kernel):
    """Never committed: every call attends the same lengths, writing the same slots."""
    plan.cache.decode_kernel = kernel
    return [paged_attention_forward(Layer(i), q, k, v, None, kv_plan=plan)[0]
            for i in range(layers)]


def median_ms(fns: dict, rounds: int) -> dict[str, tuple[float, float]]:
    """(wall, process CPU) median milliseconds of each function, alternated each round."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[name].append(((time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3))
    return {name: tuple(statistics.median(x) for x in zip(*t)) for name, t in times.items()}


def step(args) -> None:
    """Whole decode steps of the model worker (default model, CPU): 64 rows of 100-200 prompt
    tokens joined in waves of 8, decoded to ~170-300 tokens of context, the kernel switched on
    and off every step; medians of CPU time (thread_time) per step."""
    from common.protocol import SamplingParams
    from common.settings import Settings
    from worker.messages import NewSequence, StepRequest
    from worker.model.transformers.backend import TransformersBackend

    torch.set_num_threads(args.threads[0])
    settings = Settings.from_env().replace(device="cpu", dtype=args.dtype, prefix_cache_mb=0)
    worker = TransformersBackend.load(settings)
    kernel = worker.cache.decode_kernel
    assert kernel is not None, "the kernel is off or did not build"
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    seqs = {f"s{i:02d}": [rng.randrange(100, 40000) for _ in range(rng.randint(100, 200))]
            for i in range(args.rows)}
    names = list(seqs)
    for w in range(0, len(names), 8):
        worker.step(StepRequest(prefill=[NewSequence(s, seqs[s], greedy)
                                         for s in names[w:w + 8]], decode_seq_ids=names[:w]))
    for _ in range(40):
        worker.step(StepRequest(decode_seq_ids=names))
    times = {"torch": [], "kernel": []}
    for i in range(2 * args.steps):
        name = ("torch", "kernel")[i % 2]
        worker.cache.decode_kernel = kernel if name == "kernel" else None
        t = time.thread_time()
        worker.step(StepRequest(decode_seq_ids=names))
        times[name].append((time.thread_time() - t) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"decode step, {args.rows} rows, {args.dtype}, {args.threads[0]} thread(s), "
          f"{args.steps} steps each: torch {med['torch']:.0f} ms (min {min(times['torch']):.0f}),"
          f" kernel {med['kernel']:.0f} ms (min {min(times['kernel']):.0f}) CPU "
          f"({med['torch'] / med['kernel']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--lo", type=int, default=150)
    ap.add_argument("--hi", type=int, default=300)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--step", action="store_true", help="whole decode steps of the worker")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    if args.step:
        return step(args)
    dtype = getattr(torch, args.dtype)
    module = cpu_kernels.load()
    assert module is not None, "the kernel did not build"
    kernel = module.decode_attention
    slots = (768 << 10) // (2 * KV_HEADS * DIM * dtype.itemsize)    # as the model worker caps
    cache, seq_ids = make_cache(args.rows, args.lo, args.hi, 30, dtype, slots)
    n = len(seq_ids)
    q = torch.randn(1, n, HEADS, DIM, dtype=dtype).transpose(1, 2)
    k = torch.randn(1, n, KV_HEADS, DIM, dtype=dtype).transpose(1, 2)
    v = torch.randn(1, n, KV_HEADS, DIM, dtype=dtype).transpose(1, 2)
    # (Both paths write the same new keys into the same slots, so each call sees one state.)
    plan = cache.plan([(s, 1) for s in seq_ids])
    ref = attend_all(plan, 30, q, k, v, None)
    new = attend_all(plan, 30, q, k, v, kernel)
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, new))
    print(f"{n} rows, {args.lo}-{args.hi} tokens, {args.dtype}: max |kernel - torch| {diff:.2e}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for layers in (1, 30):
            ms = median_ms({"torch": lambda: attend_all(plan, layers, q, k, v, None),
                            "kernel": lambda: attend_all(plan, layers, q, k, v, kernel)},
                           args.rounds)
            (tw, tc), (kw, kc) = ms["torch"], ms["kernel"]
            print(f"threads {threads}, {layers:2d} layers: torch {tw:.2f} ms wall {tc:.2f} CPU, "
                  f"kernel {kw:.2f} ms wall {kc:.2f} CPU ({tw / kw:.2f}x wall)")


if __name__ == "__main__":
    main()
