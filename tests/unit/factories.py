"""Small factories shared by the unit tests: sequences, a recording Celery stub, settings."""
from __future__ import annotations

import itertools
from typing import Any

from common.protocol import SamplingParams
from common.settings import Settings

EOS = 2            # the eos token id every factory-made sequence uses
_ids = itertools.count()


def make_params(**kw) -> SamplingParams:
    return SamplingParams(**kw)


def make_seq(n_prompt: int = 4, *, seq_id: str | None = None, max_tokens: int = 16,
             stop_token_ids: list[int] | None = None, stop: list[str] | None = None,
             min_tokens: int = 0, ignore_eos: bool = False, eos: tuple[int, ...] = (EOS,)):
    """A worker Sequence with `n_prompt` hand-made prompt token ids (100, 101, ...)."""
    from worker.sequence import Sequence

    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop_token_ids or []),
                            stop=list(stop or []), min_tokens=min_tokens, ignore_eos=ignore_eos)
    return Sequence(seq_id=seq_id or f"s{next(_ids)}",
                    prompt_token_ids=list(range(100, 100 + n_prompt)),
                    params=params, eos_token_ids=tuple(eos))


def make_manager(max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, policy=None):
    from worker.workload_manager import WorkloadManager

    return WorkloadManager(max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, policy=policy)


def ids(seqs) -> list[str]:
    return [s.seq_id for s in seqs]


def tokens_for(out, token: int = 7, **overrides: int) -> dict[str, int]:
    """One sampled token for every sequence of a step (prefill and decode), as the model returns."""
    toks = {s.seq_id: token for s in out.prefill + out.decode}
    toks.update(overrides)
    return toks


class RecordingCelery:
    """Stands in for the Celery client: records send_task calls instead of talking to a broker."""

    def __init__(self):
        self.calls: list[dict[str, Any]] = []

    def send_task(self, name, args=None, kwargs=None, **options):
        self.calls.append({"name": name, "args": list(args or []), "kwargs": kwargs, **options})
        return None


def make_settings(**overrides) -> Settings:
    """Defaults that do not depend on the environment (no LLMQ_* lookups)."""
    return Settings(**overrides)


class FakeStream:
    """What requests gives for a streamed POST: SSE in the HTTP chunks given (bench clients)."""

    status_code = 200

    def __init__(self, chunks: list[bytes], headers: dict | None = None):
        self.chunks, self.headers = chunks, headers or {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def iter_content(self, chunk_size=None):
        yield from self.chunks
