"""The raw limit: `model.generate` in this process on the same weights, no serving stack."""
from __future__ import annotations

import gc
import time


def short_prompts(n: int, offset: int = 0) -> list[str]:
    """Short, distinct raw prompts (the served phase uses the same ones)."""
    topics = ["a lighthouse", "the moon", "a small robot", "an old library", "a river",
              "a mountain village", "the ocean", "a clockmaker", "a desert", "a garden",
              "a train station", "a snowstorm", "a market", "a violin", "a comet", "a forest"]
    return [f"Write a short story about {topics[(offset + i) % len(topics)]} (number {offset + i})."
            for i in range(n)]


def _result(batch: int, new_tokens: int, got: int, dt: float, progress) -> dict:
    """One batch size's figures (tokens/s counts what was made when a time limit cut it)."""
    tps = batch * got / dt
    cut = got < new_tokens
    progress(f"raw: batch {batch:>3}: {batch * got} tokens in {dt:.1f} s -> {tps:.1f} tok/s"
             f"{f' (cut by the time limit after {got} of {new_tokens} steps)' if cut else ''}")
    return {"batch": batch, "new_tokens": new_tokens, "generated_tokens": got,
            "elapsed_s": round(dt, 3), "tokens_per_s": round(tps, 2), "cut": cut}


