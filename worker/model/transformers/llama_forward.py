"""The Llama forward pass written out over transformers' modules (nano-vllm style).

transformers' `LlamaForCausalLM.__call__` wraps every decoder layer, attention and MLP in its
per-call plumbing (kwargs, output capture, config lookups, the attention interface's dispatch,
each module's hooks): ~5 % of a 16-row decode step on a CPU, where a step is ~90 ms. This is
the same ops, in the same order and dtypes, over the same weights (the packed linears too),
so its logits are transformers' bit for bit (a test checks it), with none of that. The model
worker uses it for the models it knows (`LlamaForward.for_model`: Llama-architecture
checkpoints such as SmolLM2 and the test models) and transformers' forward for the rest.

As vLLM's Llama does (QKVParallelLinear, MergedColumnParallelLinear), q, k and v run as one
matmul and so do gate and up: at a decode step's few rows a matmul's fixed costs (its threads'
fork and join, a small N's poor blocking) weigh, and the fused ones ran a 64-row step's linears
~2.5 % and a 16-row one's ~6 % faster on the 2-core build machine. A fused matmul computes each
output column as the separate one did (same weights, same k order), so the logits stay equal.

Given the CPU kernels' module (worker/model/transformers/cpu_kernels.py), the layer's elementwise ops run fused
(worker/model/transformers/layer_ops.cpp): the residual add with the next RMSNorm, the rotary embedding of q and k
straight out of the fused qkv, SiLU(gate) x up. At a 64-row decode step torch's ~25 small ops
per layer took ~8 % of the step. The add and the rotary embedding stay torch's to the bit; the
norm and SiLU differ in their last bits (a test bounds it), so transformers' logits are matched
to the bit only without them (`kernels=None`, as on a GPU).

At a decode step of at most the quantized layers' row limit (a user or a few), once every
linear is quantized, each layer is one call (worker/model/transformers/decode_layer.cpp): the
same kernels in the same order, so the same bits, without the ~0.1 ms of Python per layer that
was a third of a one-row step on the 2-core build machine.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .paged_attention import paged_attention_forward
from .quantized_linear import QuantizedLinear


class LayerKernels(NamedTuple):
    """The fused elementwise ops a forward calls (worker/model/transformers/layer_ops.cpp's
    functions), and the class that runs a whole layer of a small decode step in one call
    (worker/model/transformers/decode_layer.cpp)."""
    add_rms_norm: Callable
    silu_mul: Callable
    rotary: Callable
    decode_layer: Callable


class LlamaForward:
    """Runs a Llama-architecture model over a paged batch plan: embeddings, the decoder layers
    (calling `before_layer` ahead of each, where an interjection may run), the final norm and
    the kept rows' logits."""

    def __init__(self, model, before_layer: Callable[[], None], kernels=None):
        inner, cfg = model.model, model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.model = model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.layers = [(layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm,
                        layer.mlp) for layer in inner.layers]
        self.norm = inner.norm
        self.before_layer = before_layer
        for _, attn, _, mlp in self.layers:
            fuse(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
            fuse(mlp, "gate_up_proj", ("gate_proj", "up_proj"))
        self.splits = (self.heads * self.head_dim, self.kv_heads * self.head_dim,
                       self.kv_heads * self.head_dim)
        self.inter = model.config.intermediate_size
        fused = all(hasattr(attn, "qkv_proj") and hasattr(mlp, "gate_up_proj")
                    for _, attn, _, mlp in self.layers)
        fits = (model.dtype in (torch.float32, torch.bfloat16) and cfg.hidden_size % 8 == 0
                and self.inter % 8 == 0 and self.head_dim % 16 == 0)
        # (the module's functions, not the module: a module object cannot be deep-copied, and
        # the layers' pre-hooks reach this forward from the model)
        self.kernels = LayerKernels(kernels.add_rms_norm, kernels.silu_mul, kernels.rotary,
                                    kernels.DecodeLayer) \
            if kernels is not None and fused and fits else None
        # The layers as decode_layer.cpp's DecodeLayers, once their linears are quantized
        # (built at the first small decode step after that; see _decode_layers).
        self._decode: tuple[tuple, list] | None = None
        self.whole_layers = True   # (tests turn it off to compare with the Python path)

    def __getstate__(self) -> dict:
        # A copy of the model (tests move one to another device) builds its own DecodeLayers,
        # over its own weights; they cannot be copied.
        return {**self.__dict__, "_decode": None}

    @classmethod
    def for_model(cls, model, before_layer: Callable[[], None], kernels=None
                  ) -> "LlamaForward | None":
        """A forward for the model if it is one this file writes out exactly, else None;
        `kernels`: the CPU kernels' module, for the fused elementwise ops (when the model's
        dtype and shapes fit them), or None for torch's ops."""
        from transformers.models.llama import modeling_llama as ml

        cfg = model.config
        inner = getattr(model, "model", None)
        if (type(model) is not ml.LlamaForCausalLM or getattr(cfg, "pretraining_tp", 1) != 1
                or cfg.hidden_act != "silu" or inner is None
                or type(inner.rotary_emb) is not ml.LlamaRotaryEmbedding
                or any(type(m) is not ml.LlamaRMSNorm
                       for layer in inner.layers
                       for m in (layer.input_layernorm, layer.post_attention_layernorm))):
            return None
        return cls(model, before_layer, kernels)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, plan, keep: torch.Tensor
                 ) -> torch.Tensor:
        """ids, pos: [tokens] of the pass's flat row; keep: the positions whose logits are
        wanted. Returns [len(keep), vocab]."""
        if self.kernels is not None and ids.device.type == "cpu":
            return self._fused(ids, pos, plan, keep)
        x = self.embed(ids)[None]                              # [1, T, hidden]
        cos, sin = self.rotary(x, pos[None])                   # [1, T, head dim]
        cos, sin = cos[:, None], sin[:, None]                  # [1, 1, T, head dim]
        shape = (1, ids.shape[0], -1, self.head_dim)
        for norm1, attn, norm2, mlp in self.layers:
            self.before_layer()
            h = _rms_norm(norm1, x)
            if hasattr(attn, "qkv_proj"):   # (the modules are looked up here: packing swaps them)
                q, k, v = attn.qkv_proj(h).split(self.splits, -1)
            else:
                q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
            q = _rotary(q.view(shape).transpose(1, 2), cos, sin)
            k = _rotary(k.view(shape).transpose(1, 2), cos, sin)
            v = v.view(shape).transpose(1, 2)
            o, _ = paged_attention_forward(attn, q, k, v, None, scaling=attn.scaling,
                                           kv_plan=plan)
            x = x + attn.o_proj(o.reshape(*shape[:2], -1).contiguous())
            h = _rms_norm(norm2, x)
            if hasattr(mlp, "gate_up_proj"):
                gate, up = mlp.gate_up_proj(h).split((self.inter, self.inter), -1)
            else:
                gate, up = mlp.gate_proj(h), mlp.up_proj(h)
            x = x + mlp.down_proj(F.silu(gate) * up)
        x = _rms_norm(self.norm, x[:, keep])
        return self.model.lm_head(x)[0]

    def _fused(self, ids: torch.Tensor, pos: torch.Tensor, plan, keep: torch.Tensor
               ) -> torch.Tensor:
        """__call__ with the elementwise ops fused: the same ops in the same order, each
        layer's last residual add made with the next layer's first norm."""
        ops, tokens = self.kernels, ids.shape[0]
        x = self.embed(ids)                                    # [T, hidden], updated in place
        cos, sin = (t[0].contiguous() for t in self.rotary(x[None], pos[None]))   # [T, dim]
        kv = self.splits[2]
        delta = None                                           # the last sublayer's output
        decode = self._decode_layers(plan, tokens)
        if decode is not None:
            tables, lengths = plan.decode_tables()
            cache = plan.cache
            for (_, attn, _, _), layer in zip(self.layers, decode):
                self.before_layer()
                delta = layer(x, delta, cos, sin, cache.k[attn.layer_idx],
                              cache.v[attn.layer_idx], plan.write_slots, plan.new_blocks,
                              tables, lengths, cache.block_size)
        for norm1, attn, norm2, mlp in self.layers if decode is None else ():
            self.before_layer()
            h = ops.add_rms_norm(x, delta, norm1.weight, norm1.variance_epsilon)
            qkv = attn.qkv_proj(h)
            q, k = ops.rotary(qkv, cos, sin, self.heads, self.kv_heads)   # [T, heads, dim]
            v = qkv[:, -kv:].view(tokens, self.kv_heads, self.head_dim)
            o, _ = paged_attention_forward(attn, q[None].transpose(1, 2), k[None].transpose(1, 2),
                                           v[None].transpose(1, 2), None, scaling=attn.scaling,
                                           kv_plan=plan)
            h = ops.add_rms_norm(x, attn.o_proj(o.view(tokens, -1)), norm2.weight,
                                 norm2.variance_epsilon)
            delta = mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(h)))
        x = ops.add_rms_norm(x[keep], delta[keep], self.norm.weight, self.norm.variance_epsilon)
        return self.model.lm_head(x)

    def _decode_layers(self, plan, tokens: int) -> list | None:
        """The layers as DecodeLayers for this pass, or None where the Python path runs it: a
        pass with a prompt's chunk, without the decode kernel, over layers not all quantized
        (QuantizedLinear), or of more rows than their limit."""
        cache = plan.cache
        if (not self.whole_layers or plan.prefill_rows or cache.decode_kernel is None
                or not self.layers):
            return None
        _, attn, _, mlp = self.layers[0]
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if self._decode is None or self._decode[0] != linears:   # (quantizing replaces them)
            quantized = all(isinstance(m, QuantizedLinear) for _, a, _, p in self.layers
                            for m in (a.qkv_proj, a.o_proj, p.gate_up_proj, p.down_proj))
            self._decode = (linears, [self._decode_layer(*layer) for layer in self.layers]
                            if quantized else None)
        layers = self._decode[1]
        if layers is None or tokens > linears[0].max_rows or len(cache.k) < len(layers) \
                or any(cache.k[a.layer_idx] is None for _, a, _, _ in self.layers):
            return None
        return layers

    def _decode_layer(self, norm1, attn, norm2, mlp):
        """One layer's DecodeLayer, over its quantized linears' weights (shared, not copied)."""
        def weights(m):
            return m.q, m.scales, m.bias

        return self.kernels.decode_layer(
            norm1.weight, norm1.variance_epsilon, norm2.weight, norm2.variance_epsilon,
            weights(attn.qkv_proj), weights(attn.o_proj), weights(mlp.gate_up_proj),
            weights(mlp.down_proj), attn.qkv_proj.mode == "int4", self.heads, self.kv_heads,
            self.head_dim, self.head_dim ** -0.5 if attn.scaling is None else attn.scaling)


