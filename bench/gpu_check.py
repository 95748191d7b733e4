"""`make gpu-check` / `python -m bench.gpu_check [--device cuda] [--quick]`: the rehearsed
check of llmq's model process on a GPU, in a few minutes, with no model download.

A model with SmolLM2-135M's exact config (bench/configs/smollm2-135m.json) and seeded random
weights (a 4-layer cut of it with --quick) runs through the engine's step protocol in this
process (InProcessExecutor over a TransformersBackend, the device's served defaults), fed
token ids (no tokenizer). It prints, and writes as JSON:
  agreement   the device's greedy tokens on fixed prompts against a CPU reference of the same
              weights (transformers' own forward, float32, one prompt at a time): float32 on
              the device must agree, up to near-ties; the served dtype (bfloat16 on a GPU) is
              reported
  throughput  the served engine at batch 1/16/64/256 (1/8 with --quick), greedy, and the
              largest again with temperature 1 and top-p 0.9 (the sampler): prefill and decode
              tokens/s, and per decode step its wall time, the host's time in the forward
              (on a GPU: launching it), in sampling (on a GPU: waiting for the pass), the
              device's busy time and kernel count (torch's profiler, GPU only) and the host
              time the device spent idle
  memory      peak device memory (torch.cuda.max_memory_allocated) and the KV cache's size
scripts/gpu_check.sh installs what a bare GPU machine lacks from `.gpu-wheels/` first. Exits
non-zero when float32 disagrees or a section failed.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import random
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "bench" / "configs" / "smollm2-135m.json"
# The random weights' attention and MLP projections scaled up, so that the layers, not the
# tied embedding of the last token, decide the next token: greedy tokens then depend on the
# whole context (tests/worker/factories.py's `sharpened`, for the same reason).
SHARPEN = 4.0
# A divergence where the reference's two best logits are closer than this is a near-tie: the
# device's different summation order may pick either (float32).
TIE = 1e-3
BUDGET_S = 420.0   # the throughput batches left when this much time has passed are skipped


def load_config(path: Path, quick: bool):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**json.loads(path.read_text()))
    if quick:
        cfg.num_hidden_layers = 4
    return cfg


def build_model(cfg, seed: int):
    """The model on CPU in float32, seeded random weights, sharpened."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                           "up_proj", "down_proj"):
                p.mul_(SHARPEN)
    return model


def prompts(n: int, vocab: int, seed: int, lengths=(5, 60)) -> list[list[int]]:
    """n fixed prompts of random ids past the special tokens, of lengths spread over `lengths`."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randrange(*lengths))]
            for _ in range(n)]


def reference(model, prompts_: list[list[int]], n: int) -> list[dict]:
    """Greedy tokens of each prompt alone by transformers' own forward with its KV cache, and
    the margin between the two best logits at each token."""
    import torch

    out = []
    with torch.inference_mode():
        for p in prompts_:
            ids, past, toks, margins = torch.tensor([p]), None, [], []
            for _ in range(n):
                o = model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past,
                          use_cache=True)
                past = o.past_key_values
                top = o.logits[0, -1].float().topk(2)
                toks.append(int(top.indices[0]))
                margins.append(float(top.values[0] - top.values[1]))
                ids = torch.cat([ids, top.indices[:1][None]], dim=1)
            out.append({"tokens": toks, "margins": margins})
    return out


def model_info(cfg, device: str, dtype, name: str = "smollm2-135m-random"):
    from worker.model_manager import ModelInfo

    return ModelInfo(name=name, path=str(CONFIG), eos_token_ids=(cfg.eos_token_id,),
                     max_model_len=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
                     device=device, dtype=str(dtype).replace("torch.", ""),
                     generation_defaults={"temperature": 0.0})


def make_backend(model, cfg, device: str, dtype, settings, max_num_seqs: int, kv_bytes: int,
                 cpu_kernels: bool):
    """A TransformersBackend over a copy of `model` on `device` in `dtype`, with the device's
    served settings (kv_bytes 0: sized as served, from the free memory)."""
    from worker.model.transformers.backend import TransformersBackend

    m = copy.deepcopy(model).to(device=device, dtype=dtype)
    return TransformersBackend(m, model_info(cfg, device, dtype), max_num_seqs,
                               kv_cache_bytes=kv_bytes,
                               prefill_chunk=settings.max_num_batched_tokens,
                               decode_kernel=cpu_kernels, layer_kernels=cpu_kernels,
                               prefill_pass_tokens=settings.prefill_pass_tokens)


def start(backend):
    """The engine's in-process executor over `backend`, started (warmed up)."""
    from worker.inprocess_executor import InProcessExecutor

    executor = InProcessExecutor(backend_factory=lambda: backend)
    executor.start()
    return executor


