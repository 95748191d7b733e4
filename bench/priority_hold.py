"""The priority hold (LLMQ_PRIORITY_HOLD_STEPS) over a cost model: the real scheduler, stepped
with a step cost instead of a model, so its effect is seen without a loaded machine's noise.

A step costs `decode_ms` when anything decodes, plus a prefill pass of k short prompts
`pass_ms + k * prompt_ms` for the batch lines joining and another for an interactive request.
Batch lines: `inflight` of them, `tokens` each, each refilled 1-3 steps after one ends (the
batch runner's lag); one interactive request of 8 tokens at a time, sent again a step after it
ends (bench/batch.py's probe loop). An interactive request arriving at a uniformly random
moment waits out the step in flight: its p50 is what the hold shortens.

    python -m bench.priority_hold --holds 1,2,4 --decode-ms 80 --pass-ms 40 --prompt-ms 3
"""
from __future__ import annotations

import argparse
import bisect
import itertools
import random
import statistics

from common.protocol import FinishReason, SamplingParams
from worker.sequence import Sequence
from worker.workload_manager import WorkloadManager


def _seq(ids, max_tokens: int, priority: int, prompt_len: int) -> Sequence:
    seq = Sequence(seq_id=f"s{next(ids)}", prompt_token_ids=list(range(100, 100 + prompt_len)),
                   params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    seq.priority = priority
    return seq


def simulate(hold: int, decode_ms: float, pass_ms: float, prompt_ms: float, steps: int = 3000,
             inflight: int = 32, tokens: int = 16, seed: int = 7) -> dict:
    clock_ms, ids, rnd = [0.0], itertools.count(), random.Random(seed)
    wm = WorkloadManager(64, 2048, priority_hold_steps=hold, priority_window_s=2.0,
                         clock=lambda: clock_ms[0] / 1000)
    due = sorted(rnd.randrange(tokens) for _ in range(inflight))   # steps lines arrive at
    costs, done, idle_steps = [], 0, 0
    for step in range(steps):
        while due and due[0] <= step:
            due.pop(0)
            wm.add(_seq(ids, tokens, 9, 5))
        if not any(s.priority == 0 for s in wm.running + list(wm.waiting)):
            idle_steps += 1
            if idle_steps > 1:   # the probe loop's status check between probes
                wm.add(_seq(ids, 8, 0, 6))
                idle_steps = 0
        out = wm.schedule()
        lines = sum(s.priority == 9 for s in out.prefill)
        cost = ((decode_ms if out.decode else 0.0)
                + (pass_ms + prompt_ms * lines if lines else 0.0)
                + (pass_ms + prompt_ms if len(out.prefill) > lines else 0.0))
        costs.append(cost)
        clock_ms[0] += cost
        for seq in wm.update(out, {s.seq_id: 7 for s in out.prefill + out.decode}):
            if seq.num_output_tokens >= seq.params.max_tokens:
                wm.abort(seq, FinishReason.LENGTH)
                if seq.priority == 9:
                    done += 1
                    bisect.insort(due, step + rnd.randint(1, 3))
    costs = costs[100:]   # past the start, once lines churn
    ends = list(itertools.accumulate(costs))
    waits = []
    for _ in range(20000):
        t = rnd.random() * ends[-1]
        waits.append(ends[bisect.bisect_right(ends, t)] - t)
    return {"hold": hold, "ms_per_step": statistics.mean(costs),
            "wait_p50_ms": statistics.median(waits),
            "lines_per_s": 1000 * done / sum(costs) * len(costs) / steps,
            "held_steps": wm.stats.num_held_steps, "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--holds", default="1,2,3,4,8")
    p.add_argument("--decode-ms", type=float, default=80.0)
    p.add_argument("--pass-ms", type=float, default=40.0)
    p.add_argument("--prompt-ms", type=float, default=3.0)
    p.add_argument("--idle-ttft-ms", type=float, default=74.0,
                   help="interactive TTFT on an idle queue, for the estimated ratio")
    args = p.parse_args()
    for hold in (int(h) for h in args.holds.split(",")):
        r = simulate(hold, args.decode_ms, args.pass_ms, args.prompt_ms)
        print(f"hold {hold}: step {r['ms_per_step']:.0f} ms, wait for the step in flight p50 "
              f"{r['wait_p50_ms']:.0f} ms ((idle TTFT + it) / idle TTFT = "
              f"{(args.idle_ttft_ms + r['wait_p50_ms']) / args.idle_ttft_ms:.2f}), "
              f"{r['lines_per_s']:.1f} lines/s, held {r['held_steps']} of "
              f"{r['steps']} steps")


if __name__ == "__main__":
    main()
