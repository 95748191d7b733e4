"""The llama.cpp backend: llama.cpp's kernels and KV cache over the GGUF file itself, behind
llmq's step protocol (LLMQ_BACKEND=llama_cpp).

One llama.cpp context holds every running sequence, each in its own sequence slot, all sharing
one pool of KV cells (llama.cpp's unified cache, counted by the workload manager); a step is
one `llama_decode` over a flat batch (a token each for the running sequences, whole prompts for
newcomers), so decode and prefill share one pass over the weights. A sequence that needs only
what llama.cpp's samplers do (greedy, temperature, top-k/p, min-p, seed, logit_bias, min_tokens)
is sampled in C by its own sampler chain (`sampling.py`), its logits never copied out;
the others (logprobs, structured output, penalties) have their logits copied and go through
llmq's own `Sampler`, as on the transformers backend.

A lone running sequence is decoded one token ahead (`run_ahead`, called by the model process
once a step's result is sent): its next token is ready when the engine asks for it, so the
engine's turn (pipe, update, schedule) overlaps the model instead of following it
(LLMQ_RUN_AHEAD). A multi-step request (`num_steps`, LLMQ_MULTI_STEP_WINDOW) decodes the running
batch several times in one step, each sequence sampled by its chain, so the engine's turn is paid
once for them all; newcomers cut it short at the next pass (CutShort, docs/architecture.md,
"Multi-step decode").
"""
from __future__ import annotations

import ctypes
import heapq
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from ...messages import NewSequence, StepRequest, StepResult
from ...model_manager import ModelInfo, ModelManager, eos_token_ids, generation_defaults
from ..backend import BackendUnavailable, ModelBackend, StepHooks
from ..sampler import Sampler, SamplingState, prompt_logprobs
from ..structured_output import Grammars
from .sampling import ChainSampler, needs_logits

log = logging.getLogger("llmq.llama_cpp")

DEFAULT_CONTEXT_PER_SEQUENCE = 2048
NONE, PROMPT, SAMPLE = 0, 1, 2   # what a batch row's logits are for


