"""The Llama forward pass written out over transformers' modules (nano-vllm style).

transformers' `LlamaForCausalLM.__call__` wraps every decoder layer, attention and MLP in its
per-call plumbing (kwargs, output capture, config lookups, the attention interface's dispatch,
each module's hooks): ~5 % of a 16-row decode step on a CPU, where a step is ~90 ms. This is
the same ops, in the same order and dtypes, over the same weights (the packed linears too),
so its logits are transformers' bit for bit (a test checks it), with none of that. The model
worker uses it for the models it knows (`LlamaForward.for_model`: Llama-architecture
checkpoints such as SmolLM2 and the test models) and transformers' forward for the rest.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .paged_attention import paged_attention_forward


class LlamaForward:
    """Runs a Llama-architecture model over a paged batch plan: embeddings, the decoder layers
    (calling `before_layer` ahead of each, where an interjection may run), the final norm and
    the kept rows' logits."""

    def __init__(self, model, before_layer: Callable[[], None]):
        inner, cfg = model.model, model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.layers = [(layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm,
                        layer.mlp) for layer in inner.layers]
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.before_layer = before_layer

    @classmethod
    def for_model(cls, model, before_layer: Callable[[], None]) -> "LlamaForward | None":
        """A forward for the model if it is one this file writes out exactly, else None."""
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
        return cls(model, before_layer)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, plan, keep: torch.Tensor
                 ) -> torch.Tensor:
        """ids, pos: [tokens] of the pass's flat row; keep: the positions whose logits are
        wanted. Returns [len(keep), vocab]."""
        x = self.embed(ids)[None]                              # [1, T, hidden]
        cos, sin = self.rotary(x, pos[None])                   # [1, T, head dim]
        cos, sin = cos[:, None], sin[:, None]                  # [1, 1, T, head dim]
        shape = (1, ids.shape[0], -1, self.head_dim)
        for norm1, attn, norm2, mlp in self.layers:
            self.before_layer()
            h = _rms_norm(norm1, x)
            q = _rotary(attn.q_proj(h).view(shape).transpose(1, 2), cos, sin)
            k = _rotary(attn.k_proj(h).view(shape).transpose(1, 2), cos, sin)
            v = attn.v_proj(h).view(shape).transpose(1, 2)
            o, _ = paged_attention_forward(attn, q, k, v, None, scaling=attn.scaling,
                                           kv_plan=plan)
            x = x + attn.o_proj(o.reshape(*shape[:2], -1).contiguous())
            h = _rms_norm(norm2, x)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        x = _rms_norm(self.norm, x[:, keep])
        return self.lm_head(x)[0]


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
