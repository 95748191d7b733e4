"""PackedLinear: a CPU Linear whose weight oneDNN has re-laid out once, at load.

torch's fp32 `F.linear` on CPU goes to a BLAS GEMM that re-packs the whole weight matrix on
every call. At the row counts a decode step has (one per running sequence) that packing
costs about as much as the multiply: on the 2-core build machine a SmolLM2-135M decode step
of 8 rows took 224 ms with nn.Linear and 118 ms packed, 64 rows 408 ms and 279 ms, with the
same greedy tokens. Inductor's CPU freezing pass uses the same two operators. The same holds
in bfloat16 (AMX / AVX512-BF16): on this Xeon, one thread, 64 x 576 x 1536 took 0.61 ms with
nn.Linear and 0.44 ms packed (fp32: 2.5 ms either way).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("llmq.packed_linear")

PACK_FOR_ROWS = 64   # oneDNN picks its weight layout for this many rows; any count works
# The dtypes oneDNN packs, and how close the packed result must come to nn.Linear's (bf16 has
# 8 bits of mantissa: a different summation order moves the last bit).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


class PackedLinear(nn.Module):
    """nn.Linear's forward over a oneDNN-prepacked copy of its weight (CPU, fp32 or bf16)."""

    def __init__(self, linear: nn.Linear, rows_hint: int = PACK_FOR_ROWS):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed,
                                               self.bias, "none", [], "")
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


def pack_linears(model: nn.Module) -> int:
    """Replaces the fp32 and bf16 nn.Linear layers of a CPU model by PackedLinears; returns
    how many.

    One layer at a time (memory grows by one weight, not the model), and each only after its
    packed result matched nn.Linear on a small input: a torch without the oneDNN operators, or
    one that disagrees, leaves the layers as they were. A weight tied to the embedding
    (lm_head) gets its own packed copy."""
    if not torch.backends.mkldnn.is_available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype in TOLERANCE
             and child.weight.device.type == "cpu"]
    gen = torch.Generator().manual_seed(0)
    done = 0
    for parent, name, child in swaps:
        try:
            new = PackedLinear(child)
            x = torch.randn(3, child.in_features, generator=gen).to(child.weight.dtype)
            tol = TOLERANCE[child.weight.dtype]
            with torch.inference_mode():
                same = torch.allclose(new(x).float(), child(x).float(), rtol=tol, atol=tol)
            if not same:
                raise ValueError(f"{name}: the packed result differs from nn.Linear")
        except Exception as exc:  # noqa: BLE001 - an old or unusual torch: keep nn.Linear
            log.warning("linear layers left unpacked: %s: %s", type(exc).__name__, exc)
            return done
        setattr(parent, name, new)
        done += 1
    return done
