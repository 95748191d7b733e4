"""Batched sampling: one token per sequence from the last logits, each with its own parameters."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.protocol import SamplingParams


@dataclass
class SamplingState:
    """Per-sequence sampling state kept in the model worker (RNG, tokens for penalties)."""

    params: SamplingParams
    stop_token_ids: tuple[int, ...] = ()
    token_ids: list[int] = field(default_factory=list)   # prompt + output, for penalties
    num_output_tokens: int = 0
    generator: torch.Generator | None = None

    @classmethod
    def create(cls, params: SamplingParams, token_ids: list[int], num_output_tokens: int,
               stop_token_ids, device) -> "SamplingState":
        gen = None
        if (params.temperature or 0.0) > 0.0:
            # Its own generator per sequence: a seeded sequence samples the same tokens
            # whatever else shares the batch.
            gen = torch.Generator(device=device)
            if params.seed is not None:
                gen.manual_seed(int(params.seed) + num_output_tokens)
            else:
                gen.seed()
        return cls(params, tuple(stop_token_ids), list(token_ids), num_output_tokens, gen)

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    def record(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.num_output_tokens += 1


class Sampler:
    """Applies penalties, min_tokens, temperature, top-k, top-p and min-p, then picks tokens."""

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
        logits = logits.float()
        for i, st in enumerate(states):
            p = st.params
            if p.repetition_penalty not in (None, 1.0):
                ids = torch.tensor(sorted(set(st.token_ids)), device=logits.device)
                seen = logits[i, ids]
                logits[i, ids] = torch.where(seen > 0, seen / p.repetition_penalty,
                                             seen * p.repetition_penalty)
            if st.num_output_tokens < p.min_tokens and st.stop_token_ids:
                logits[i, list(st.stop_token_ids)] = float("-inf")
        out = torch.argmax(logits, dim=-1)
        sampled = [i for i, st in enumerate(states) if (st.params.temperature or 0.0) > 0.0]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            probs = self._probs(logits[rows], [states[i].params for i in sampled])
            for j, i in enumerate(sampled):
                st = states[i]
                if st.params.seed is not None:
                    # The draw for output token n depends only on (seed, n): the same text
                    # whatever the batch, and also after a restart from the tokens so far.
                    st.generator.manual_seed((int(st.params.seed) * 1_000_003
                                              + st.num_output_tokens) % (2**63 - 1))
                out[i] = torch.multinomial(probs[j], 1, generator=st.generator)[0]
        return out.tolist()

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
        logits = logits / temp
        ks = [p.top_k if p.top_k and p.top_k > 0 else 0 for p in params]
        if any(ks):
            kmax = min(max(ks), logits.shape[-1])
            top = torch.topk(logits, kmax, dim=-1).values
            idx = torch.tensor([(k or kmax) - 1 for k in ks], device=dev).clamp(max=kmax - 1)
            kth = top.gather(1, idx.unsqueeze(1))
            keep_all = torch.tensor([k == 0 for k in ks], device=dev).unsqueeze(1)
            logits = torch.where((logits < kth) & ~keep_all, float("-inf"), logits)
        tps = [p.top_p if p.top_p is not None else 1.0 for p in params]
        if any(tp < 1.0 for tp in tps):
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            top_p = torch.tensor(tps, device=dev).unsqueeze(1)
            drop = (cum - torch.softmax(sorted_logits, dim=-1)) > top_p   # keeps the first token
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        probs = torch.softmax(logits, dim=-1)
        mps = [p.min_p or 0.0 for p in params]
        if any(mps):
            min_p = torch.tensor(mps, device=dev).unsqueeze(1)
            probs = torch.where(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
        return probs
