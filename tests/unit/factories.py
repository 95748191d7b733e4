"""Small factories shared by the unit tests: sequences, a recording Celery stub, settings."""
from __future__ import annotations

import itertools
from typing import Any

from common.protocol import SamplingParams
from common.settings import Settings
from worker.model.backend import ModelBackend

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


def make_manager(max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, policy=None,
                 long_prefill_tokens: int = 0, long_prefill_chunk: int = 0,
                 attention_context: int = 0):
    from worker.workload_manager import WorkloadManager

    return WorkloadManager(max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, policy=policy,
                           long_prefill_tokens=long_prefill_tokens,
                           long_prefill_chunk=long_prefill_chunk,
                           attention_context=attention_context)


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


# --- an engine without a model process ----------------------------------------------------------
WORDS = 1000       # WordTokenizer's vocabulary: token t (t != EOS) reads " w<t>"


class WordTokenizer:
    """A tokenizer whose every token is a word: decode([5, 6]) == " w5 w6" (EOS decodes to
    nothing, as a special token does), so a test can read a sequence's text from its ids."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join("" if t == EOS and skip_special_tokens else f" w{t}" for t in ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [int(w[1:]) for w in text.split()]}


class ScriptedBackend(ModelBackend):
    """A model backend that samples hand-made tokens: sequence s's output token number n is
    `script[s][n]`, FILLER past its script. It can fail one sequence (`errors`) or the whole
    step (`crash_at`, 1-based step numbers), and records every StepRequest it was sent. With
    `pass_s`, each decode pass reports that much model time; with `multi_step`, it runs a
    request's num_steps passes as the llama_cpp backend does (a sequence stops at a stop token
    once min_tokens are out, or at max_tokens)."""

    FILLER = 7

    def __init__(self, script: dict[str, list[int]] | None = None, max_model_len: int = 512,
                 crash_at: tuple[int, ...] = (), errors: dict[str, str] | None = None,
                 multi_step: bool = False, pass_s: float = 0.0):
        from worker.model_manager import ModelInfo

        self.info = ModelInfo(name="scripted", path="", eos_token_ids=(EOS,),
                              max_model_len=max_model_len, vocab_size=WORDS, device="cpu",
                              dtype="float32", generation_defaults={})
        self.script = script or {}
        self.crash_at = set(crash_at)
        self.errors = dict(errors or {})
        self.requests = []
        self.num_steps = 0
        self.multi_step = multi_step
        self.pass_s = pass_s
        self._made: dict[str, int] = {}   # output tokens each running sequence has
        self._seqs: dict = {}             # each running sequence's NewSequence

    def warm_up(self) -> None:
        pass

    def step(self, req, early=None):
        from worker.messages import StepResult

        self.requests.append(req)
        self.num_steps += 1
        if self.num_steps in self.crash_at:
            raise RuntimeError(f"scripted crash at step {self.num_steps}")
        for seq_id in req.free_seq_ids:
            self._made.pop(seq_id, None)
            self._seqs.pop(seq_id, None)
        res = StepResult()
        for new in req.prefill:
            self._made[new.seq_id] = new.num_output_tokens
            self._seqs[new.seq_id] = new
        for seq_id in [s.seq_id for s in req.prefill] + req.decode_seq_ids:
            if seq_id in self.errors:
                res.errors[seq_id] = self.errors[seq_id]
                continue
            res.token_ids[seq_id] = self._next(seq_id)
        res.decode_s = self.pass_s if req.decode_seq_ids else 0.0
        if self.multi_step and req.num_steps > 1 and not req.prefill:
            live = list(res.token_ids)
            for _ in range(req.num_steps - 1):
                live = [s for s in live if not self._ended(s)]
                if not live or not self.hooks.another_pass():
                    break
                for seq_id in live:
                    res.more_token_ids.setdefault(seq_id, []).append(self._next(seq_id))
                res.decode_s += self.pass_s
        if early is not None and req.prefill and req.decode_seq_ids:
            # the newcomers' first tokens go ahead of the decode, as the model worker sends them
            new = {s.seq_id for s in req.prefill}
            early(StepResult(token_ids={k: v for k, v in res.token_ids.items() if k in new},
                             errors={k: v for k, v in res.errors.items() if k in new},
                             partial=True))
            res.token_ids = {k: v for k, v in res.token_ids.items() if k not in new}
            res.errors = {k: v for k, v in res.errors.items() if k not in new}
        return res

    def _next(self, seq_id: str) -> int:
        n = self._made[seq_id]
        script = self.script.get(seq_id, [])
        self._made[seq_id] = n + 1
        return script[n] if n < len(script) else self.FILLER

    def _ended(self, seq_id: str) -> bool:
        """The last token ends the sequence (the engine's rule, as the llama_cpp backend has it)."""
        seq, n = self._seqs[seq_id], self._made[seq_id]
        script = self.script.get(seq_id, [])
        last = script[n - 1] if 0 < n <= len(script) else self.FILLER
        return n >= seq.params.max_tokens or (n >= seq.params.min_tokens
                                               and last in seq.stop_token_ids)


class LogprobsBackend(ScriptedBackend):
    """A ScriptedBackend that also gives logprobs, as a model process does: each sampled
    token's (with the `logprobs` alternatives its request asked for), and at prefill each
    prompt token's after the first (`prompt_logprobs`). Made-up numbers, fixed per token."""

    def step(self, req, early=None):
        from worker.messages import TokenLogprobs

        def entry(token_id: int, k: int) -> TokenLogprobs:
            return TokenLogprobs(-0.5 - token_id / 100, 2, [(token_id + j) % WORDS for j in
                                                            range(k)], [-0.1 * j for j in range(k)])

        res = super().step(req, None)   # (newcomers' tokens with the rest: they need their logprobs)
        for new in req.prefill:
            if new.params.prompt_logprobs is not None:
                res.prompt_logprobs[new.seq_id] = [entry(t, new.params.prompt_logprobs)
                                                   for t in new.token_ids[1:]]
        for seq_id, token_id in res.token_ids.items():
            k = self._seqs[seq_id].params.logprobs
            if k is not None:
                res.logprobs[seq_id] = entry(token_id, k)
        return res


def make_engine(store, backend=None, requeue=None, **settings):
    """An EngineCore over an in-process executor running `backend` (a ScriptedBackend by
    default), with the WordTokenizer; started (its model loaded), its loop not running."""
    from worker.engine_core import EngineCore
    from worker.inprocess_executor import InProcessExecutor

    backend = backend or ScriptedBackend()
    executor = InProcessExecutor(backend_factory=lambda: backend)
    executor.start()
    engine = EngineCore("w1", Settings(**settings), store, executor, WordTokenizer(),
                        requeue=requeue)
    engine.fit_to_model()   # as start() does
    return engine


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
