"""The peers table's c=64 wave in one process, no serving stack (`python -m bench.wave`).

64 prompts of 40 tokens, 64 greedy tokens each, stepped through a TransformersBackend as the scheduler
splits them under the default token budget (51 prompts, then 13 beside 51 decodes, then decode
steps until all are done), on the model worker the worker process builds (`TransformersBackend.load`:
LLMQ_* settings, packed linears), on the CPU in fp32, with this machine's threads.
Prints each wave's time, its parts and its output tok/s as a fraction of the compute limit
(bench/efficiency.py's probe at batch 64): the ceiling the served figure is measured against.
Figures and conclusions: issue 17's notes.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from bench import efficiency
from common.protocol import SamplingParams
from common.settings import Settings
from worker.messages import NewSequence, StepRequest
from worker.model_manager import ModelManager
from worker.model.transformers.backend import TransformersBackend


def wave(worker: TransformersBackend, prompts: list[list[int]], tokens: int, first: int) -> dict:
    """One wave: `first` prompts, then the rest beside their decodes, then decode steps;
    every sequence freed once it has `tokens`. Returns its times and token count."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    seqs = [NewSequence(f"s{i}", p, params) for i, p in enumerate(prompts)]
    out: dict[str, int] = {}
    running: list[str] = []
    t0 = time.perf_counter()
    marks, steps = [], 0
    for new in (seqs[:first], seqs[first:]):
        res = worker.step(StepRequest(prefill=new, decode_seq_ids=list(running)))
        for sid in res.token_ids:
            out[sid] = out.get(sid, 0) + 1
        running += [s.seq_id for s in new]
        marks.append(time.perf_counter())
    while running:
        done = [sid for sid in running if out[sid] >= tokens]
        running = [sid for sid in running if sid not in done]
        res = worker.step(StepRequest(decode_seq_ids=list(running), free_seq_ids=done))
        for sid in res.token_ids:
            out[sid] += 1
        steps += 1
    end = time.perf_counter()
    return {"s": end - t0, "prefill_s": marks[0] - t0, "second_s": marks[1] - marks[0],
            "decode_s": end - marks[1], "decode_steps": steps - 1,
            "tokens": sum(min(n, tokens) for n in out.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    settings = Settings.from_env(device="cpu", dtype="float32", max_num_seqs=args.prompts)
    model_dir = ModelManager.from_settings(settings).resolve()
    eff = efficiency.measure(model_dir, [args.prompts], progress=lambda *_: None)
    _, rate = efficiency.rate_for(eff, "float32", args.prompts)
    info = efficiency.cpu_info()
    print(f"CPU: {info.get('model')}; flags: {' '.join(info.get('flags', []))}; "
          f"{torch.get_num_threads()} threads; float32 at batch {args.prompts}: {rate} GFLOP/s")
    worker = TransformersBackend.load(settings)   # every wave frees all it ran: one worker serves all
    vocab = worker.model.config.vocab_size
    first = min(args.prompts, settings.max_num_batched_tokens // args.prompt_tokens)
    for n in range(args.waves):
        rng = random.Random(n)
        prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
                   for _ in range(args.prompts)]
        w = wave(worker, prompts, args.tokens, first)
        tps = w["tokens"] / w["s"]
        frac = tps * eff["flops_per_token"] / (rate * 1e9) if rate else float("nan")
        print(f"wave {n}: {w['s']:.2f} s (prefill {first}: {w['prefill_s']:.2f} s, the rest "
              f"beside their decodes: {w['second_s']:.2f} s, {w['decode_steps']} decode steps: "
              f"{w['decode_s']:.2f} s) {tps:.1f} tok/s = {frac:.3f} of the compute limit")


if __name__ == "__main__":
    main()