def run_raw(batches: list[int], new_tokens: int, device: str = "cpu", dtype: str = "float32",
            progress=print, time_limit_s: float | None = None) -> dict:
    """Greedy generate of exactly `new_tokens` tokens at each batch size; output tokens/s.
    time_limit_s bounds the whole phase: a batch that runs out of time stops early
    (generate's max_time) and its tokens/s counts the tokens it made."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.settings import Settings
    from worker.model_manager import ModelManager, pick_device, pick_dtype

    path = ModelManager(cache_dir=Settings.from_env().model_cache_dir).resolve()
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(dev).eval()
    progress(f"raw: loaded {path} on {dev} ({str(torch_dtype).replace('torch.', '')}, "
             f"{torch.get_num_threads()} threads) in {time.perf_counter() - t:.1f} s")

    def generate(batch: int, n: int, offset: int = 0, max_time: float | None = None):
        enc = tok(short_prompts(batch, offset), return_tensors="pt", padding=True).to(dev)
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, do_sample=False, min_new_tokens=n, max_new_tokens=n,
                                 pad_token_id=pad_id, max_time=max_time)
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        got = out.shape[1] - enc["input_ids"].shape[1]
        if got != n and (max_time is None or got > n):
            raise RuntimeError(f"generate made {got} tokens, not {n}")
        return dt, got

    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    results = []
    try:
        warm = min(8, new_tokens)
        dt, _ = generate(1, warm, offset=1000, max_time=time_limit_s and time_limit_s / 4)
        progress(f"raw: warm-up (batch 1, {warm} tokens) {dt:.1f} s")
        for i, b in enumerate(batches):
            limit = None
            if deadline is not None:
                # What is left, shared by this batch and the larger ones after it.
                limit = max(1.0, (deadline - time.monotonic()) / (len(batches) - i))
            dt, got = generate(b, new_tokens, max_time=limit)
            if b == 1 and got == new_tokens:
                # One 7 s run at batch 1 moves by 10-20% with the machine's mood: the median of
                # three. (The best of three held the served level, a mean over its requests,
                # to the machine's best moment: 0.89 in a run where served and raw agreed.)
                runs = [dt] + [generate(b, new_tokens, max_time=limit)[0] for _ in range(2)]
                dt = sorted(runs)[1]
            res = _result(b, new_tokens, got, dt, progress)
            if deadline is None or deadline > time.monotonic():
                # The reference for the served time to first token at concurrency b: how long
                # generate takes to give b prompts that arrive together their first tokens,
                # with no serving around it (median of three when the time limit allows).
                runs = [generate(b, 1)[0]]
                if deadline is None or deadline - time.monotonic() > 2.5 * runs[0]:
                    runs += [generate(b, 1)[0] for _ in range(2)]
                res["first_token_s"] = round(sorted(runs)[len(runs) // 2], 4)
                progress(f"raw: batch {b:>3}: first token of all {b} prompts in "
                         f"{res['first_token_s']:.3f} s")
            results.append(res)
    finally:
        info = {"model_path": path, "device": dev, "dtype": str(torch_dtype).replace("torch.", ""),
                "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__}
        model = None   # free the weights before the stack starts
        gc.collect()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    return {"info": info, "new_tokens": new_tokens, "results": results}


def _step_through(worker, seqs: list, new_tokens: int, limit_s: float | None = None
                  ) -> tuple[float, list[float]]:
    """Drives a model-worker backend through one batch as the engine would with nothing else
    to do: every prompt prefilled in one step (each gets its first token), then decode steps of
    all the rows until each has new_tokens (or limit_s has passed), then the free. Returns the
    prefill step's seconds and each decode step's."""
    from worker.messages import StepRequest

    ids = [s.seq_id for s in seqs]
    t0 = time.perf_counter()
    worker.step(StepRequest(prefill=seqs))
    prefill = time.perf_counter() - t0
    steps = []
    while 1 + len(steps) < new_tokens and (limit_s is None
                                           or time.perf_counter() - t0 < limit_s):
        t1 = time.perf_counter()
        worker.step(StepRequest(decode_seq_ids=ids))
        steps.append(time.perf_counter() - t1)
    worker.step(StepRequest(free_seq_ids=ids))
    return prefill, steps


def run_raw_backend(backend: str, batches: list[int], new_tokens: int, progress=print,
                    time_limit_s: float | None = None, max_num_seqs: int = 64) -> dict:
    """The raw limit of a non-transformers backend (llama.cpp has no `model.generate` over a
    batch): its own model-worker backend driven step by step in this process, greedy, exactly
    `new_tokens` per sequence: the same compute the served path asks of it, with no serving
    around it."""
    from transformers import AutoTokenizer

    from common.protocol import SamplingParams
    from common.settings import Settings
    from worker.model.backend import load_backend
    from worker.messages import NewSequence
    from worker.model_manager import ModelManager

    settings = Settings.from_env(backend=backend, model="smollm2",
                                 max_num_seqs=max(max_num_seqs, *batches))
    t = time.perf_counter()
    worker = load_backend(settings)
    worker.warm_up()
    tok = AutoTokenizer.from_pretrained(ModelManager.from_settings(settings).resolve())
    progress(f"raw: {backend} backend loaded ({worker.info.path}, {worker.info.dtype}) in "
             f"{time.perf_counter() - t:.1f} s")
    greedy = SamplingParams(temperature=0.0)
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    results = []
    try:
        for i, b in enumerate(batches):
            limit = None if deadline is None else max(
                1.0, (deadline - time.monotonic()) / (len(batches) - i))
            seqs = [NewSequence(f"raw{b}-{j}", tok(p)["input_ids"], greedy)
                    for j, p in enumerate(short_prompts(b))]
            first, steps = _step_through(worker, seqs, new_tokens, limit)
            got, dt = 1 + len(steps), first + sum(steps)
            results.append(dict(_result(b, new_tokens, got, dt, progress),
                                first_token_s=round(first, 4)))
    finally:
        info = {"backend": backend, "model_path": worker.info.path, "device": worker.info.device,
                "dtype": worker.info.dtype, "method": f"{backend} backend stepped in-process"}
        worker = None
        gc.collect()
    return {"info": info, "new_tokens": new_tokens, "results": results}


def model_alone(rounds: list[list[list[int]]], new_tokens: int, dtype: str, model: str,
                progress=print) -> dict:
    """The served load's ceiling on this machine: llmq's model worker (the transformers
    backend, as the worker loads it) stepped in this process on the same prompts, all
    prefilled in one step and then decoded together to exactly `new_tokens` each, with no
    serving around it (no API, Redis, Celery, engine or model-process boundary). The peers
    table's c=N closed loop is this, wave after wave, plus the stack; its figure over this one
    says how much of the machine the stack keeps. `rounds`: each round's prompts (token ids),
    distinct from the others' as the table's rounds are (the same prompts again would be read
    from the prefix cache); the best round is the figure (one that something else on the
    machine slowed says less about the ceiling than the quickest)."""
    import statistics

    import torch

    from common.protocol import SamplingParams
    from common.settings import Settings
    from worker.model.backend import load_backend
    from worker.messages import NewSequence

    rows = len(rounds[0])
    settings = Settings.from_env(backend="transformers", model=model, dtype=dtype,
                                 max_num_seqs=rows)
    if settings.torch_threads > 0:   # as the model process sets them
        torch.set_num_threads(settings.torch_threads)
    t = time.perf_counter()
    worker = load_backend(settings)
    worker.warm_up()
    progress(f"model alone: {worker.info.dtype} model worker loaded in "
             f"{time.perf_counter() - t:.1f} s")
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    best = None
    try:
        for r, prompt_ids in enumerate(rounds):
            seqs = [NewSequence(f"alone{r}-{j}", list(ids), greedy)
                    for j, ids in enumerate(prompt_ids)]
            prefill, steps = _step_through(worker, seqs, new_tokens)
            total = prefill + sum(steps)
            run = {"rows": rows, "new_tokens": new_tokens,
                   "prompt_tokens": round(sum(map(len, prompt_ids)) / rows, 1),
                   "prefill_s": round(prefill, 4), "elapsed_s": round(total, 4),
                   "decode_step_p50_s": round(statistics.median(steps), 5) if steps else None,
                   "tokens_per_s": round(rows * new_tokens / total, 2),
                   # The decode steps alone (what a batch that never changes would run at).
                   "decode_tokens_per_s": (round(rows / statistics.median(steps), 2)
                                           if steps else None)}
            progress(f"model alone: round {r + 1}: {rows} x {run['prompt_tokens']:.0f}-token "
                     f"prompts prefilled in {prefill:.2f} s, then {new_tokens - 1} decode steps "
                     f"(p50 {1000 * (run['decode_step_p50_s'] or 0):.1f} ms): "
                     f"{run['tokens_per_s']:.1f} tok/s")
            if best is None or run["tokens_per_s"] > best["tokens_per_s"]:
                best = run
    finally:
        dtype_name = worker.info.dtype
        worker = None
        gc.collect()
    return {**best, "dtype": dtype_name, "rounds": len(rounds)}
