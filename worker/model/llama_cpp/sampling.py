"""Sampling in C for the llama.cpp backend: one llama.cpp sampler chain per sequence.

`llama_sampler_sample` reads a row's logits where llama_decode left them and picks the token in
C, so a sequence sampled this way never has its 49,152 logits copied into Python. It covers
what most requests ask for: greedy, or temperature with top-k, top-p, min-p and a seed, plus
logit_bias and the min_tokens mask on stop tokens. Everything else (logprobs, structured
output, penalties) goes through llmq's own `Sampler`, which needs the logits; `needs_logits`
decides which.

Each chain follows llmq's `Sampler` order: biases and the min_tokens mask, then temperature,
top-k, top-p, min-p, and the draw. A seeded sequence gets a fresh draw for each output token,
seeded from (seed, tokens so far), so its text depends neither on what shares the batch nor on
a restart; it is not the text the Python sampler would draw for that seed (another generator).
"""
from __future__ import annotations

from typing import Callable

from common.protocol import SamplingParams


def needs_logits(params: SamplingParams) -> bool:
    """True when the sequence must be sampled by llmq's Sampler from copied-out logits."""
    return bool(params.logprobs is not None or params.structured
                or params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty not in (None, 1.0))


def _draw_seed(seed: int, n: int) -> int:
    """The seed of output token n's draw (llama.cpp seeds are 32-bit)."""
    return (int(seed) * 1_000_003 + n) % 0xFFFFFFFF


class ChainSampler:
    """A sequence's llama.cpp sampler chain: picks its next token from the context's logits."""

    def __init__(self, lib, n_vocab: int, params: SamplingParams, stop_token_ids,
                 num_output_tokens: int):
        self.lib = lib
        self.n_vocab = n_vocab
        self.params = params
        self.stop_token_ids = tuple(stop_token_ids)
        self.num_output_tokens = num_output_tokens
        self.masking = self._masks_stops()
        self.chain = self._build()

    @property
    def plain_greedy(self) -> bool:
        """The chain is greedy over the raw logits (no bias, no mask): the row's argmax is its
        answer, which numpy finds in the logits buffer faster than llama.cpp's greedy sampler
        (that first copies the row into an array of 49,152 token records)."""
        return self.params.temperature <= 0.0 and not self.masking and not self.params.logit_bias

    def sample(self, ctx, row: int, argmax: Callable[[], int]) -> int:
        """The token for the batch row `row` of the last llama_decode on `ctx`; `argmax()`
        gives the row's argmax, taken when the chain is plain greedy."""
        if self.plain_greedy:
            tok = argmax()
        else:
            if self.params.seed is not None and self.params.temperature > 0.0:
                self._reseed()
            tok = int(self.lib.llama_sampler_sample(self.chain, ctx, row))
        self.num_output_tokens += 1
        if self.masking and not self._masks_stops():   # min_tokens reached: unmask stops
            self.masking = False
            self.lib.llama_sampler_free(self.chain)
            self.chain = self._build()
        return tok

    def unsample(self) -> None:
        """Takes back the last sample (a token run ahead and then not asked for): the count
        of output tokens, and the min_tokens mask on stop tokens if that sample lifted it. A
        seeded draw is seeded from the count, so the token drawn again is the same."""
        self.num_output_tokens -= 1
        if not self.masking and self._masks_stops():
            self.masking = True
            self.lib.llama_sampler_free(self.chain)
            self.chain = self._build()

    def free(self) -> None:
        if self.chain is not None:
            self.lib.llama_sampler_free(self.chain)
            self.chain = None

    def _masks_stops(self) -> bool:
        return bool(self.num_output_tokens < self.params.min_tokens and self.stop_token_ids)

    def _build(self):
        lib, p = self.lib, self.params
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        bias = {t: b for t, b in (p.logit_bias or {}).items() if 0 <= t < self.n_vocab}
        if self.masking:
            bias.update((t, float("-inf")) for t in self.stop_token_ids)
        if bias:
            arr = (lib.llama_logit_bias * len(bias))(
                *(lib.llama_logit_bias(t, b) for t, b in bias.items()))
            lib.llama_sampler_chain_add(
                chain, lib.llama_sampler_init_logit_bias(self.n_vocab, len(bias), arr))
        if p.temperature <= 0.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return chain
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(p.temperature))
        if p.top_k and p.top_k > 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(p.top_k))
        if p.top_p is not None and p.top_p < 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(p.min_p, 1))
        seed = lib.LLAMA_DEFAULT_SEED if p.seed is None else _draw_seed(p.seed,
                                                                         self.num_output_tokens)
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed))
        return chain

    def _reseed(self) -> None:
        """Replaces the chain's last sampler, the draw, with one seeded for this token."""
        lib = self.lib
        last = lib.llama_sampler_chain_n(self.chain) - 1
        lib.llama_sampler_free(lib.llama_sampler_chain_remove(self.chain, last))
        lib.llama_sampler_chain_add(
            self.chain, lib.llama_sampler_init_dist(_draw_seed(self.params.seed,
                                                               self.num_output_tokens)))
