"""Batched sampling: one token per sequence from the last logits, each with its own parameters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from common.protocol import SamplingParams

from ..messages import TokenLogprobs
from .structured_output import Grammars, apply_bitmask


@dataclass
class SamplingState:
    """Per-sequence sampling state kept in the model worker (RNG, tokens for penalties)."""

    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()
    token_ids: list[int] = field(default_factory=list)   # prompt + output, for penalties
    num_output_tokens: int = 0
    generator: torch.Generator | None = None
    matcher: Any = None   # structured output: its grammar's matcher, made at the first sample
    # The stop ids and the bias as index tensors, made at the first step that needs them and
    # kept: rebuilt from the Python containers at every token, they cost in proportion to
    # their size inside the step every sequence of the batch waits on.
    _stop_ids: torch.Tensor | None = field(default=None, repr=False)
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def create(cls, params: SamplingParams, token_ids: list[int], num_output_tokens: int,
               stop_token_ids, device) -> "SamplingState":
        gen = None
        if (params.temperature or 0.0) > 0.0 and params.seed is not None:
            # Its own generator per seeded sequence: it samples the same tokens whatever else
            # shares the batch (the unseeded rows share the device's: `draw`).
            gen = torch.Generator(device=device)
            gen.manual_seed(int(params.seed) + num_output_tokens)
        return cls(params, frozenset(stop_token_ids), list(token_ids), num_output_tokens, gen)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_output_tokens:]

    @property
    def plain_greedy(self) -> bool:
        """The next token is the argmax of the raw logits: no sampling, mask, penalty, bias,
        blocked stop token or logprobs."""
        p = self.params
        return (not (p.temperature or 0.0) > 0.0 and not p.structured and p.logprobs is None
                and not (p.presence_penalty or p.frequency_penalty or p.logit_bias)
                and p.repetition_penalty in (None, 1.0)
                and not (self.num_output_tokens < p.min_tokens and self.stop_token_ids))

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    def stop_ids(self, device) -> torch.Tensor:
        """The stop token ids as a tensor (blocked while min_tokens applies)."""
        if self._stop_ids is None:
            self._stop_ids = torch.tensor(sorted(self.stop_token_ids), dtype=torch.long,
                                          device=device)
        return self._stop_ids

    def bias(self, vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (token ids, values) tensors, ids outside the vocabulary left out (the
        worker admits only ids of this vocabulary)."""
        if self._bias is None:
            bias = {t: b for t, b in self.params.logit_bias.items() if 0 <= t < vocab_size}
            self._bias = (torch.tensor(list(bias), dtype=torch.long, device=device),
                          torch.tensor(list(bias.values()), dtype=torch.float32, device=device))
        return self._bias

    def record(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.num_output_tokens += 1

    @property
    def ended(self) -> bool:
        """The last token ends the sequence (the engine's rule, output_processor.end_on_token:
        a stop token once min_tokens are out, or max_tokens reached). A backend running
        several passes per step stops a sequence's passes there."""
        n, p = self.num_output_tokens, self.params
        return n >= p.max_tokens or (n > 0 and n >= p.min_tokens
                                     and self.last_token_id in self.stop_token_ids)


class Sampler:
    """Masks structured rows, takes log-probabilities, applies penalties, biases, min_tokens,
    temperature, top-k, top-p and min-p, then picks tokens."""

    def __init__(self, grammars: Grammars | None = None):
        self.grammars = grammars
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        """The unseeded rows' generator on `device`, seeded from the OS once (torch's default
        generator starts from the same seed in every process: each worker's first unseeded
        draws would repeat another's)."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
            self._generators[device].seed()
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
        return self.sample(logits, states)[0]

    def sample(self, logits: torch.Tensor, states: list[SamplingState]
               ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row, and its logprobs for the rows whose sequence asked for them."""
        if all(st.plain_greedy for st in states):
            # Nothing to edit: argmax of the logits as they are (a bf16 -> fp32 copy of a
            # 64 x 49,152 matrix is a fresh 12 MB every step, ~2% of a decode step on CPU;
            # the conversion is exact, so the tokens are the same).
            return greedy_tokens(logits).tolist(), [None] * len(states)
        # A copy, even when the logits are float32 already: the edits below are made in place,
        # and a batch whose sampling failed is sampled again row by row from the same logits
        # (TransformersBackend._prefill_pass), which must find them as the model made them.
        logits = logits.to(torch.float32, copy=True)
        self._mask(logits, states)
        # Log-probabilities of the raw distribution (after the grammar mask, which decides what
        # may be sampled at all; before penalties and temperature), as vLLM's default.
        lp_rows = [i for i, st in enumerate(states) if st.params.logprobs is not None]
        raw = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None
        for i, st in enumerate(states):
            p = st.params
            # vLLM's order: the bias, then the repetition penalty (on prompt and output), then
            # the frequency and presence penalties (on the output): combined, the order decides
            # the logit, and a greedy pick with it.
            if p.logit_bias:
                ids, values = st.bias(logits.shape[-1], logits.device)
                logits[i].index_add_(0, ids, values)
            if p.repetition_penalty not in (None, 1.0):
                ids = torch.tensor(sorted(set(st.token_ids)), device=logits.device)
                seen = logits[i, ids]
                logits[i, ids] = torch.where(seen > 0, seen / p.repetition_penalty,
                                             seen * p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out_ids = st.output_token_ids
                if out_ids:
                    ids, counts = torch.unique(torch.tensor(out_ids, device=logits.device),
                                               return_counts=True)
                    logits[i, ids] -= p.frequency_penalty * counts + p.presence_penalty
            if st.num_output_tokens < p.min_tokens and st.stop_token_ids:
                blocked = logits[i].index_fill(0, st.stop_ids(logits.device), float("-inf"))
                if torch.isfinite(blocked).any():   # a finished grammar allows only EOS
                    logits[i] = blocked
        out = greedy_tokens(logits)
        sampled = [i for i, st in enumerate(states) if (st.params.temperature or 0.0) > 0.0]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            probs = self._probs(logits[rows], [states[i].params for i in sampled])
            out[rows] = draw(probs, [states[i] for i in sampled], self._generator(probs.device))
        tokens = out.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(states)
        for j, i in enumerate(lp_rows):
            logprobs[i] = token_logprobs(raw[j], tokens[i], states[i].params.logprobs)
        for st, tok in zip(states, tokens):
            if st.matcher is not None:
                st.matcher.consume_token(tok)
        return tokens, logprobs

    def _mask(self, logits: torch.Tensor, states: list[SamplingState]) -> None:
        """Structured output: each constrained row keeps only the tokens its grammar allows
        next (a row whose grammar has nothing left to allow, ended or broken, is left free)."""
        rows = [i for i, st in enumerate(states) if st.params.structured]
        if not rows:
            return
        if self.grammars is None:
            raise ValueError("structured output needs the model's tokenizer")
        for i in rows:
            st = states[i]
            if st.matcher is None:
                st.matcher = self.grammars.matcher(st.params.structured, logits.shape[-1],
                                                   st.output_token_ids)
        rows = [i for i in rows if not states[i].matcher.is_error()]
        if not rows:
            return
        bitmask = self.grammars.fill([states[i].matcher for i in rows])
        some = bitmask.ne(0).any(-1)
        if len(rows) == len(states) and bool(some.all()):
            apply_bitmask(logits, bitmask)   # every row: in place, no 12 MB gather and scatter
            return
        idx = torch.tensor(rows, device=logits.device)[some]
        if len(idx):
            sub = logits[idx]
            apply_bitmask(sub, bitmask[some])
            logits[idx] = sub

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


def draw(probs: torch.Tensor, states: list[SamplingState], generator: torch.Generator
         ) -> torch.Tensor:
    """One token per row of `probs`. The unseeded rows in one torch.multinomial call, from
    `generator`: no Python loop over them and, on a GPU, a few kernels in all rather than a
    few per row. A seeded row from its own generator, seeded by (seed, output token number),
    so its token depends only on them: the same whatever the batch, and after a restart from
    the tokens so far (one call per seeded row, as vLLM's sampler draws its seeded rows)."""
    seeded = [j for j, st in enumerate(states) if st.params.seed is not None]
    if not seeded:
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    out = torch.empty(len(states), dtype=torch.long, device=probs.device)
    free = [j for j, st in enumerate(states) if st.params.seed is None]
    if free:
        rows = torch.tensor(free, device=probs.device)
        out[rows] = torch.multinomial(probs[rows], 1, generator=generator)[:, 0]
    for j in seeded:
        st = states[j]
        st.generator.manual_seed((int(st.params.seed) * 1_000_003 + st.num_output_tokens)
                                 % (2**63 - 1))
        out[j] = torch.multinomial(probs[j], 1, generator=st.generator)[0]
    return out


def greedy_tokens(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """torch.argmax(logits, dim=-1), the same indices (the first of equal maxima, NaN counting
    as the largest), found in two passes: the maximum of each chunk of `chunk` columns, then
    argmax within each row's first chunk holding the row's maximum. On CPU, argmax over a
    64 x 49,152 matrix ran at about 200 M values/s (16 ms, 5% of a 64-row bf16 decode step on
    the Xeon, one thread) while amax is vectorised (0.7 ms); the two passes took 0.9 ms."""
    rows, vocab = logits.shape
    if vocab < 2 * chunk:
        return torch.argmax(logits, dim=-1)
    full = vocab // chunk * chunk
    best = logits[:, :full].unflatten(-1, (full // chunk, chunk)).amax(-1)
    if full < vocab:   # the short last chunk
        best = torch.cat([best, logits[:, full:].amax(-1, keepdim=True)], dim=1)
    start = torch.argmax(best, dim=-1) * chunk
    # Columns past the vocabulary repeat its last one: later than the real one, never first.
    cols = (start[:, None] + torch.arange(chunk, device=logits.device)).clamp_(max=vocab - 1)
    return start + torch.argmax(logits.gather(1, cols), dim=-1)


def token_logprobs(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprobs:
    """A token's log-probability and rank in one row of log-probabilities, and the k best."""
    lp = logprobs[token_id]
    rank = int((logprobs > lp).sum()) + 1
    top_ids: list[int] = []
    top_lps: list[float] = []
    if k:
        top = torch.topk(logprobs, min(k, logprobs.shape[-1]))
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    return TokenLogprobs(float(lp), rank, top_ids, top_lps)


def prompt_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """Each prompt token's logprobs given the tokens before it: logits [len(token_ids), vocab]
    are the model's outputs at the prompt's positions (the last one predicts past the prompt
    and is not used). The first token has none."""
    return scored_positions(logits[:-1], token_ids[1:], k)


# Rows of log-probabilities made at once: a 256 x 49,152 float32 block is 48 MiB, however
# long the chunk.
SCORE_ROWS = 256


def scored_positions(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """token_logprobs of targets[i] in row i of logits [len(targets), vocab], a block of rows
    at a time (as vLLM scores its prompt logprobs: one log_softmax, gather and topk per block,
    no device sync per position). Each position still costs passes over the vocabulary (~0.5
    ms at 49,152 on one CPU thread), which is why a scored prompt is chunked like any other."""
    out: list[TokenLogprobs] = []
    for a in range(0, len(targets), SCORE_ROWS):
        lps = torch.log_softmax(logits[a:a + SCORE_ROWS].float(), dim=-1)
        tgt = torch.tensor(targets[a:a + SCORE_ROWS], device=lps.device)
        lp = lps.gather(1, tgt[:, None])[:, 0]
        if lps.device.type == "cpu":
            # (a row against its own scalar measured ~2.5x faster here than one broadcast
            # comparison of the block)
            ranks = [int((row > x).sum()) + 1 for row, x in zip(lps, lp)]
        else:
            ranks = ((lps > lp[:, None]).sum(-1) + 1).tolist()
        top_ids: list[list[int]] = [[] for _ in ranks]
        top_lps: list[list[float]] = [[] for _ in ranks]
        if k:
            top = torch.topk(lps, min(k, lps.shape[-1]), dim=-1)
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        out += [TokenLogprobs(x, r, i, v)
                for x, r, i, v in zip(lp.tolist(), ranks, top_ids, top_lps)]
    return out
