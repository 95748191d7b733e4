"""Structured output in the model process: an llguidance matcher per constrained sequence, and
the token mask the matchers allow, applied to the logits inside llmq's own sampling step (so
every backend that samples with llmq's Sampler gets it, and constrained and free sequences
share a batch: only the constrained rows are masked).

llguidance over xgrammar (both are vLLM's): its import needs no torch, so the API validates a
schema with the same library that the worker compiles it with, and it needs no triton. Its
mask fill at batch 64 was ~1.5 ms a step slower than xgrammar's here, 1-2% of a decode step
(bench/structured_mask.py measures it).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from common.structured import grammar_of


# A row whose mask has at most this many non-zero words (32 tokens each) is masked sparsely.
SPARSE_WORDS = 64


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets to -inf, in place, every logit whose bit is 0 in its row's bitmask (int32 words,
    32 tokens each, lowest bit first: llguidance's and xgrammar's layout).

    A JSON grammar allows a few tokens at most steps (a digit, a separator, a key), so a row
    with few non-zero words keeps just its allowed logits and fills the rest: the whole-vocab
    arithmetic is what cost (at 64 x 49,152 on a loaded 2-core CPU, ~45 ms a step with a
    log-bias over every row, ~6 ms so). A dense row (inside a free string) is masked with
    numpy's putmask over its unpacked bits, ~2.5x faster than the log-bias, where torch's
    masked_fill was slower still."""
    vocab = logits.shape[-1]
    dev = logits.device
    words = bitmask.cpu().numpy()
    sparse = np.count_nonzero(words, axis=1) <= SPARSE_WORDS
    if sparse.any():
        srows = np.flatnonzero(sparse)
        r, w = np.divmod(np.flatnonzero(words[srows] != 0), words.shape[1])
        bits = np.unpackbits(words[srows[r], w].view(np.uint8).reshape(-1, 4), axis=-1,
                             bitorder="little")
        br, bc = np.nonzero(bits)
        cols = w[br] * 32 + bc
        ok = cols < vocab
        rows = torch.from_numpy(srows[r[br]][ok]).to(dev)
        cols = torch.from_numpy(cols[ok]).to(dev)
        kept = logits[rows, cols]
        logits.index_fill_(0, torch.from_numpy(srows).to(dev), float("-inf"))
        logits[rows, cols] = kept
    dense = np.flatnonzero(~sparse)
    if not len(dense):
        return
    banned = np.unpackbits(np.invert(words[dense]).view(np.uint8), axis=-1,
                           bitorder="little")[:, :vocab].view(np.bool_)
    if dev.type == "cpu" and logits.is_contiguous() and logits.dtype == torch.float32:
        view = logits.numpy()
        if len(dense) == len(words):
            np.putmask(view, banned, -np.inf)
        else:
            sub = view[dense]
            np.putmask(sub, banned, -np.inf)
            view[dense] = sub
    else:
        idx = torch.from_numpy(dense).to(dev)
        logits[idx] = logits[idx].masked_fill(torch.from_numpy(banned).to(dev), float("-inf"))


class Grammars:
    """Compiles structured-output specs into matchers for one tokenizer. The tokenizer's
    llguidance form is built on first use (about a second), so a worker that never sees a
    structured request never pays for it."""

    def __init__(self, load_tokenizer: Callable[[], Any], eos_token_ids=()):
        self._load_tokenizer = load_tokenizer
        self._eos = [int(t) for t in eos_token_ids]
        self._lltok = None
        self._vocab = 0
        self._executor = None

    def matcher(self, spec: dict, vocab_size: int, prior_token_ids: list[int] = ()):
        """A matcher for the spec, advanced over the output made so far (after a restart)."""
        import llguidance
        import llguidance.hf

        if self._lltok is None or self._vocab != vocab_size:
            tok = self._load_tokenizer()
            self._lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size,
                                                       eos_token=self._eos or None)
            self._vocab = vocab_size
            self._executor = llguidance.LLExecutor()
        m = llguidance.LLMatcher(self._lltok, grammar_of(spec), log_level=0)
        if prior_token_ids:
            m.consume_tokens(list(prior_token_ids))
        if m.is_error():
            raise ValueError(f"structured output: {m.get_error()}")
        return m

    def fill(self, matchers: list) -> torch.Tensor:
        """Every matcher's allowed tokens as one bitmask [len(matchers), words] (in parallel)."""
        words = (self._vocab + 31) // 32
        bitmask = torch.empty((len(matchers), words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                               bitmask.data_ptr(), words * 4, len(matchers))
        return bitmask
