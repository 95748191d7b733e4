"""A sequence inside the worker: an explicit state machine over plain counters."""
from __future__ import annotations

import enum
import functools
import threading
import time
from dataclasses import dataclass, field

from common.protocol import FinishReason, SamplingParams

from .detokenizer import IncrementalDetokenizer
from .stop_strings import StopStringMatcher


class SequenceState(enum.Enum):
    WAITING = "waiting"     # accepted by this worker, not yet in the batch
    RUNNING = "running"     # in the batch, its KV cache lives in the model worker
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One prompt being generated: token ids, sampling, counters, and how it ended."""

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    state: SequenceState = SequenceState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    # The text streamed so far, in pieces (see `text`).
    _text: list[str] = field(default_factory=list, repr=False)
    pending_text: str = ""            # decoded but held back while it may begin a stop string
    is_cut_at_stop: bool = False      # the text reached a stop string (the output processor ends it)
    first_token_time: float | None = None
    num_restarts: int = 0             # model-process crashes survived
    num_preemptions: int = 0          # times sent back to wait for KV cache blocks
    num_cached_tokens: int = 0        # prompt tokens whose keys/values the prefix cache gave
    created_at: float | None = None   # wall clock: when the API accepted it
    admitted_at: float | None = None  # wall clock: when this worker started it
    deadline: float | None = None     # wall clock: past it, the sequence ends with "timeout"
    owner: str = ""                   # the API key's owner id: the workload manager's fair share
    priority: int = 0                 # its Celery priority, 0 (first) .. 9 (batch lines' default)
    logprobs: list[dict] | None = None          # one entry per output token, when asked for
    prompt_logprobs: list[dict] | None = None   # one per prompt token (echo)
    prompt_logprobs_in_events: bool = False     # its first token event carried them
    # This copy's run of its record: set at admission, the start (attempt) its writes are
    # fenced on, and whether it is closed: its end written, or given up (dropped for a newer
    # start, handed back). A closed copy writes nothing more.
    attempt: int | None = None
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)
    is_closed: bool = False
    done: threading.Event = field(default_factory=threading.Event)   # its task thread waits
    _stops: StopStringMatcher | None = field(default=None, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.state is SequenceState.FINISHED

    @property
    def text(self) -> str:
        """The text streamed so far; the final text when finished. Kept in pieces and joined
        when read (once, at the end): `self.text += piece` copied the whole text at every
        token, a cost per step that grew with the length."""
        if len(self._text) > 1:
            self._text[:] = ["".join(self._text)]
        return self._text[0] if self._text else ""

    @functools.cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """Tokens that end this sequence (EOS unless ignored, plus the request's own); made
        once, as a set, since the output processor looks every token up in it."""
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return frozenset(eos) | frozenset(self.params.stop_token_ids)

    def append_token(self, token_id: int) -> None:
        """Records a sampled token. Whether it ends the sequence is the output processor's
        call (`output_processor.end_on_token`)."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if self.params.max_tokens:   # max_tokens 0: prompt logprobs only (echo), not kept
            self.output_token_ids.append(token_id)

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        if self.is_finished:
            return
        self.state = SequenceState.FINISHED
        self.finish_reason = reason
        self.error = error

    def add_text(self, delta: str, final: bool = False) -> str:
        """Takes newly decoded text and returns the part that may be streamed now.

        With stop strings, a tail that could be the start of one is held back, and the text is
        cut just before a stop string when one appears (`is_cut_at_stop`: the output processor
        ends the sequence). `final` releases whatever is held back. The streamed pieces always add up to `self.text`.
        The matcher reads only `delta`, so the cost per token does not grow with what is held.
        """
        if not self.params.stop:
            self._text.append(delta)
            return delta
        if self._stops is None:
            self._stops = StopStringMatcher(self.params.stop)
        buf = self.pending_text + delta
        # Stop strings count only once min_tokens are out (vLLM: len(output) > min_tokens)
        min_tokens = self.params.min_tokens
        hit = self._stops.feed(delta, stop=not min_tokens
                               or len(self.output_token_ids) > min_tokens)
        if hit is not None:
            end, length = hit
            emit, self.pending_text = buf[:len(self.pending_text) + end - length], ""
            self.is_cut_at_stop = True
        elif final:
            emit, self.pending_text = buf, ""
        else:
            keep = self._stops.held
            emit, self.pending_text = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self._text.append(emit)
        return emit
