"""Issue 3's evaluation: transformers' own continuous-batching engine against llmq's model
worker, in one process, same model, same workload (N sequences x T forced new tokens, greedy).

    python -m bench.compare_hf_cb [--seqs 1,64] [--tokens 64]
"""
from __future__ import annotations

import argparse
import json
import time


def run_hf(model, prompts: list[list[int]], tokens: int) -> float:
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    try:
        # warm-up
        manager.add_request(prompts[0], request_id="warm", max_new_tokens=4)
        manager.get_result(request_id="warm", timeout=120)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=tokens)
        produced = 0
        for i in range(len(prompts)):
            out = manager.get_result(request_id=f"r{i}", timeout=600)
            produced += len(out.generated_tokens)
        return produced / (time.perf_counter() - t0)
    finally:
        manager.stop(block=True)


def run_llmq(model, info, prompts: list[list[int]], tokens: int) -> float:
    from common.protocol import SamplingParams
    from worker.messages import NewSequence, StepRequest
    from worker.model.transformers.backend import TransformersBackend

    worker = TransformersBackend(model, info, max_num_seqs=max(64, len(prompts)))
    worker.warm_up()
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    t0 = time.perf_counter()
    seqs = [NewSequence(f"r{i}", p, params) for i, p in enumerate(prompts)]
    worker.step(StepRequest(prefill=seqs))
    ids = [s.seq_id for s in seqs]
    for _ in range(tokens - 1):
        worker.step(StepRequest(decode_seq_ids=ids))
    dt = time.perf_counter() - t0
    worker.step(StepRequest(free_seq_ids=ids))
    return len(prompts) * tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1,64")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from worker.model_manager import ModelManager

    mm = ModelManager()
    model, info = mm.load_model("cpu", "float32")
    tok = mm.load_tokenizer()
    results = []
    for n in [int(x) for x in args.seqs.split(",")]:
        prompts = [tok(f"Write a short story about a robot number {i} who")["input_ids"]
                   for i in range(n)]
        row = {"seqs": n, "tokens": args.tokens}
        row["llmq_tok_s"] = round(run_llmq(model, info, prompts, args.tokens), 1)
        print(json.dumps(row), flush=True)
        try:
            row["hf_cb_tok_s"] = round(run_hf(model, prompts, args.tokens), 1)
        except Exception as exc:  # noqa: BLE001 - report, do not hide, a failing engine
            row["hf_cb_error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(row), flush=True)
        results.append(row)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