def run_step(executor, req):
    """One step through the executor: its partial results and the rest, merged."""
    executor.submit(req)
    tokens, errors = {}, {}
    while True:
        res = executor.wait()
        tokens.update(res.token_ids)
        errors.update(res.errors)
        if not res.partial:
            break
    if errors:
        raise RuntimeError(f"step errors: {errors}")
    return tokens


def generate(executor, prompts_: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens of every prompt, all in one batch: prefilled together, then decoded."""
    from common.protocol import SamplingParams
    from worker.messages import NewSequence, StepRequest

    greedy = SamplingParams(temperature=0.0)
    ids = [f"a{i}" for i in range(len(prompts_))]
    out = {sid: [] for sid in ids}
    first = run_step(executor, StepRequest(prefill=[NewSequence(sid, p, greedy)
                                                    for sid, p in zip(ids, prompts_)]))
    for sid, t in first.items():
        out[sid].append(t)
    for _ in range(n - 1):
        for sid, t in run_step(executor, StepRequest(decode_seq_ids=ids)).items():
            out[sid].append(t)
    run_step(executor, StepRequest(free_seq_ids=ids))
    return [out[sid] for sid in ids]


def compare(ref: list[dict], got: list[list[int]]) -> dict:
    """How far each prompt's tokens agree with the reference: whole, or up to a divergence at
    a near-tie (the reference's margin under TIE), or not."""
    whole = ties = 0
    first_diff = []
    for r, g in zip(ref, got):
        at = next((i for i, (a, b) in enumerate(zip(r["tokens"], g)) if a != b), None)
        if at is None:
            whole += 1
        elif r["margins"][at] < TIE:
            ties += 1
        first_diff.append(at)
    # (how many different tokens the reference walks through: a model that repeats one token
    # would agree whatever its attention did)
    return {"prompts": len(ref), "whole": whole, "tie_diverged": ties,
            "distinct_tokens_mean": sum(len(set(r["tokens"])) for r in ref) / max(1, len(ref)),
            "diverged": len(ref) - whole - ties, "first_divergence": first_diff,
            "common_prefix_mean": sum(len(r["tokens"]) if a is None else a
                                      for r, a in zip(ref, first_diff)) / max(1, len(ref))}


class StepTimer:
    """Times a backend's forward passes and sampling on the host (wraps its methods)."""

    def __init__(self, backend):
        self.spent = {"forward": 0.0, "sample": 0.0}
        backend._forward = self._timed("forward", backend._forward)
        backend.sampler.sample = self._timed("sample", backend.sampler.sample)

    def _timed(self, name: str, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.spent[name] += time.perf_counter() - t
        return timed

    def reset(self) -> None:
        self.spent = dict.fromkeys(self.spent, 0.0)


def device_busy(executor, req, steps: int) -> tuple[float, float]:
    """(device busy seconds, kernels) per step over `steps` decode steps, by torch's profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_step(executor, req)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    if kernels:
        busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    else:   # (a profiler that files kernels under their ops only)
        busy_us = sum(e.self_device_time_total for e in prof.key_averages())
    return busy_us / 1e6 / steps, len(kernels) / steps


def throughput(executor, timer, batch: int, prompt_len: int, steps: int, vocab: int,
               cuda: bool, sampled: bool = False) -> dict:
    """The served engine at `batch` sequences: one prefill step, then `steps` timed decode
    steps (after two untimed); greedy, or `sampled` (temperature 1, top-p 0.9)."""
    from common.protocol import SamplingParams
    from worker.messages import NewSequence, StepRequest

    params = (SamplingParams(temperature=1.0, top_p=0.9) if sampled
              else SamplingParams(temperature=0.0))
    ids = [f"b{batch}{'s' if sampled else ''}-{i}" for i in range(batch)]
    seqs = [NewSequence(sid, p, params)
            for sid, p in zip(ids, prompts(batch, vocab, batch, (prompt_len, prompt_len + 1)))]
    sync = _sync(cuda)
    t = time.perf_counter()
    run_step(executor, StepRequest(prefill=seqs))
    prefill_s = time.perf_counter() - t
    decode = StepRequest(decode_seq_ids=ids)
    for _ in range(2):
        run_step(executor, decode)
    sync()
    timer.reset()
    t = time.perf_counter()
    for _ in range(steps):
        run_step(executor, decode)
    sync()
    step_s = (time.perf_counter() - t) / steps
    row = {"batch": batch, "mode": "top-p" if sampled else "greedy", "prefill_tok_s": batch * prompt_len / prefill_s,
           "decode_tok_s": batch / step_s, "step_ms": step_s * 1e3,
           "forward_ms": timer.spent["forward"] / steps * 1e3,
           "sample_ms": timer.spent["sample"] / steps * 1e3}
    if cuda:
        try:
            busy, kernels = device_busy(executor, decode, 3)
            row.update(device_busy_ms=busy * 1e3, kernels_per_step=kernels,
                       device_idle_ms=max(0.0, step_s - busy) * 1e3)
        except Exception as exc:  # noqa: BLE001 - the profiler's figures are a bonus
            row["profiler_error"] = f"{type(exc).__name__}: {exc}"
    else:
        # On a CPU the forward is the model's time; the rest of the step is the host's.
        row["host_ms"] = row["step_ms"] - row["forward_ms"]
    run_step(executor, StepRequest(free_seq_ids=ids))
    return row


def _sync(cuda: bool):
    import torch

    return torch.cuda.synchronize if cuda else (lambda: None)


COLUMNS = (("batch", "batch", "{:d}"), ("mode", "mode", "{}"), ("prefill_tok_s", "prefill tok/s", "{:,.0f}"),
           ("decode_tok_s", "decode tok/s", "{:,.0f}"), ("step_ms", "step ms", "{:.2f}"),
           ("forward_ms", "fwd host ms", "{:.2f}"), ("sample_ms", "sample ms", "{:.2f}"),
           ("host_ms", "host ms", "{:.2f}"), ("device_busy_ms", "device ms", "{:.2f}"),
           ("device_idle_ms", "idle ms", "{:.2f}"), ("kernels_per_step", "kernels", "{:,.0f}"))


def format_table(rows: list[dict], columns=COLUMNS) -> str:
    """The rows as an aligned text table of the columns any row has ("-" where one lacks it)."""
    cols = [c for c in columns if any(c[0] in r for r in rows)]
    cells = [[title for _k, title, _f in cols]]
    for r in rows:
        cells.append([fmt.format(r[k]) if r.get(k) is not None else "-" for k, _t, fmt in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def format_agreement(agreement: dict) -> str:
    lines = []
    for name, a in agreement.items():
        if "error" in a:
            lines.append(f"{name:>9}: error {a['error']}")
            continue
        lines.append(f"{name:>9}: {a['whole']}/{a['prompts']} prompts agree whole, "
                     f"{a['tie_diverged']} part at a near-tie, {a['diverged']} diverge "
                     f"(common prefix {a['common_prefix_mean']:.1f} of {a['tokens']} tokens, "
                     f"{a['distinct_tokens_mean']:.1f} distinct)"
                     + ("" if a.get("strict") is False else "  [must agree]"))
    return "\n".join(lines)


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.json" if out else ROOT / "bench" / "results" / "gpu_check.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    ap.add_argument("--quick", action="store_true", help="a 4-layer model, batches 1 and 8")
    ap.add_argument("--out", type=Path, default=None, help="JSON result ($OUT/gpu_check.json)")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes")
    ap.add_argument("--dtype", default="auto",
                    help="the served dtype (auto: the device's, bfloat16 on a GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-kernels", action="store_true",
                    help="on a CPU device, the C++ kernels (built on first use, minutes)")
    args = ap.parse_args(argv)
    t_start = time.monotonic()

    import torch
    import transformers

    from common.settings import Settings
    from worker.model_manager import pick_device, pick_dtype

    device = pick_device(args.device)
    cuda = device.startswith("cuda")
    settings = Settings().for_device(device)
    served_dtype = pick_dtype(args.dtype, device)
    batches = ([int(b) for b in args.batches.split(",")] if args.batches
               else [1, 8] if args.quick else [1, 16, 64, 256])
    n_tokens, n_prompts = (8, 4) if args.quick else (24, 8)
    prompt_len, steps = (32, 4) if args.quick else (128, 16)
    out = args.out or default_out()
    result = {"device": device, "quick": args.quick, "torch": torch.__version__,
              "transformers": transformers.__version__, "python": platform.python_version(),
              "served_dtype": str(served_dtype).replace("torch.", ""),
              "settings": {k: getattr(settings, k) for k in (
                  "max_num_seqs", "max_num_batched_tokens", "long_prefill_chunk",
                  "prefill_pass_tokens")},
              "agreement": {}, "throughput": [], "errors": []}
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(device)

    def save() -> None:
        result["elapsed_s"] = round(time.monotonic() - t_start, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))

    def section(name: str, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - one section's failure leaves the others
            traceback.print_exc()
            result["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            return None
        finally:
            save()

    cfg = load_config(args.config, args.quick)
    model = build_model(cfg, args.seed)
    result["model"] = {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                       "vocab": cfg.vocab_size,
                       "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
    print(f"gpu_check: {device}{' (' + result['gpu'] + ')' if cuda else ''}, torch "
          f"{torch.__version__}, transformers {transformers.__version__}, model "
          f"{result['model']['params_m']}M params, {cfg.num_hidden_layers} layers", flush=True)

    fixed = prompts(n_prompts, cfg.vocab_size, args.seed + 1)
    ref = reference(model, fixed, n_tokens)
    kernels = args.cpu_kernels and not cuda
    agreement_dtypes = [torch.float32] + ([served_dtype] if served_dtype != torch.float32 else [])
    for dtype in agreement_dtypes:
        name = str(dtype).replace("torch.", "")

        def agree(dtype=dtype):
            ex = start(make_backend(model, cfg, device, dtype, settings, n_prompts,
                                    kv_bytes(model, dtype, n_prompts, 60 + n_tokens), kernels))
            got = generate(ex, fixed, n_tokens)
            ex.stop()
            return {**compare(ref, got), "tokens": n_tokens, "strict": dtype == torch.float32}

        a = section(f"agreement {name}", agree)
        result["agreement"][name] = a if a is not None else {"error": result["errors"][-1]}
    print("agreement with the CPU reference (float32, one prompt at a time):")
    print(format_agreement(result["agreement"]), flush=True)

    def served():
        gc.collect()   # (the agreement's backends: their hooks tie them to their models)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        # (on a CPU, a cache for the batches alone: the served auto size would be most of RAM)
        kv = 0 if cuda else kv_bytes(model, served_dtype, max(batches), prompt_len + steps)
        backend = make_backend(model, cfg, device, served_dtype, settings,
                               max(max(batches), settings.max_num_seqs) if cuda
                               else max(batches), kv, kernels)
        result["kv_cache_mib"] = round(backend.cache.num_blocks * backend.cache.block_size
                                       * _kv_bytes_per_token(backend) / 2**20)
        ex = start(backend)
        timer = StepTimer(backend)
        # Each batch greedy, then the largest sampled (the sampler's batched draw).
        for b, sampled in [(b, False) for b in batches] + [(max(batches), True)]:
            name = f"batch {b}{' sampled' if sampled else ''}"
            if time.monotonic() - t_start > BUDGET_S:
                result["errors"].append(f"{name}: skipped, over the {BUDGET_S:.0f} s budget")
                continue
            row = section(name, lambda b=b, sampled=sampled: throughput(
                ex, timer, b, prompt_len, steps, cfg.vocab_size, cuda, sampled))
            if row is not None:
                result["throughput"].append(row)
                print(format_table([row]).splitlines()[-1] if len(result["throughput"]) > 1
                      else format_table([row]), flush=True)
        ex.stop()
        if cuda:
            result["peak_memory_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20)

    section("served", served)
    print(f"served engine ({result['served_dtype']}, max_num_seqs "
          f"{result['settings']['max_num_seqs']}, KV cache {result.get('kv_cache_mib', '?')} MiB,"
          f" peak device memory {result.get('peak_memory_mib', 'n/a')} MiB):")
    print(format_table(result["throughput"]))
    strict = [a for a in result["agreement"].values() if a.get("strict")]
    result["ok"] = (not result["errors"] and bool(strict)
                    and all(a["diverged"] == 0 for a in strict))
    save()
    for e in result["errors"]:
        print(f"error: {e}", file=sys.stderr)
    print(f"gpu_check: {'ok' if result['ok'] else 'FAILED'} in {result['elapsed_s']} s; "
          f"{out}", flush=True)
    return 0 if result["ok"] else 1


def kv_bytes(model, dtype, rows: int, tokens: int) -> int:
    """A KV cache that holds `rows` sequences of `tokens` (whole 8-token blocks, and one more
    block each, as the cache rounds them)."""
    from worker.model.transformers.backend import kv_bytes_per_token

    return rows * (-(-tokens // 8) + 1) * 8 * kv_bytes_per_token(model, dtype)


def _kv_bytes_per_token(backend) -> int:
    from worker.model.transformers.backend import kv_bytes_per_token

    return kv_bytes_per_token(backend.model, backend.kv_dtype)


if __name__ == "__main__":
    sys.exit(main())
