"""This machine's own compute limit, and the fraction of it a served rate reaches (issue 17).

At start-up the bench times matmuls at the model's decode shapes (batch x hidden x out of
each layer's q, k, v, o, gate, up and down, and the lm_head), in fp32 and bf16, with torch's
F.linear and with the oneDNN prepacked linear the model worker uses (the faster is the rate),
with as many distinct weights as the model has, so that a batch-1 step reads all of them as
decode does. One token costs 2 FLOPs per weight of those matmuls (about 0.27 GFLOP for
SmolLM2-135M; attention over a ~100-token context adds ~3% and is left out). Served tok/s x FLOPs per token / the rate
measured at the level's batch is then the fraction of the compute limit reached: a figure that
compares across machines, where an absolute tok/s moves by 3x between CPUs.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

# The flags that decide which kernels a CPU runs (printed with every benchmark).
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
DTYPES = ("float32", "bfloat16")


def cpu_info(path: str = "/proc/cpuinfo") -> dict:
    """The CPU's model name and which of CPU_FLAGS it reports."""
    model, flags = "unknown", set()
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags]}


def linear_shapes(config: dict) -> list[tuple[int, int]]:
    """(in, out) of every matmul weight a token goes through, from a Llama-style config."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    layer = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    return layer * config["num_hidden_layers"] + [(h, config["vocab_size"])]


def flops_per_token(shapes: list[tuple[int, int]]) -> int:
    """2 FLOPs (a multiply and an add) per weight per token."""
    return 2 * sum(i * o for i, o in shapes)


def fraction_of_limit(tokens_per_s: float | None, flops_token: float,
                      rate_gflops: float | None) -> float | None:
    """Served tok/s x FLOPs per token / the measured matmul rate."""
    if tokens_per_s is None or not rate_gflops:
        return None
    return round(tokens_per_s * flops_token / (rate_gflops * 1e9), 4)


def measure_rates(shapes: list[tuple[int, int]], batches: list[int], dtypes=DTYPES,
                  min_time_s: float = 1.0, warm_up_s: float = 0.5,
                  kernels: dict | None = None) -> dict[str, dict[str, float]]:
    """GFLOP/s of one decode step's matmuls (its fastest of at least 3, and of min_time_s,
    after warm_up_s of untimed steps), {dtype: {str(batch): rate}}. On a VM a probe of a few
    tenths of a second read 220 GFLOP/s where the same probe alone read 316-478: the clock and
    the caches need a moment, so each shape is warmed before it is timed.

    Two kernels are timed and the faster is the rate: torch's F.linear, and the oneDNN
    prepacked linear llmq's model worker uses (worker/model/transformers/packed_linear.py), which on an AVX2 EPYC
    ran batch 64 at 94-105 GFLOP/s where F.linear ran 68: a limit read off the slower kernel
    would credit a server for beating it. `kernels`, when given, receives each rate's
    {dtype: {batch: {kernel: rate}}}."""
    import torch
    import torch.nn.functional as F

    weights = [torch.randn(o, i) * 0.02 for i, o in shapes]
    flops_step = flops_per_token(shapes)
    rates: dict[str, dict[str, float]] = {}
    for name in dtypes:
        dt = getattr(torch, name)
        weights = [w.to(dt) for w in weights]   # the previous dtype's copies are freed
        candidates = {"torch": lambda x, w: F.linear(x, w)}
        packed = _packed(weights)
        if packed is not None:
            candidates["prepacked"] = lambda x, w: packed[id(w)](x)
        rates[name] = {}
        for batch in sorted(set(batches)):
            xs = {i: torch.randn(batch, i, dtype=dt) for i in {i for i, _ in shapes}}
            found = {}
            for kernel, linear in candidates.items():
                def step():
                    for w in weights:   # each output dropped at once, as a forward pass does
                        linear(xs[w.shape[1]], w)

                best = _fastest(step, min_time_s, warm_up_s)
                # 4 significant figures, not 3 decimals: a tiny shape (the tests') reads well
                # under 0.001 GFLOP/s, which rounding to decimals made 0.
                found[kernel] = float(f"{flops_step * batch / best / 1e9:.4g}")
            rates[name][str(batch)] = max(found.values())
            if kernels is not None:
                kernels.setdefault(name, {})[str(batch)] = found
        del packed
    del weights
    return rates


def _packed(weights) -> dict | None:
    """{id(weight): a PackedLinear of it}, or None where this torch cannot pack (no oneDNN, a
    dtype it does not take, a result that differs: pack_linears checks)."""
    from torch import nn

    from worker.model.transformers.packed_linear import pack_linears

    holder = nn.ModuleList()
    for w in weights:
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
        lin.weight = nn.Parameter(w, requires_grad=False)
        holder.append(lin)
    try:
        if pack_linears(holder) != len(weights):
            return None
    except Exception:  # noqa: BLE001 - the probe goes on with F.linear alone
        return None
    return {id(w): m for w, m in zip(weights, holder)}


def _fastest(step, min_time_s: float, warm_up_s: float) -> float:
    """The fastest of at least 3 timed steps and min_time_s, after warm_up_s of untimed ones:
    the limit is what the machine can do, and a step that other processes slowed says less
    about that than the quickest one."""
    import torch

    with torch.inference_mode():
        # Warm-up: kernel selection, first touch of the weights, the clock's ramp.
        t0 = time.perf_counter()
        step()
        while time.perf_counter() - t0 < warm_up_s:
            step()
        times, t0 = [], time.perf_counter()
        while len(times) < 3 or time.perf_counter() - t0 < min_time_s:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    return min(times)


def measure(model_dir: str, batches: list[int], progress=print) -> dict:
    """The efficiency block of a result: FLOPs per token, the CPU, the measured rates."""
    import torch

    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = linear_shapes(config)
    t = time.perf_counter()
    kernels: dict = {}
    rates = measure_rates(shapes, batches, kernels=kernels)
    out = {"flops_per_token": flops_per_token(shapes), "threads": torch.get_num_threads(),
           "cpu": cpu_info(), "rates_gflops": rates, "kernels": kernels,
           "measure_s": round(time.perf_counter() - t, 1)}
    for line in format_rates(out):
        progress(line)
    return out


def merge_probe(eff: dict, again: dict) -> dict:
    """eff with a second probe's rates (taken at the end of the run) folded in: each rate is
    the higher of the two, so that a probe slowed by something else on the machine does not
    lower the limit and inflate every fraction; both probes are kept under "probes"."""
    first = eff.get("probes") or [eff["rates_gflops"]]
    rates: dict[str, dict[str, float]] = {}
    for probe in first + [again["rates_gflops"]]:
        for name, by_batch in probe.items():
            for b, r in by_batch.items():
                rates.setdefault(name, {})[b] = max(r, rates.get(name, {}).get(b, 0.0))
    # Each kernel's rate, the higher of the probes too, as the printed "by kernel" lines say.
    kernels: dict = {}
    for probe in (eff.get("kernels") or {}, again.get("kernels") or {}):
        for name, by_batch in probe.items():
            for b, found in by_batch.items():
                have = kernels.setdefault(name, {}).setdefault(b, {})
                for k, r in found.items():
                    have[k] = max(r, have.get(k, 0.0))
    return {**eff, "rates_gflops": rates, "probes": first + [again["rates_gflops"]],
            "kernels": kernels}


def rate_for(eff: dict, dtype: str, batch: int) -> tuple[str, float | None]:
    """The measured rate for a row's dtype (GGUF and other non-torch dtypes: float32's) at its
    batch, or at the nearest measured batch below it."""
    rates = eff["rates_gflops"]
    name = dtype if dtype in rates else "float32"
    by_batch = {int(b): r for b, r in rates.get(name, {}).items()}
    below = [b for b in by_batch if b <= batch]
    return name, by_batch[max(below)] if below else None


def fraction_for(eff: dict | None, tokens_per_s: float | None, dtype: str,
                 batch: int) -> float | None:
    if not eff:
        return None
    return fraction_of_limit(tokens_per_s, eff["flops_per_token"], rate_for(eff, dtype, batch)[1])


def format_rates(eff: dict) -> list[str]:
    cpu = eff["cpu"]
    probes = len(eff.get("probes") or [None])
    lines = [f"CPU: {cpu['model']}; flags: {' '.join(cpu['flags']) or 'none of ' + ', '.join(CPU_FLAGS)}",
             f"compute limit: {eff['flops_per_token'] / 1e9:.3f} GFLOP/token; the faster of torch's "
             f"F.linear and oneDNN prepacked at the model's decode shapes, {eff['threads']} threads"
             + (f", the higher of {probes} probes (start and end of the run):" if probes > 1
                else ":")]
    for name, by_batch in eff["rates_gflops"].items():
        parts = [f"batch {b}: {r:.4g} GFLOP/s = {r * 1e9 / eff['flops_per_token']:.4g} tok/s"
                 for b, r in sorted(by_batch.items(), key=lambda kv: int(kv[0]))]
        lines.append(f"  {name:>8}: " + "; ".join(parts))
    for name, by_batch in (eff.get("kernels") or {}).items():
        lines.append(f"  {name:>8} by kernel (GFLOP/s): " + "; ".join(
            f"batch {b}: " + ", ".join(f"{k} {r:.4g}" for k, r in found.items())
            for b, found in sorted(by_batch.items(), key=lambda kv: int(kv[0]))))
    return lines


def format_served(eff: dict | None, served: list[dict], dtype: str) -> list[str]:
    """The fraction of the compute limit each served level reached."""
    if not eff or not served:
        return []
    lines = [f"Compute limit reached (served tok/s x {eff['flops_per_token'] / 1e9:.3f} GFLOP/token "
             f"/ {dtype} matmul rate at the level's batch)"]
    for lv in served:
        c = lv["concurrency"]
        name, rate = rate_for(eff, dtype, c)
        frac = fraction_of_limit(lv["tokens_per_s"], eff["flops_per_token"], rate)
        lines.append(f"  c={c:<3} {'-' if lv['tokens_per_s'] is None else lv['tokens_per_s']:>7} "
                     f"tok/s of {'-' if rate is None else round(rate * 1e9 / eff['flops_per_token'])} "
                     f"({name}): {'-' if frac is None else f'{100 * frac:.1f}%'}")
    return lines