class _Part(nn.Module):
    """One of the projections a fused linear replaced: its columns of the fused output, so
    that transformers' own forward (a model this file does not drive, a test's reference)
    still finds `q_proj` and the rest. The fused module is found on its parent at each call,
    as packing replaces it there; it is not a child of this one (it would be packed twice)."""

    def __init__(self, parent: nn.Module, fused: str, start: int, stop: int):
        super().__init__()
        object.__setattr__(self, "_parent", parent)   # not registered: no module cycle
        self.fused, self.start, self.stop = fused, start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self._parent, self.fused)(x)[..., self.start:self.stop]

    def extra_repr(self) -> str:
        return f"{self.fused}[..., {self.start}:{self.stop}]"


def fuse(parent: nn.Module, fused: str, names: tuple[str, ...]) -> bool:
    """Replaces parent's linears `names` by one linear `fused` over their stacked weights (and
    biases) and `_Part`s of it; the weights are moved, not copied. Only plain nn.Linear layers
    of one dtype and device, all with a bias or none (a packed or quantized one is left as it
    is); a second call does nothing. Returns whether it fused."""
    parts = [getattr(parent, n, None) for n in names]
    if hasattr(parent, fused) or any(type(p) is not nn.Linear for p in parts):
        return False
    w = parts[0].weight
    if (any(p.weight.dtype != w.dtype or p.weight.device != w.device
            or p.in_features != w.shape[1] for p in parts)
            or len({p.bias is None for p in parts}) != 1):
        return False
    out = sum(p.out_features for p in parts)
    linear = nn.Linear(w.shape[1], out, bias=parts[0].bias is not None, device="meta",
                       dtype=w.dtype)
    with torch.no_grad():
        linear.weight = nn.Parameter(torch.cat([p.weight for p in parts]),
                                     requires_grad=w.requires_grad)
        if linear.bias is not None:
            linear.bias = nn.Parameter(torch.cat([p.bias for p in parts]),
                                       requires_grad=w.requires_grad)
    setattr(parent, fused, linear)
    start = 0
    for name, p in zip(names, parts):
        setattr(parent, name, _Part(parent, fused, start, start + p.out_features))
        start += p.out_features
    return True


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward's ops (in float32, back to the input's dtype before the weight)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_pos_emb for one of q, k: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
