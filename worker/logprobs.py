"""Log-probabilities on the engine side: the model process's TokenLogprobs (ids and numbers)
become the entries the job record and the token events carry, with each token's text decoded
on its own, as vLLM does.

An entry: {"token_id", "token", "logprob", "rank", "top_logprobs": [{"token_id", "token",
"logprob"}, ...]}; a sequence's prompt logprobs have one per prompt token, the first with
logprob None (nothing comes before it).
"""
from __future__ import annotations

import math

from .messages import StepResult, TokenLogprobs
from .sequence import Sequence

# JSON has no -inf (a token the grammar mask ruled out): vLLM's OpenAI server writes -9999.0.
MIN_LOGPROB = -9999.0


class LogprobsRecorder:
    """Keeps each sequence's logprobs entries as its tokens arrive."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def entry(self, token_id: int, lp: TokenLogprobs) -> dict:
        return {"token_id": token_id, "token": self.token(token_id),
                "logprob": _finite(lp.logprob), "rank": lp.rank,
                "top_logprobs": [{"token_id": t, "token": self.token(t), "logprob": _finite(v)}
                                 for t, v in zip(lp.top_ids, lp.top_logprobs)]}

    def record(self, seq: Sequence, result: StepResult) -> None:
        """Adds this step's entries to a sequence that asked for them (after its token was
        appended; a token it did not keep, with max_tokens 0, gets none)."""
        lp = result.logprobs.get(seq.seq_id)
        if lp is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            if len(seq.logprobs) < seq.num_output_tokens:
                seq.logprobs.append(self.entry(seq.output_token_ids[-1], lp))
        prompt = result.prompt_logprobs.get(seq.seq_id)
        if prompt is not None and seq.prompt_logprobs is None:
            ids = seq.prompt_token_ids
            first = {"token_id": ids[0], "token": self.token(ids[0]), "logprob": None,
                     "rank": None, "top_logprobs": []}
            seq.prompt_logprobs = [first] + [self.entry(t, x) for t, x in zip(ids[1:], prompt)]

    @staticmethod
    def of_prompt(seq: Sequence, num_tokens: int) -> list[dict] | None:
        """A sequence's prompt logprobs, carried by its first token event (streamed echo)."""
        return seq.prompt_logprobs if num_tokens == 1 else None

    @staticmethod
    def in_events(seq: Sequence) -> tuple[str, ...]:
        """Which of a sequence's logprobs its token events carry whole: every token's entry
        (one each, in order), the prompt's on its first. The final record leaves those to the
        events, so that each is stored once."""
        out = ()
        if seq.logprobs and len(seq.logprobs) == seq.num_output_tokens:
            out += ("logprobs",)
        if seq.prompt_logprobs is not None and seq.prompt_logprobs_in_events:
            out += ("prompt_logprobs",)
        return out

    @staticmethod
    def of_token(seq: Sequence, num_tokens: int) -> list[dict] | None:
        """The entry of a sequence's token number `num_tokens` (1-based) for its token event."""
        if seq.logprobs is None or not 0 < num_tokens <= len(seq.logprobs):
            return None
        return [seq.logprobs[num_tokens - 1]]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB
