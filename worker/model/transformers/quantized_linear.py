"""QuantizedLinear: a CPU linear layer that reads int8 or int4 weights at a small decode step.

At a step of a few rows a linear layer's time is mostly reading every weight once, the weights'
bytes (SmolLM2-135M: ~540 MB in float32 per token, the lm_head a fifth of it). int8 weights
with a float16 scale per 32 inputs (llama.cpp's Q8_0) read 17/64 of that, int4 with a scale and
a minimum per 32 inputs about an eighth (worker/model/transformers/quant_linear.cpp, the
kernels). One row streams the weights (int8: stored by tiles of four output rows, one run of
memory a thread); at more rows the int8 kernel widens each weight once and multiplies it into
four rows at a time, but the float matmul reuses each weight it loads better still as rows
grow. On the 2-core AVX2 build machine (2 threads, a whole model's layers read from memory) the
int8 kernel took 0.27x the packed float32 matmul's time at one row, 0.33x at two, 0.4x at
four, 0.55x at eight, 0.7x at sixteen and 1.0x at 32. int4's kernel widens its weights again
for each row, so past a few rows the float matmul wins: its limit is four rows. So a
step of at most `max_rows` rows (MAX_ROWS, per mode) takes the quantized weights and a larger
one a float layer over the same weights dequantized (it replaces the original float layer; a
tied lm_head's embedding keeps its own, +21 % of the default model's float32 weights). Both
compute with one set of weights, so a sequence's tokens do not depend on how many others share
its step beyond float summation order, as with the float model alone.

`LLMQ_QUANTIZATION` (common/settings.py) picks int8, int4 or none; `auto` is AUTO below (why
it is what it is: its comment; the quality guard: bench/quality.py).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("llmq.quantized_linear")

# The largest step (rows) that takes the quantized weights, per mode; see above.
MAX_ROWS = {"int8": 16, "int4": 4}
GROUP = 32            # inputs per group (int8: a scale; int4: a scale and a minimum)
TILE = 4              # output rows the kernels compute together (quant_linear.cpp's TILE)
# How far the kernel's result may be from the float matmul over the dequantized weights (its
# sums run in another order), relative to the output's largest magnitude.
TOLERANCE = 1e-4
MODES = ("int8", "int4")
# What `auto` means: int8 under a float32 model. int8 with a scale per 32 inputs kept 98.0 % of
# float32's greedy positions on the default model (teacher-forced, every step quantized; 9 of
# 16 answers unchanged, more than bfloat16's 6), over a float16 KV cache too, and decodes ~4x
# as fast at one user, ~1.4x at 16 rows. Under bfloat16 the guard has not measured int8, so
# auto leaves it off.
AUTO = "int8"


def resolve_quantization(name: str, dtype: torch.dtype = torch.float32) -> str:
    """LLMQ_QUANTIZATION as none, int8 or int4, for a model of `dtype`."""
    if name != "auto":
        return name
    return AUTO if dtype == torch.float32 else "none"


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with a float16 scale per group of GROUP inputs: (q [n, k] int8, scales
    [n, k / GROUP] float16), llama.cpp's Q8_0: one large weight coarsens only its own group's
    rounding, not its whole row's."""
    w = weight.detach().float()
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    # The scale as the kernel reads it (float16), and the weights rounded against that one;
    # at least float16's smallest step, so that a group of zeros stays zeros.
    scales = (g.abs().amax(-1) / 127).clamp(min=2.0 ** -24).half()
    q = torch.round(g / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), scales.contiguous()


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of GROUP inputs (w = q * scale + min, q in 0..15): (packed
    [n, k / 2] uint8, a group's 16 bytes its first 16 weights in the low nibbles and the last
    16 in the high ones; scale_min [n, k / GROUP, 2] float32)."""
    w = weight.detach().float()
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    packed = (q[..., :GROUP // 2] | (q[..., GROUP // 2:] << 4)).reshape(n, k // 2)
    return packed.contiguous(), torch.stack([scale, lo], -1).contiguous()


def to_tiles(t: torch.Tensor, cols: int) -> torch.Tensor:
    """[n, k] in the int8 kernel's tile order, the same shape: each TILE output rows (the last
    tile the rest) stored group of `cols` columns by group, their rows' `cols` values one after
    the other, so that the kernel reads a tile as one run of memory (quant_linear.cpp,
    PREFETCH_BYTES). q: cols GROUP; its scales: cols 1."""
    n, k = t.shape
    full = n // TILE * TILE
    parts = [t[:full].reshape(-1, TILE, k // cols, cols).transpose(1, 2).reshape(-1)]
    if full < n:
        parts.append(t[full:].reshape(1, n - full, k // cols, cols).transpose(1, 2).reshape(-1))
    return torch.cat(parts).reshape(n, k)


def from_tiles(t: torch.Tensor, cols: int) -> torch.Tensor:
    """to_tiles undone: [n, k] in row order."""
    n, k = t.shape
    full = n // TILE * TILE
    parts = [t[:full].reshape(-1, k // cols, TILE, cols).transpose(1, 2).reshape(-1)]
    if full < n:
        parts.append(t[full:].reshape(1, k // cols, n - full, cols).transpose(1, 2).reshape(-1))
    return torch.cat(parts).reshape(n, k)


def dequantize(mode: str, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight a quantized one stands for (tests and the load check compare to it)."""
    n = q.shape[0]
    if mode == "int8":
        return (q.float().reshape(n, -1, GROUP) * scales.float()[..., None]).reshape(n, -1)
    nibbles = torch.cat([q.reshape(n, -1, GROUP // 2) & 15, q.reshape(n, -1, GROUP // 2) >> 4], -1)
    return (nibbles.float() * scales[..., :1] + scales[..., 1:]).reshape(n, -1)


class QuantizedLinear(nn.Module):
    """A linear layer over int8 or int4 weights at steps of at most `max_rows` rows, and over
    the same weights dequantized into a float layer at larger ones."""

    def __init__(self, linear: nn.Module, weight: torch.Tensor, mode: str, kernels,
                 max_rows: int | None = None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.mode, self.max_rows = mode, MAX_ROWS[mode] if max_rows is None else max_rows
        q, scales = (quantize_int8 if mode == "int8" else quantize_int4)(weight)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.float_linear = _float_layer(dequantize(mode, q, scales).to(weight.dtype),
                                         linear.bias)
        # q and scales as the kernel reads them (int8: in tile order; dequantized() undoes it)
        if mode == "int8":
            q, scales = to_tiles(q, GROUP), to_tiles(scales, 1)
        self.q, self.scales = q, scales
        self._kernel = kernels.int8_linear if mode == "int8" else kernels.int4_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > self.max_rows:
            return self.float_linear(x)
        return self._kernel(flat, self.q, self.scales, self.bias).reshape(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight the quantized one stands for."""
        if self.mode == "int8":
            return dequantize("int8", from_tiles(self.q, GROUP), from_tiles(self.scales, 1))
        return dequantize(self.mode, self.q, self.scales)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.mode} up to {self.max_rows} rows")


def quantize_linears(model: nn.Module, mode: str, kernels, max_rows: int | None = None) -> int:
    """Wraps the float32 and bfloat16 nn.Linear layers of a CPU model (the lm_head included)
    in QuantizedLinears; returns how many. Before packing: pack_linears then packs the float
    layers inside them. Needs the CPU kernels' module;
    each layer is checked on a small input against the float matmul over its dequantized
    weight, and a layer that the kernel cannot take (an input width the kernel's blocks do not
    divide) stays as it is."""
    if mode not in MODES or kernels is None:
        return 0
    gen = torch.Generator().manual_seed(0)
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight = _float_weight(child)
            if weight is None or weight.shape[1] % GROUP:
                continue
            new = QuantizedLinear(child, weight, mode, kernels, max_rows)
            x = torch.randn(2, new.in_features, generator=gen)
            with torch.inference_mode():
                # (under float32 the float layer's weight is the dequantized one: not again)
                exact = new.float_linear.weight
                if exact.dtype != torch.float32:
                    exact = new.dequantized()
                ref = x @ exact.t()
                if new.bias is not None:
                    ref += new.bias
                err = (new._kernel(x, new.q, new.scales, new.bias) - ref).abs().max()
            if err > TOLERANCE * max(1.0, ref.abs().max().item()):
                log.warning("%s left unquantized: the %s kernel is %.3g off", name, mode, err)
                continue
            setattr(parent, name, new)
            done += 1
    return done


def set_max_rows(model: nn.Module, rows: int) -> None:
    """Sets the row limit of every QuantizedLinear of the model (the quality guard takes the
    quantized weights at every step with a very large one)."""
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.max_rows = rows


def _float_layer(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear over `weight` [out, in] and `bias`, without initialising weights first."""
    layer = torch.nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0],
                                     bias=bias is not None, dtype=weight.dtype)
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return layer


def _float_weight(module: nn.Module) -> torch.Tensor | None:
    """A float32 or bfloat16 CPU nn.Linear's weight [out, in], or None for other modules."""
    if type(module) is not nn.Linear:
        return None
    weight = module.weight
    if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
        return None
    return weight
