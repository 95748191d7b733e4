"""Messages between the engine (model executor) and the model-worker process.

Token ids travel, never text. Every message is a small dataclass, and `encode`/`decode` are the
one place they are serialised for the pipe.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field

from common.protocol import SamplingParams


@dataclass(slots=True)
class NewSequence:
    """A sequence joining the batch: its tokens so far and how to sample it."""

    seq_id: str
    token_ids: list[int]           # prompt, plus output already made (after a restart)
    params: SamplingParams         # resolved: no None left for temperature
    num_output_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()


@dataclass(slots=True)
class StepRequest:
    """One engine step: free these, prefill those, decode the rest of the running batch."""

    prefill: list[NewSequence] = field(default_factory=list)
    decode_seq_ids: list[str] = field(default_factory=list)
    free_seq_ids: list[str] = field(default_factory=list)
    # Prompt tokens to compute this step of each sequence whose prompt spans steps (the
    # workload manager's chunk); a prompt not named here gets the model process's default chunk.
    chunks: dict[str, int] = field(default_factory=dict)
    # Sent while another step is in flight: newcomers only, prefilled between two layers of
    # that step's passes (or after it, by a backend that cannot); answered `interjected`.
    interject: bool = False
    # Decode passes to run back to back over the running batch (vLLM's multi-step scheduling;
    # decode-only steps, to a backend that announced `multi_step`): the first pass's tokens in
    # `token_ids`, the rest in `more_token_ids`. A sequence stops early at a stop token or
    # max_tokens, the whole step when none is left.
    num_steps: int = 1


@dataclass(slots=True)
class TokenLogprobs:
    """One token's log-probability under the raw distribution the sampler started from, its
    rank there (1 = most likely), and the k most likely tokens' ids and log-probabilities."""

    logprob: float
    rank: int
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """The token sampled for each sequence, and per-sequence errors (that sequence alone fails).

    A step that prefills newcomers and has more to run (another prefill pass, the decode)
    answers in pieces: a partial result with each prefill pass's first tokens as it ends,
    then the rest."""

    token_ids: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)   # prompt tokens reused, per newcomer
    # for sequences that asked: the sampled token's logprobs, and (at prefill) each prompt
    # token's after the first
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # a multi-step request's tokens after each sequence's first, in order
    more_token_ids: dict[str, list[int]] = field(default_factory=dict)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    partial: bool = False          # more of this step's result follows
    interjected: bool = False      # the answer to an `interject` request, not to the step

    @property
    def num_passes(self) -> int:
        """Decode passes the step ran (more than one for a multi-step request)."""
        return 1 + max(map(len, self.more_token_ids.values()), default=0)

    def is_full(self, seqs) -> bool:
        """Every pass decoded every one of these sequences (none ended inside the burst, nor
        failed): its time per pass is a pass's over all of them."""
        n = self.num_passes - 1
        return all(s.seq_id in self.token_ids and len(self.more_token_ids.get(s.seq_id, ())) == n
                   for s in seqs)


@dataclass(slots=True)
class Ready:
    """Sent once the model is loaded and warmed up, with the size of its KV cache (blocks of
    kv_block_size tokens; 0 when the backend keeps its own accounting)."""

    info: object   # ModelInfo
    kv_num_blocks: int = 0
    kv_block_size: int = 0
    interjects: bool = False   # runs an `interject` request inside the step in flight
    multi_step: bool = False   # runs a request's `num_steps` decode passes back to back


@dataclass(slots=True)
class Shutdown:
    pass


@dataclass(slots=True)
class CutShort:
    """Sent while a multi-step request runs, when newcomers arrive: end its passes at the next
    pass boundary and answer with the tokens made so far, so the newcomers wait for one pass,
    not the whole window. One that comes after its step ended is ignored."""


def encode(msg) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes):
    return pickle.loads(data)
