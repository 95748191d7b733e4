"""The input processor: a queued record becomes a Sequence this worker can run.

The mirror image of the output processor (vLLM v1's split): starts the record on this worker,
tokenizes its prompt, checks it against the model, and resolves its sampling parameters.
"""
from __future__ import annotations

import dataclasses
import logging
import time

from common.protocol import SamplingParams, SequenceRequest
from common.store import SequenceStore

from .detokenizer import IncrementalDetokenizer
from .sequence import Sequence

log = logging.getLogger("llmq.engine")


class Rejected(Exception):
    """A started record whose input cannot run here: it fails alone, with an error code the
    API turns into a 400 (`invalid_prompt`, `context_length_exceeded`)."""

    def __init__(self, seq_id: str, attempt: int, message: str, code: str = "invalid_prompt"):
        super().__init__(message)
        self.seq_id, self.attempt, self.code = seq_id, attempt, code


class InputProcessor:
    """Admits sequences: the record's start, tokenizing, the context check, parameters."""

    def __init__(self, name: str, settings, store: SequenceStore, executor, tokenizer):
        self.name = name
        self.settings = settings
        self.store = store
        self.executor = executor   # read for its model's description (`info`), nothing else
        self.tokenizer = tokenizer

    def process(self, seq_id: str, running: int | None = None) -> Sequence | None:
        """Starts the record here and returns its Sequence; None when there is nothing to run
        (finished, cancelled while queued, expired, run by a live peer, or already run here:
        `running` is the attempt of it this engine runs). Raises Rejected for an input that
        cannot run (the caller ends its record)."""
        _prev, attempt = self.store.start(seq_id, self.name, self.settings.worker_stale_s,
                                          running)
        if not attempt:
            return None
        req = self.store.load_request(seq_id)
        ids = self._checked_token_ids(seq_id, req, attempt)
        self._check_token_params(seq_id, req.params, attempt)
        self.store.set_prompt_tokens(seq_id, len(ids))
        log.info("sequence admitted", extra={"seq_id": seq_id, "attempt": attempt,
                                             "prompt_tokens": len(ids)})
        info = self.executor.info
        return Sequence(seq_id, ids, self._resolve(req.params, len(ids)),
                        eos_token_ids=info.eos_token_ids, created_at=req.created_at,
                        admitted_at=time.time(), deadline=req.deadline, owner=req.owner,
                        attempt=attempt,
                        detokenizer=IncrementalDetokenizer(self.tokenizer, ids))

    def over_fair_share(self, owner: str, held: list[str], key_cap: int,
                        max_num_seqs: int) -> bool:
        """Whether this worker holds a full batch (`held`: the owners of the sequences it
        holds) and `owner` holds its share of it. Task threads outnumber batch slots
        (scripts/worker.sh), so another key's sequence can reach the workload manager while one key
        fills the batch; a key past its share must not take those threads too. Without API
        keys (no owner) sequences are never handed back, so their queue order holds."""
        if len(held) < max_num_seqs:
            return False
        return bool(owner) and held.count(owner) >= key_cap

    def _checked_token_ids(self, seq_id: str, req: SequenceRequest | None, attempt: int
                           ) -> list[int]:
        info = self.executor.info
        try:
            ids = self._tokenize(req)
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer error: bad input
            raise Rejected(seq_id, attempt, str(exc)) from exc
        if len(ids) >= info.max_model_len:
            raise Rejected(seq_id, attempt,
                           f"prompt is {len(ids)} tokens; the model's context is "
                           f"{info.max_model_len}", "context_length_exceeded")
        if not ids:
            raise Rejected(seq_id, attempt, "prompt is empty after tokenization")
        return ids

    def _check_token_params(self, seq_id: str, p: SamplingParams, attempt: int) -> None:
        """Token ids in the parameters must be the model's, as vLLM checks them: an id past
        the vocabulary failed the sampler (a 500) or was silently dropped."""
        vocab = self.executor.info.vocab_size
        for name, ids in (("stop_token_ids", p.stop_token_ids), ("logit_bias", p.logit_bias)):
            bad = sorted(t for t in ids or () if not 0 <= t < vocab)
            if bad:
                raise Rejected(seq_id, attempt,
                               f"{name} has token ids outside the model's vocabulary "
                               f"[0, {vocab}): {bad[:5]}", "invalid_sampling_params")

    def _tokenize(self, req: SequenceRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            vocab = self.executor.info.vocab_size
            if any(not 0 <= t < vocab for t in req.prompt_token_ids):
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
            return list(req.prompt_token_ids)
        if req.messages is not None:
            text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                                      tokenize=False,
                                                      **(req.template_args or {}))
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(req.prompt)["input_ids"]

    def _resolve(self, p: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """Fills unset sampling values from the model's generation_config; caps max_tokens."""
        d = self.executor.info.generation_defaults
        room = self.executor.info.max_model_len - num_prompt_tokens
        # (replace: fields this does not resolve, such as logprobs, pass through as they are)
        max_tokens = max(min(1, p.max_tokens), min(p.max_tokens, room))   # 0: echo only
        return dataclasses.replace(
            p, max_tokens=max_tokens,
            # no more than the room left: vLLM refuses min_tokens past max_tokens
            min_tokens=min(p.min_tokens, max_tokens),
            temperature=p.temperature if p.temperature is not None else d.get("temperature", 0.0),
            top_p=p.top_p if p.top_p is not None else d.get("top_p"),
            top_k=p.top_k if p.top_k is not None else d.get("top_k"),
            min_p=p.min_p if p.min_p is not None else d.get("min_p"),
            repetition_penalty=(p.repetition_penalty if p.repetition_penalty is not None
                                else d.get("repetition_penalty")),
            seed=p.seed, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
            ignore_eos=p.ignore_eos, cache_salt=p.cache_salt)
