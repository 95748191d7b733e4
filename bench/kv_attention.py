"""Decode step time of the model worker with mixed lengths (`python -m bench.kv_attention`).

32 short sequences alone, then the same 32 beside one long prompt: the median time of a decode
step of the whole batch, in this process, default model (CPU: 2 threads, packed linears). Used
to choose the paged attention's layout; run it under an older checkout's PYTHONPATH to compare
(64 rows in bf16: `--short 64 --short-len 150 --dtype bfloat16 --threads 1`).

`--phase` replays bench/lengths.py's phase in this process instead: the workload manager (with
the LLMQ_LONG_PREFILL_* settings) stepping a model worker as the engine does, 32 short requests
(8-token prompts, 64 forced tokens) alone and beside one long prompt per `--long-len`, rounds
interleaved; it reports the short ones' p50 finish in process CPU seconds, which a shared
machine distorts less than wall time (use `--threads 1`).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from common.protocol import FinishReason, SamplingParams
from common.settings import Settings
from worker.messages import NewSequence, StepRequest
from worker.model.transformers.backend import TransformersBackend
from worker.sequence import Sequence
from worker.workload_manager import WorkloadManager


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


def phase_p50_cpu_s(worker, settings, long_len: int, ids, num_short: int = 32,
                    tokens: int = 64) -> float:
    """The lengths phase's short requests beside one long prompt (none for long_len 0),
    scheduled and stepped as the engine does: the p50 of their finish, in CPU seconds."""
    wm = WorkloadManager(max_num_seqs=64, max_num_batched_tokens=settings.max_num_batched_tokens,
                         long_prefill_tokens=settings.long_prefill_tokens,
                         long_prefill_chunk=settings.long_prefill_chunk,
                         attention_context=settings.prefill_attention_context)
    forced = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0,
                            ignore_eos=True)
    lengths = [8] * num_short + ([long_len] if long_len else [])
    for i, n in enumerate(lengths):
        wm.add(Sequence(seq_id=f"p{i}", prompt_token_ids=ids(n), params=forced,
                        eos_token_ids=(2,)))
    start, finished = time.process_time(), []
    while len(finished) < num_short:
        out = wm.schedule()
        res = worker.step(StepRequest(
            prefill=[NewSequence(s.seq_id, s.all_token_ids, s.params, s.num_output_tokens,
                                 s.stop_token_ids) for s in out.prefill],
            decode_seq_ids=[s.seq_id for s in out.decode], free_seq_ids=out.freed_seq_ids,
            chunks=out.prompt_chunks))
        for seq in wm.update(out, res.token_ids):
            if seq.num_output_tokens >= tokens:
                wm.abort(seq, FinishReason.LENGTH)
                finished.append(time.process_time() - start)
    worker.step(StepRequest(free_seq_ids=[f"p{i}" for i in range(len(lengths))]))
    return statistics.median(finished)


def phase(worker, settings, long_lens: list[int], rounds: int, ids) -> None:
    got: dict[int, list[float]] = {n: [] for n in [0] + long_lens}
    phase_p50_cpu_s(worker, settings, 0, ids)   # warm
    for r in range(rounds):
        for n in got:
            got[n].append(phase_p50_cpu_s(worker, settings, n, ids))
            print(f"round {r}: beside {n} tokens: short p50 {got[n][-1]:.2f} CPU s", flush=True)
    alone = statistics.median(got[0])
    for n in long_lens:
        print(f"beside {n}: short p50 {statistics.median(got[n]) / alone:.2f}x alone")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--short-len", type=int, default=40)
    ap.add_argument("--long-len", type=int, nargs="+", default=[3000])
    ap.add_argument("--phase", action="store_true", help="replay the lengths phase (above)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)   # 1 on a busy machine
    ap.add_argument("--dtype", default="float32", help="bfloat16: the default on AVX512-BF16/AMX")
    ap.add_argument("--group-padding", type=float, default=None,
                    help="paged cache only: max padding of a decode group (large: one group)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    settings = Settings.from_env().replace(device="cpu", dtype=args.dtype, prefix_cache_mb=0)
    worker = TransformersBackend.load(settings)
    if args.group_padding is not None:
        worker.cache.max_group_padding = args.group_padding
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(100, 40000) for _ in range(n)]   # noqa: E731
    if args.phase:
        return phase(worker, settings, args.long_len, args.rounds, ids)
    short = {f"s{i:02d}": ids(args.short_len) for i in range(args.short)}
    alone = decode_step_s(worker, short, args.steps)
    for n in args.long_len:
        mixed = decode_step_s(worker, {**short, "z-long": ids(n)}, args.steps)
        print(f"decode step: {args.short} x {args.short_len} tokens {alone * 1000:.0f} ms; "
              f"+ 1 x {n} {mixed * 1000:.0f} ms ({mixed / alone:.2f}x)")


if __name__ == "__main__":
    main()
