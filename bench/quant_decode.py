"""Batch-1 decode of the model worker alone, per LLMQ_QUANTIZATION (`python -m bench.quant_decode`).

One model worker per mode (default model, CPU, the default dtype), loaded side by side in this
process; each round decodes one sequence (a short chat prompt) for `tokens` tokens in every
worker in turn, so a busy neighbour slows them alike. Prints per round and mode the wall and
process CPU milliseconds per token, then the medians over the rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time

MODES = ("none", "int8", "int4")


def decode_ms(worker, prompt: list[int], tokens: int, sid: str) -> tuple[float, float]:
    """(wall, process CPU) ms per decode step of one sequence, `tokens` steps after its prefill."""
    from common.protocol import SamplingParams
    from worker.messages import NewSequence, StepRequest

    worker.step(StepRequest(prefill=[NewSequence(sid, list(prompt),
                                                 SamplingParams(temperature=0.0))]))
    t, c = time.perf_counter(), time.process_time()
    for _ in range(tokens):
        worker.step(StepRequest(decode_seq_ids=[sid]))
    wall, cpu = (time.perf_counter() - t) * 1e3 / tokens, (time.process_time() - c) * 1e3 / tokens
    worker.step(StepRequest(free_seq_ids=[sid]))
    return wall, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args()
    import torch

    from common.settings import Settings
    from worker.model.transformers.backend import TransformersBackend
    from worker.model_manager import ModelManager

    base = Settings.from_env().replace(device="cpu", max_num_seqs=1, prefix_cache_mb=0,
                                       kv_cache_mb=64)
    if base.torch_threads > 0:
        torch.set_num_threads(base.torch_threads)
    tok = ModelManager.from_settings(base).load_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    modes = args.modes.split(",")
    workers = {m: TransformersBackend.load(base.replace(quantization=m)) for m in modes}
    for m, w in workers.items():
        decode_ms(w, prompt, 4, "warm")
        print(f"{m}: {w.info.kernels}, threads {torch.get_num_threads()}", flush=True)
    runs: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m, w in workers.items():
            runs[m].append(decode_ms(w, prompt, args.tokens, f"r{r}"))
            print(f"round {r}: {m}: {runs[m][-1][0]:.1f} ms/token wall, "
                  f"{runs[m][-1][1]:.1f} ms CPU", flush=True)
    for m, rs in runs.items():
        wall, cpu = (statistics.median(x) for x in zip(*rs))
        print(f"median {m}: {wall:.1f} ms/token wall ({1e3 / wall:.1f} tok/s), {cpu:.1f} ms CPU")


if __name__ == "__main__":
    main()