class LlamaCppBackend(ModelBackend):
    """Runs llmq steps as llama_decode calls over one multi-sequence llama.cpp context."""

    multi_step = True   # runs a request's num_steps decode passes back to back

    def __init__(self, lib, model, ctx, info: ModelInfo, max_num_seqs: int, n_batch: int,
                 runs_ahead: bool = True, hooks: StepHooks = StepHooks()):
        self.lib = lib
        self.model = model
        self.ctx = ctx
        self.mem = lib.llama_get_memory(ctx)
        self.info = info
        self.n_batch = n_batch
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        # The lowest free slot goes first (a heap), so the running sequences keep to a dense
        # run of slots: see _in_slot_order.
        self.free_slots = list(range(max_num_seqs))
        self.slots: dict[str, int] = {}         # seq_id -> llama.cpp sequence slot
        self.positions: dict[str, int] = {}     # seq_id -> tokens in its KV cache
        self.states: dict[str, SamplingState] = {}
        self.chains: dict[str, ChainSampler] = {}   # the sequences sampled in C
        self.runs_ahead = runs_ahead
        self.ahead: _Ahead | None = None   # a token decoded before it was asked for
        # logits copied out for llmq's Sampler, one row per sequence that needs them
        self.rows = np.empty((max_num_seqs, info.vocab_size), dtype=np.float32)
        self.sampler = Sampler(Grammars(lambda: self.tokenizer, info.eos_token_ids))
        self.tokenizer = None   # set by load(): structured output builds its grammars from it
        # hooks.another_pass is asked before each pass after a multi-step request's first
        self.hooks = hooks

    @classmethod
    def load(cls, settings, hooks: StepHooks = StepHooks()) -> "LlamaCppBackend":
        try:
            import llama_cpp as lib
        except ImportError as exc:
            raise BackendUnavailable(
                "LLMQ_BACKEND=llama_cpp but llama-cpp-python is not installed "
                "(make llama-cpp, or see docs/settings.md: Backends)") from exc
        mm = ModelManager.from_settings(settings)
        path = mm.gguf_file()
        _quiet(lib)
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        gpu = settings.device.startswith("cuda") or (
            settings.device == "auto" and lib.llama_supports_gpu_offload())
        mparams.n_gpu_layers = -1 if gpu else 0
        model = lib.llama_model_load_from_file(path.encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        n_ctx_train = int(lib.llama_model_n_ctx_train(model))
        # One pool of KV cells for all sequences, as many as max_num_seqs slots of
        # LLMQ_MAX_MODEL_LEN (default DEFAULT_CONTEXT_PER_SEQUENCE) held before; any one
        # sequence may use up to the model's context of it, so a long prompt beside short
        # ones is served instead of refused at its slot's size.
        pool = (settings.max_model_len or DEFAULT_CONTEXT_PER_SEQUENCE) * settings.max_num_seqs
        per_seq = min(n_ctx_train, settings.max_model_len or pool, pool)
        n_batch = max(settings.max_num_batched_tokens, per_seq)
        cparams = lib.llama_context_default_params()
        cparams.n_seq_max = settings.max_num_seqs
        # llama.cpp's unified KV cache: cells go to whichever sequence needs them. Attention
        # then spans every used cell, masked per sequence (its flash-attention kernel skips
        # the masked ones), the price of not fixing each sequence's share up front.
        cparams.kv_unified = True
        cparams.n_ctx = pool
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(512, n_batch)
        threads = settings.torch_threads or os.cpu_count() or 1
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            lib.llama_model_free(model)
            raise RuntimeError("llama.cpp could not create a context (out of memory?)")
        tok = mm.load_tokenizer()
        vocab = lib.llama_model_get_vocab(model)
        gen = mm.generation_config()
        eos = eos_token_ids(int(lib.llama_vocab_eos(vocab)), tok.eos_token_id,
                            getattr(gen, "eos_token_id", None))
        info = ModelInfo(
            name=settings.model, path=path, eos_token_ids=eos,
            max_model_len=per_seq, vocab_size=int(lib.llama_vocab_n_tokens(vocab)),
            device="cuda" if gpu else "cpu", dtype=_gguf_type(path),
            generation_defaults=generation_defaults(gen),
            kv_cache_dtype="float16", kernels="llama.cpp")   # (llama.cpp's default cache type)
        log.info("llama.cpp loaded %s: %d sequences sharing %d tokens of KV cache (up to %d "
                 "each), %d threads", path, settings.max_num_seqs, pool, per_seq, threads)
        backend = cls(lib, model, ctx, info, settings.max_num_seqs, n_batch,
                      _runs_ahead(settings.run_ahead, threads), hooks)
        # The workload manager admits and preempts by the pool's cells (a block is one cell:
        # llama.cpp places each token in any free cell), so the shared pool never overflows.
        backend.kv_capacity = (pool, 1)
        backend.tokenizer = tok
        return backend

    # --- a step -------------------------------------------------------------------------------
    def step(self, req: StepRequest, early=None) -> StepResult:   # answers in one piece
        res = StepResult()
        decode_ids, ahead_s = self._claim_ahead(req, res)
        for sid in req.free_seq_ids:
            self._free(sid)
        t0 = time.perf_counter()
        # Rows of the flat batch: (seq_id, token, position, logits), logits being NONE, PROMPT
        # (a prompt position scored for prompt logprobs) or SAMPLE (the row the next token
        # comes from: a running sequence's token, a newcomer's last prompt token).
        rows: list[tuple[str, int, int, int]] = []
        for sid in decode_ids:
            rows.append((sid, self.states[sid].last_token_id, self.positions[sid], SAMPLE))
        fresh: list[NewSequence] = []
        for seq in req.prefill:
            error = self._admit(seq)
            if error:
                res.errors[seq.seq_id] = error
                continue
            fresh.append(seq)
            n = len(seq.token_ids)
            every = PROMPT if seq.params.prompt_logprobs is not None else NONE
            rows += [(seq.seq_id, t, i, every) for i, t in enumerate(seq.token_ids[:-1])]
            rows.append((seq.seq_id, seq.token_ids[-1], n - 1, SAMPLE))
        rows.sort(key=self._in_slot_order)
        scored = {s.seq_id for s in fresh if s.params.prompt_logprobs is not None}
        prompt_rows: dict[str, list[np.ndarray]] = {}
        copied: list[str] = []   # sampled by llmq's Sampler from self.rows, in row order
        for start in range(0, len(rows), self.n_batch):
            chunk = [r for r in rows[start:start + self.n_batch] if r[0] not in res.errors]
            if not chunk:
                continue
            rc = self._decode(chunk)
            if rc != 0:
                self._fail_chunk(chunk, rc, res)
                continue
            best = _Argmax(self, chunk)
            for i, (sid, _tok, _pos, kind) in enumerate(chunk):
                if kind == NONE:
                    continue
                if sid in scored:
                    prompt_rows.setdefault(sid, []).append(self._logits(i).copy())
                if kind == PROMPT:
                    continue
                chain = self.chains.get(sid)
                if chain is not None:   # sampled where the logits are
                    self._emit(sid, chain.sample(self.ctx, i, lambda: best[i]), None, res)
                else:
                    self.rows[len(copied)] = self._logits(i)
                    copied.append(sid)
        for sid, _tok, _pos, _kind in rows:
            if sid in self.positions and sid not in res.errors:
                self.positions[sid] += 1
        for seq in fresh:
            if seq.seq_id in scored and seq.seq_id not in res.errors:
                res.prompt_logprobs[seq.seq_id] = prompt_logprobs(
                    torch.from_numpy(np.stack(prompt_rows[seq.seq_id])), seq.token_ids,
                    seq.params.prompt_logprobs)
        if copied:
            tokens, lps = self.sampler.sample(torch.from_numpy(self.rows[:len(copied)]),
                                              [self.states[sid] for sid in copied])
            for sid, tok, lp in zip(copied, tokens, lps):
                self._emit(sid, tok, lp, res)
        if req.num_steps > 1 and not req.prefill:
            self._more_passes(req, res)
        res.decode_s = time.perf_counter() - t0 + ahead_s
        return res

    def _more_passes(self, req: StepRequest, res: StepResult) -> None:
        """The passes after the first of a multi-step request: the running batch decoded again
        and again, in the one process, until each sequence ends (a stop token once min_tokens
        are out, or max_tokens) or the passes run out. The engine's turn (the result through
        the pipe, update, publish, schedule, the request back) is then paid once for them all,
        not once a token; at one sequence that turn was ~15 % of each token's time, on the
        cores llama.cpp's threads use. Only when every sequence is sampled by its C chain: a
        sequence sampled by llmq's Sampler decodes one pass a step."""
        live = [sid for sid in req.decode_seq_ids if sid in res.token_ids]
        if not live or any(sid not in self.chains for sid in live):
            return
        for _ in range(req.num_steps - 1):
            live = [sid for sid in live if not self.states[sid].ended]
            if not live or not self.hooks.another_pass():
                return
            rows = sorted(((sid, self.states[sid].last_token_id, self.positions[sid], SAMPLE)
                           for sid in live), key=self._in_slot_order)
            if self._decode(rows) != 0:
                # Keep the tokens made so far; the next step decodes from there (and fails
                # there, if llama.cpp refuses again).
                for sid, _tok, pos, _kind in rows:
                    self.lib.llama_memory_seq_rm(self.mem, self.slots[sid], pos, -1)
                return
            best = _Argmax(self, rows)
            for i, (sid, _tok, _pos, _kind) in enumerate(rows):
                tok = self.chains[sid].sample(self.ctx, i, lambda: best[i])
                self.positions[sid] += 1
                self.states[sid].record(tok)
                res.more_token_ids.setdefault(sid, []).append(tok)

    # --- running ahead ------------------------------------------------------------------------
    def run_ahead(self) -> None:
        """Decodes the next token of the only running sequence before the engine asks for it
        (the model process calls this once a step's result is sent). At one sequence a step
        is short, and the engine's turn between steps (the result through the pipe, update,
        schedule, the request back) would otherwise add to every token; running ahead hides
        it, as vLLM's async scheduling does. Not with more sequences: there the batch changes
        often, a token run ahead for a sequence that leaves is a wasted pass over the weights,
        and a newcomer's prefill could no longer share the decode's pass. Nor for a sequence
        sampled by llmq's Sampler (its state is not rewound), or one whose last token ends it;
        nor when LLMQ_RUN_AHEAD says not to (see _runs_ahead)."""
        if not self.runs_ahead or self.ahead is not None or len(self.slots) != 1:
            return
        (sid,) = self.slots
        chain, st = self.chains.get(sid), self.states[sid]
        if chain is None or st.ended:
            return
        t0 = time.perf_counter()
        pos = self.positions[sid]
        if self._decode([(sid, st.last_token_id, pos, SAMPLE)]) != 0:
            self.lib.llama_memory_seq_rm(self.mem, self.slots[sid], pos, -1)
            return   # the step asked for next decodes it again, and reports a failure
        tok = chain.sample(self.ctx, 0, lambda: int(self._logits(0).argmax()))
        self.ahead = _Ahead(sid, tok, time.perf_counter() - t0)

    def _claim_ahead(self, req: StepRequest, res: StepResult) -> tuple[list[str], float]:
        """The step's decode ids less the one whose token was run ahead (answered from it), and
        the seconds that took. A token run ahead that the step does not ask for (the sequence
        ended, was cancelled or preempted) is taken back: its KV cell and its sample."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return req.decode_seq_ids, 0.0
        sid = ahead.seq_id
        if sid in req.decode_seq_ids and sid not in req.free_seq_ids:
            self.positions[sid] += 1
            self._emit(sid, ahead.token_id, None, res)
            return [s for s in req.decode_seq_ids if s != sid], ahead.seconds
        if sid in self.slots:
            self.lib.llama_memory_seq_rm(self.mem, self.slots[sid], self.positions[sid], -1)
            self.chains[sid].unsample()
        return req.decode_seq_ids, 0.0

    def _in_slot_order(self, row) -> tuple[int, int]:
        """The batch's rows by slot, then position. The unified pool cuts a batch into plain
        runs of n_ubatch rows, whatever their order; were the cache split into one KV stream
        per sequence (kv_unified off), llama.cpp would cut it into micro-batches that hold only
        ascending runs of consecutive sequence ids (`split_equal`, sequential), each a pass
        over all the weights: in admission order a 16-sequence decode took up to 16 passes, in
        slot order one per run of consecutive slots."""
        return self.slots[row[0]], row[2]

    def _logits(self, row: int) -> np.ndarray:
        """A view of the batch row's logits in llama.cpp's buffer (valid until the next
        llama_decode)."""
        ptr = self.lib.llama_get_logits_ith(self.ctx, row)
        return np.ctypeslib.as_array(ptr, shape=(self.info.vocab_size,))

    def _emit(self, sid: str, tok: int, lp, res: StepResult) -> None:
        self.states[sid].record(tok)
        res.token_ids[sid] = tok
        if lp is not None:
            res.logprobs[sid] = lp

    def _admit(self, seq: NewSequence) -> str | None:
        """Gives a newcomer a slot and its sampling state; returns an error for it alone."""
        if len(seq.token_ids) >= self.info.max_model_len:
            return (f"ValueError: prompt of {len(seq.token_ids)} tokens exceeds the context of "
                    f"{self.info.max_model_len}")
        if not self.free_slots:
            return "RuntimeError: no free llama.cpp sequence slot"
        try:
            st = SamplingState.create(seq.params, seq.token_ids, seq.num_output_tokens,
                                      seq.stop_token_ids, "cpu")
            if any(t < 0 or t >= self.info.vocab_size for t in st.stop_token_ids):
                raise ValueError("a stop token id is outside the vocabulary")
            if seq.params.structured:   # compiled here, so a failure fails this sequence alone
                st.matcher = self.sampler.grammars.matcher(
                    seq.params.structured, self.info.vocab_size, st.output_token_ids)
        except Exception as exc:  # noqa: BLE001 - a bad sequence fails alone
            return f"{type(exc).__name__}: {exc}"
        if not needs_logits(seq.params):
            self.chains[seq.seq_id] = ChainSampler(self.lib, self.info.vocab_size, seq.params,
                                                   st.stop_token_ids, seq.num_output_tokens)
        self.slots[seq.seq_id] = heapq.heappop(self.free_slots)
        self.positions[seq.seq_id] = 0
        self.states[seq.seq_id] = st
        return None

    def _decode(self, chunk) -> int:
        b = self.batch
        for i, (sid, tok, pos, kind) in enumerate(chunk):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = self.slots[sid]
            b.logits[i] = kind != NONE
        b.n_tokens = len(chunk)
        return int(self.lib.llama_decode(self.ctx, b))

    def _fail_chunk(self, chunk, rc: int, res: StepResult) -> None:
        """A chunk llama.cpp refused: newcomers in it fail alone; a running sequence cannot be
        recovered in place, so the step fails and the executor restarts the model process."""
        sids = {sid for sid, *_ in chunk}
        if any(sid not in self.positions or self.positions[sid] > 0 for sid in sids):
            raise RuntimeError(f"llama_decode failed ({rc}) for running sequences")
        for sid in sids:
            res.errors[sid] = f"RuntimeError: llama_decode failed ({rc}): KV cache full?"
            self._free(sid)

    def _free(self, sid: str) -> None:
        slot = self.slots.pop(sid, None)
        if slot is None:
            return
        self.lib.llama_memory_seq_rm(self.mem, slot, -1, -1)
        heapq.heappush(self.free_slots, slot)
        self.positions.pop(sid, None)
        self.states.pop(sid, None)
        chain = self.chains.pop(sid, None)
        if chain is not None:
            chain.free()

    def warm_up(self) -> None:
        from common.protocol import SamplingParams

        warm = NewSequence("__warmup__", [1, 2, 3, 4], SamplingParams(temperature=0.0))
        self.step(StepRequest(prefill=[warm]))
        self.step(StepRequest(decode_seq_ids=["__warmup__"]))
        self.step(StepRequest(free_seq_ids=["__warmup__"]))


@dataclass(slots=True)
class _Ahead:
    """A token decoded ahead for a sequence, and the model time it took."""

    seq_id: str
    token_id: int
    seconds: float


class _Argmax:
    """The argmax of each row of a decoded chunk, found for all output rows at once in
    llama.cpp's logits buffer (contiguous, in batch order) when the first is asked for."""

    def __init__(self, backend: LlamaCppBackend, chunk):
        self.backend = backend
        self.chunk = chunk
        self.best: dict[int, int] | None = None

    def __getitem__(self, row: int) -> int:
        if self.best is None:
            out = [i for i, r in enumerate(self.chunk) if r[3] != NONE]
            b = self.backend
            buf = np.ctypeslib.as_array(b.lib.llama_get_logits(b.ctx),
                                        shape=(len(out), b.info.vocab_size))
            self.best = dict(zip(out, buf.argmax(axis=1).tolist()))
        return self.best[row]


def _runs_ahead(setting: str, threads: int) -> bool:
    """LLMQ_RUN_AHEAD: `auto` runs ahead when llama.cpp's threads leave a core to the serving
    stack. Running ahead overlaps the engine's turn with the decode; without a core of its own
    that turn only takes one from a llama.cpp thread, and the others wait at its barriers."""
    if setting != "auto":
        return setting == "on"
    return threads < len(os.sched_getaffinity(0))


def _gguf_type(path: str) -> str:
    """The weights' quantisation from the file name (Q4_1, Q8_0, F16 ...), for /healthz."""
    stem = os.path.basename(path).rsplit(".", 1)[0]
    return "gguf-" + stem.rsplit(".", 1)[-1].lower() if "." in stem else "gguf"


_LOG_CALLBACK = None


def _quiet(lib) -> None:
    """Routes llama.cpp's own chatter to Python logging at debug level (it prints to stderr)."""
    global _LOG_CALLBACK

    @lib.llama_log_callback
    def callback(level, text, _user):
        # ggml_log_level: 3 warn, 4 error; the rest (debug, info, continuation) is chatter.
        log.log(logging.WARNING if level in (3, 4) else logging.DEBUG, "%s",
                text.decode(errors="replace").rstrip())

    _LOG_CALLBACK = callback   # keep a reference: llama.cpp holds the pointer
    lib.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
