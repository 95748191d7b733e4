"""The transformers backend: llmq's own batched decode over a Hugging Face causal LM, with a
paged KV cache, a prefix cache, chunked prefill and the CPU kernels (the default backend)."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import torch

from common.test_hooks import HarnessHooks

from ...messages import NewSequence, StepRequest, StepResult
from ...model_manager import ModelManager
from ..backend import ModelBackend, StepHooks
from ..sampler import Sampler, SamplingState, scored_positions
from ..structured_output import Grammars
from . import cpu_kernels
from .kv_cache import PagedKVCache
from .llama_forward import LlamaForward
from .packed_linear import pack_linears
from .paged_attention import use_paged_attention
from .quantized_linear import MAX_ROWS as QUANT_MAX_ROWS, quantize_linears, resolve_quantization

log = logging.getLogger("llmq.model_worker")


class TransformersBackend(ModelBackend):
    """Runs prefill and batched decode steps of one model on one device."""

    multi_step = True   # runs a request's num_steps decode passes back to back

    def __init__(self, model, info, max_num_seqs: int, prefix_cache_bytes: int = 0,
                 kv_cache_bytes: int = 0, prefill_chunk: int = 2048, block_size: int = 8,
                 decode_kernel: bool = True, kv_cache_dtype: str = "auto",
                 layer_kernels: bool = True, prefill_pass_tokens: int = 0,
                 hooks: StepHooks = StepHooks()):
        self.model = model
        self.hooks = hooks
        self.info = info
        self.device = torch.device(info.device)
        use_paged_attention(model)
        module = (cpu_kernels.load() if self.device.type == "cpu"
                  and (decode_kernel or layer_kernels) else None)
        kernel = module.decode_attention if module and decode_kernel and kernel_fits(model) \
            else None
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, model.dtype, self.device,
                                         kernel is not None)
        block_bytes = kv_bytes_per_token(model, self.kv_dtype) * block_size
        budget = kv_cache_bytes or auto_kv_budget(self.device, block_bytes // block_size
                                                  * max_num_seqs * info.max_model_len)
        self.cache = PagedKVCache(max(1, budget // block_bytes), block_size, max_num_seqs,
                                  prefix_blocks=prefix_cache_bytes // block_bytes,
                                  max_group_slots=decode_group_slots(model, self.device),
                                  device=self.device, dtype=self.kv_dtype)
        self.cache.decode_kernel = kernel
        # A sequence is never longer than the cache (the engine caps max_tokens by this), so
        # preempting the others always leaves room for the oldest one.
        capacity = self.cache.num_blocks * block_size
        if capacity < info.max_model_len:
            self.info = dataclasses.replace(info, max_model_len=capacity)
        self.prefill_chunk = max(1, prefill_chunk)
        self.prefill_pass_tokens = prefill_pass_tokens   # 0: a step's newcomers in one pass
        self.prefilling: dict[str, NewSequence] = {}   # joined, prompt not all computed yet
        # The prompt logprobs of the chunks computed so far, of each scored prompt still being
        # computed: a scored prompt is chunked like any other, and answered at its last chunk.
        self.scored: dict[str, list] = {}
        self.states: dict[str, SamplingState] = {}
        self.sampler = Sampler(Grammars(lambda: ModelManager(info.path).load_tokenizer(),
                                        info.eos_token_ids))
        # Before each decoder layer, `hooks.between_layers` may run an interjection that has
        # arrived (a better priority's prefill, its own pass, docs/batches.md); never inside
        # an interjection's own pass.
        self._interjecting = False
        self._interjected_s = 0.0   # time spent in interjections, left out of the step's timing
        layers = decoder_layers(model)
        for layer in layers:
            layer.register_forward_pre_hook(self._before_layer)
        self.interjects = bool(layers)
        # Llama-architecture models run our own written-out forward (same ops, same logits,
        # without transformers' per-call plumbing; it fuses q/k/v and gate/up in the model);
        # others transformers' forward.
        self.llama = LlamaForward.for_model(model, lambda: self._before_layer(None, None),
                                            module if layer_kernels else None)
        layer_ops = bool(self.llama and self.llama.kernels)
        # (the module may be loaded with neither kernel running: a model whose shapes the
        # decode kernel does not handle, with layer ops off or not a Llama)
        wide = (module is not None and (kernel is not None or layer_ops) and module.wide_ops()
                and model.dtype == torch.bfloat16)
        kernels = (f"decode attention: {'gather + SDPA' if kernel is None else 'C++ kernel'}, "
                   f"layer ops: {'C++ (fused)' if layer_ops else 'torch'}"
                   + ("; bfloat16 kernels on AVX512-BF16" if wide else ""))
        self.info = dataclasses.replace(self.info, kernels=kernels,
                                        kv_cache_dtype=str(self.kv_dtype).split(".")[-1])
        log.info("KV cache: %d blocks of %d tokens (%d MiB, %s), %s", self.cache.num_blocks,
                 block_size, self.cache.num_blocks * block_bytes >> 20,
                 self.info.kv_cache_dtype, kernels)

    @classmethod
    def load(cls, settings, hooks: StepHooks = StepHooks()) -> "TransformersBackend":
        model, info = ModelManager.from_settings(settings).load_model(settings.device, settings.dtype)
        if settings.max_model_len:
            info = dataclasses.replace(info, max_model_len=min(info.max_model_len,
                                                               settings.max_model_len))
        worker = cls(model, info, settings.max_num_seqs, settings.prefix_cache_mb << 20,
                     settings.kv_cache_mb << 20, settings.max_num_batched_tokens,
                     decode_kernel=settings.decode_kernel,
                     kv_cache_dtype=settings.kv_cache_dtype,
                     layer_kernels=settings.layer_kernels,
                     prefill_pass_tokens=settings.prefill_pass_tokens, hooks=hooks)
        fail_seed = HarnessHooks.from_env().fail_seed   # None unless the test harness set it
        if fail_seed is not None:
            log.warning("LLMQ_TEST_FAIL_SEED=%d: sequences with that seed fail (a test hook)",
                        fail_seed)
            worker.fail_seed = fail_seed
        # After the worker is built: its LlamaForward fuses q/k/v and gate/up first, and the
        # fused linears are quantized and packed as one. Quantized first: packing then packs
        # the float layers the quantized ones keep for large steps.
        mode = resolve_quantization(settings.quantization, model.dtype)
        if mode != "none" and info.device == "cpu":
            done = quantize_linears(model, mode, cpu_kernels.load())
            log.info("%s weights for %d linear layers at steps of up to %d rows", mode, done,
                     QUANT_MAX_ROWS[mode])
            if done:
                worker.info = dataclasses.replace(
                    worker.info, kernels=f"{worker.info.kernels}; linears: {mode} weights at "
                                         f"up to {QUANT_MAX_ROWS[mode]} rows")
        if settings.packed_linears and info.device == "cpu":
            log.info("packed %d linear layers for oneDNN", pack_linears(model))
        return worker

    @property
    def kv_capacity(self) -> tuple[int, int]:
        """(blocks, tokens per block): what the workload manager may fill."""
        return self.cache.num_blocks, self.cache.block_size

    @torch.inference_mode()
    def step(self, req: StepRequest, early: Callable[[StepResult], None] | None = None
             ) -> StepResult:
        """Frees, lets the newcomers join, prefills the newcomers' prompts in passes of about
        `prefill_pass_tokens` (one when they are fewer), then decodes the running batch; the
        next chunk of every prompt still being computed (`req.chunks` tokens of it, else
        `prefill_chunk`) rides in the decode's pass, or in the prefill when nothing decodes.
        Each prefill pass's first tokens go out through `early` as a partial result as soon as
        it ends, while anything is left to run (another pass, the decode), so a newcomer's
        time to first token includes neither the batch's decode nor the later newcomers'
        passes. A sequence whose prompt is longer than its chunk gets its first token at the
        step that computes its last chunk; the steps before answer nothing for it, while the
        others decode."""
        res = StepResult()
        if req.free_seq_ids:
            self.cache.remove(req.free_seq_ids)
            for sid in req.free_seq_ids:
                self.states.pop(sid, None)
                self.prefilling.pop(sid, None)
                self.scored.pop(sid, None)
        missing = [s for s in req.decode_seq_ids if s not in self.cache.tables]
        if missing:
            raise RuntimeError(f"asked to decode {len(missing)} sequences the cache does not hold")
        decode_ids = [s for s in req.decode_seq_ids if s not in self.prefilling]
        t0, lent0 = time.perf_counter(), self._interjected_s
        for seq in req.prefill:
            self._join(seq, res)
        newcomers = {s.seq_id for s in req.prefill}
        chunks = {sid: min(req.chunks.get(sid, self.prefill_chunk),
                           len(seq.token_ids) - self.cache.lengths[sid])
                  for sid, seq in self.prefilling.items()}
        # An interjection computes its newcomers alone: the prompts still being computed
        # chunk by chunk belong to the step it interrupts, which has sized their chunks.
        todo = [s for s in self.prefilling.values() if chunks[s.seq_id]
                and (s.seq_id in newcomers or not req.interject)]
        # A running prompt's chunk joins the decode's pass: a pass has a fixed cost about as
        # big as a 32-row decode's, so one pass instead of two keeps the decodes' step short
        # while a long prompt is computed beside them (docs/architecture.md, "Long prompts beside
        # a decoding batch").
        riding = [s for s in todo if s.seq_id not in newcomers] if decode_ids else []
        first = [s for s in todo if s not in riding]
        # (An interjection answers in one piece: its partials would read as the step's.)
        groups = _passes(first, chunks, 0 if req.interject else self.prefill_pass_tokens)
        for i, group in enumerate(groups):
            self._prefill(group, res, chunks)
            # Each pass's first tokens go out as it ends, while anything is left to run: a
            # wave of newcomers gets its first tokens pass by pass, not all at the last one.
            if early is not None and (i + 1 < len(groups) or decode_ids):
                res = _send_ahead(res, newcomers, early)
        t1, lent1 = time.perf_counter(), self._interjected_s
        res.prefill_s = t1 - t0 - (lent1 - lent0)
        if early is not None and decode_ids and not groups:
            res = _send_ahead(res, newcomers, early)   # (newcomers that failed to join)
        if decode_ids:
            self._decode(decode_ids, res, riding, chunks)
            if req.num_steps > 1 and not req.prefill and not riding:
                self._more_passes(decode_ids, req.num_steps - 1, res)
        res.decode_s = time.perf_counter() - t1 - (self._interjected_s - lent1)
        res.interjected = req.interject
        return res

    def _before_layer(self, _module, _args) -> None:
        """A decoder layer's forward pre-hook: the place a step in flight lets an
        interjection run (its pass touches only its own rows, blocks and the shared scratch,
        which the layer before has finished with)."""
        if self.hooks.between_layers is None or self._interjecting:
            return
        self._interjecting = True
        t = time.perf_counter()
        try:
            self.hooks.between_layers()
        finally:
            self._interjecting = False
            self._interjected_s += time.perf_counter() - t

    def _join(self, seq: NewSequence, res: StepResult) -> None:
        """A newcomer takes a row and its cached prefix blocks; nothing is computed yet."""
        try:
            if len(seq.token_ids) > self.info.max_model_len:
                raise ValueError(f"prompt of {len(seq.token_ids)} tokens exceeds the model's "
                                 f"context of {self.info.max_model_len}")
            # Prompt logprobs need the logits of every prompt position: no cached prefix.
            blocks = (self.cache.prefix.match(seq.token_ids, seq.params.cache_salt)
                      if seq.params.prompt_logprobs is None else [])
            self.cache.add(seq.seq_id, blocks)
        except Exception as exc:  # noqa: BLE001 - this newcomer alone fails
            res.errors[seq.seq_id] = f"{type(exc).__name__}: {exc}"
            log.warning("prefill failed: %s", exc, extra={"seq_id": seq.seq_id})
            return
        self.prefilling[seq.seq_id] = seq
        if seq.params.prompt_logprobs is not None:
            self.scored[seq.seq_id] = []
        if blocks:
            res.cached_tokens[seq.seq_id] = len(blocks) * self.cache.block_size

    def _prefill(self, seqs: list[NewSequence], res: StepResult, chunks: dict[str, int]) -> None:
        """One pass over the next chunk of each prompt (`chunks`: its tokens); a failing pass
        is retried one sequence at a time, so a poison sequence fails alone."""
        try:
            self._prefill_pass(seqs, res, chunks)
        except Exception as exc:  # noqa: BLE001 - isolate the poison sequence, keep the rest
            if len(seqs) > 1:
                for seq in seqs:
                    self._prefill([seq], res, chunks)
                return
            sid = seqs[0].seq_id
            res.errors[sid] = f"{type(exc).__name__}: {exc}"
            log.warning("prefill failed: %s", exc, extra={"seq_id": sid})
            self._drop(sid)

    def _prefill_pass(self, seqs: list[NewSequence], res: StepResult,
                      sizes: dict[str, int], decode_ids: list[str] = ()) -> None:
        """The prompts' chunks (and one token of each of `decode_ids`) in one forward pass."""
        by_id = {s.seq_id: s for s in seqs}
        chunks = [(s.seq_id, sizes[s.seq_id]) for s in seqs]
        done = {sid for sid, n in chunks if self.cache.lengths[sid] + n == len(by_id[sid].token_ids)}
        states = {sid: SamplingState.create(by_id[sid].params, by_id[sid].token_ids,
                                            by_id[sid].num_output_tokens,
                                            by_id[sid].stop_token_ids, self.device)
                  for sid in done}
        # A failed pass leaves the blocks it got in the tables: a retry reuses them.
        plan = self.cache.plan(chunks + [(sid, 1) for sid in decode_ids])
        # A scored prompt's chunk keeps the logits of each of its positions: position i's
        # scores token i + 1 (the chunk's last scores the next chunk's first).
        scoring = {sid for sid in by_id if sid in self.scored}
        logits, order, full = self._forward(
            plan, lambda r: (by_id[r.seq_id].token_ids[r.num_past:r.length] if r.seq_id in by_id
                             else [self.states[r.seq_id].last_token_id]),
            done | set(decode_ids), scoring)
        past = {r.seq_id: r.num_past for r in plan.rows}
        scored = {}
        for sid, row_logits in full.items():
            seq = by_id[sid]
            targets = seq.token_ids[past[sid] + 1:past[sid] + 1 + len(row_logits)]
            scored[sid] = scored_positions(row_logits[:len(targets)], targets,
                                           seq.params.prompt_logprobs)
        self.cache.commit(plan)
        for sid, entries in scored.items():
            self.scored[sid] += entries
            if sid in done:
                res.prompt_logprobs[sid] = self.scored.pop(sid)
        if not order:
            return
        finished = [by_id[sid] for sid in order if sid in by_id]
        self.states.update(states)
        for seq in finished:
            self.prefilling.pop(seq.seq_id)
            self.cache.register_prompt(seq.seq_id, seq.token_ids, seq.params.cache_salt)
        try:
            self._sample(order, [self.states[sid] for sid in order], logits, res)
        except Exception as exc:  # noqa: BLE001 - e.g. a stop token id outside the vocabulary
            log.warning("sampling a prefill group failed, retried one by one: %s", exc)
            for i, sid in enumerate(order):
                try:
                    self._sample([sid], [self.states[sid]], logits[i:i + 1], res)
                except Exception as one:  # noqa: BLE001 - this sequence alone fails
                    res.errors[sid] = f"{type(one).__name__}: {one}"
                    res.token_ids.pop(sid, None)
                    self._drop(sid)

    def _decode(self, seq_ids: list[str], res: StepResult, riding: list[NewSequence] = (),
                chunks: dict[str, int] | None = None) -> None:
        """One token of each decoding sequence, with the chunks of the prompts `riding` in the
        same pass; if that pass fails, the chunks run alone (a poison prompt fails alone)
        and the decode after them."""
        if riding:
            try:
                return self._prefill_pass(riding, res, chunks, seq_ids)
            except Exception as exc:  # noqa: BLE001 - retried apart, so the batch goes on
                log.warning("a decode with prompt chunks failed, retried apart: %s", exc)
                self._prefill(riding, res, chunks)
        plan = self.cache.plan([(s, 1) for s in seq_ids])
        logits, order, _ = self._forward(plan, lambda r: [self.states[r.seq_id].last_token_id],
                                         set(seq_ids))
        self.cache.commit(plan)
        self._sample(order, [self.states[s] for s in order], logits, res)

    def _more_passes(self, seq_ids: list[str], passes: int, res: StepResult) -> None:
        """The passes after the first of a multi-step request (vLLM's multi-step scheduling):
        the running batch decoded again, up to `passes` times, each sequence until its last
        token ends it, the tokens into `more_token_ids`. The engine's turn (the result through
        the pipe, update, publish, schedule, the request back) is then paid once for them all;
        at one sequence it took ~2 ms of CPU per token, from the cores the model's threads
        use. Not for a sequence that wants logprobs (only the first pass's travel): such a
        batch decodes one pass a step."""
        live = [s for s in seq_ids if s in res.token_ids]
        if any(self.states[s].params.logprobs is not None for s in live):
            return
        for _ in range(passes):
            live = [s for s in live if not self.states[s].ended]
            if not live or not self.hooks.another_pass():
                return
            more = StepResult()
            self._decode(live, more)
            for sid, tok in more.token_ids.items():
                res.more_token_ids.setdefault(sid, []).append(tok)

    def _forward(self, plan, tokens_of, want: set[str], full: set[str] = frozenset()
                 ) -> tuple[torch.Tensor, list[str], dict[str, torch.Tensor]]:
        """The model over the plan's rows as one flat row of tokens (`tokens_of(row)`: the
        row's new token ids). Returns the next-token logits of the rows in `want` whose last
        token this pass computes, and their ids, in plan order. The 4-D placeholder mask tells
        transformers a mask exists already (it builds none, and would otherwise take the flat
        row for packed sequences); paged attention ignores it. Rows in `full` also get the
        logits of every position this pass computes (prompt logprobs), by id."""
        ids, pos, keep, order, spans = [], [], [], [], []
        for r in plan.rows:
            start = len(ids)
            ids += tokens_of(r)
            pos += range(r.num_past, r.length)
            if r.seq_id in want:
                keep.append(len(ids) - 1)
                order.append(r.seq_id)
            if r.seq_id in full:
                spans.append((r.seq_id, start, len(ids)))
        extra = [i for _sid, a, b in spans for i in range(a, b)]
        dev = self.device
        ids_t, pos_t = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
        kept = torch.tensor((keep or [len(ids) - 1]) + extra, device=dev)
        if self.llama is not None:
            logits = self.llama(ids_t, pos_t, plan, kept)
        else:
            logits = self.model(input_ids=ids_t[None], position_ids=pos_t[None],
                                attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool,
                                                          device=dev),
                                kv_plan=plan, use_cache=False, logits_to_keep=kept).logits[0]
        rows, at = {}, max(1, len(keep))
        for sid, a, b in spans:
            rows[sid] = logits[at:at + b - a]
            at += b - a
        return logits[:len(order)], order, rows

    def _drop(self, seq_id: str) -> None:
        self.cache.remove([seq_id])
        self.prefilling.pop(seq_id, None)
        self.scored.pop(seq_id, None)
        self.states.pop(seq_id, None)

    fail_seed: int | None = None   # tests only (LLMQ_TEST_FAIL_SEED)

    def _sample(self, seq_ids, states, logits, res: StepResult) -> None:
        if self.fail_seed is not None and any(st.params.seed == self.fail_seed for st in states):
            raise RuntimeError(f"a failure injected for tests (LLMQ_TEST_FAIL_SEED={self.fail_seed})")
        tokens, logprobs = self.sampler.sample(logits, states)
        for sid, st, tok, lp in zip(seq_ids, states, tokens, logprobs):
            st.record(tok)
            res.token_ids[sid] = tok
            if lp is not None:
                res.logprobs[sid] = lp

    def warm_up(self) -> None:
        """One prefill and a few decode steps, so the first request meets warm kernels."""
        from common.protocol import SamplingParams

        warm = NewSequence("__warmup__", [1, 2, 3, 4], SamplingParams(temperature=0.0))
        self.step(StepRequest(prefill=[warm]))
        for _ in range(2):
            self.step(StepRequest(decode_seq_ids=["__warmup__"]))
        self.step(StepRequest(free_seq_ids=["__warmup__"]))


def _passes(seqs: list[NewSequence], chunks: dict[str, int], cap: int
            ) -> list[list[NewSequence]]:
    """The newcomers' prefill cut into passes of about `cap` tokens, in order and evenly (900
    tokens under a cap of 512: two of 450), so the first of them get their first tokens early.
    Why not smaller: each pass costs about as much again as a 32-row decode's (the weights,
    per layer), so a pass of a few hundred tokens is as small as pays (measured:
    docs/architecture.md, "A wave of newcomers")."""
    total = sum(chunks[s.seq_id] for s in seqs)
    if not seqs or cap <= 0 or total <= cap:
        return [seqs] if seqs else []
    per = total / -(-total // cap)
    out: list[list[NewSequence]] = [[]]
    done = 0
    for s in seqs:
        if out[-1] and done + chunks[s.seq_id] / 2 > per * len(out):
            out.append([])
        out[-1].append(s)
        done += chunks[s.seq_id]
    return out


def _send_ahead(res: StepResult, newcomers: set[str], early) -> StepResult:
    """Sends the first tokens (and errors) newcomers have so far through `early` as a partial
    result; returns the rest of the step's result: the running batch's, and whatever is still
    to come for the other newcomers (their cached-token counts wait with them)."""
    answered = {s for s in newcomers if s in res.token_ids or s in res.errors}

    def part(d: dict, mine: bool) -> dict:
        return {s: v for s, v in d.items() if (s in answered) == mine}

    if not answered:
        return res
    early(StepResult(token_ids=part(res.token_ids, True), errors=part(res.errors, True),
                     cached_tokens=part(res.cached_tokens, True), prefill_s=res.prefill_s,
                     partial=True, logprobs=part(res.logprobs, True),
                     prompt_logprobs=part(res.prompt_logprobs, True)))
    return StepResult(token_ids=part(res.token_ids, False), errors=part(res.errors, False),
                      cached_tokens=part(res.cached_tokens, False), prefill_s=res.prefill_s,
                      logprobs=part(res.logprobs, False),
                      prompt_logprobs=part(res.prompt_logprobs, False))


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers, in order (its ModuleList as long as the config's layer
    count); [] when there is none to find, and then nothing interjects."""
    n = model.config.get_text_config().num_hidden_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return list(module)
    return []


def kv_bytes_per_token(model, dtype: torch.dtype | None = None) -> int:
    """Keys and values of one token over all layers, after the model's config, stored in
    `dtype` (None: the model's)."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    itemsize = (dtype or next(model.parameters()).dtype).itemsize
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * itemsize


# The keys and values one decode group gathers per layer, on CPU: small enough to stay in a
# core's L2 until the group's attention reads them back. At 64 rows of ~250 tokens (bf16
# SmolLM2-135M on the Xeon, one thread, alternated in one process) a step took ~10% less
# CPU time with groups of 1,024 slots than with one or two groups of all 64 rows.
DECODE_GROUP_BYTES = 768 << 10


def kernel_fits(model) -> bool:
    """Whether worker/model/transformers/decode_attention.cpp handles the model's attention shapes (up to 8 query
    heads per kv head, head dim a multiple of 8) and dtype."""
    cfg = model.config.get_text_config()
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rep, odd = divmod(cfg.num_attention_heads, kv_heads)
    return (not odd and 1 <= rep <= 8 and dim % 8 == 0
            and model.dtype in (torch.float32, torch.bfloat16, torch.float16))


KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device,
                     kernel: bool) -> torch.dtype:
    """The KV cache's dtype for LLMQ_KV_CACHE_DTYPE. `model` is the model's dtype (vLLM's
    "auto"). `auto` is that too, except float16 for a float32 model on a CPU whose decode rows
    the kernel attends: the kernel's time is reading the cache (it is memory-bound), float16
    halves the bytes, and llama.cpp keeps its cache in float16 by default; without the kernel
    every read would be a conversion back to float32, so the model's dtype stays. float16 keeps
    11 significant bits of each key and value (bfloat16, which bf16 models run, keeps 8);
    bench.quality's guard compares the served greedy tokens with a float32 cache's."""
    if name == "model" or (name == "auto" and not (
            device.type == "cpu" and kernel and model_dtype == torch.float32)):
        return model_dtype
    if name == "auto":
        return torch.float16
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}")
    return KV_CACHE_DTYPES[name]


def decode_group_slots(model, device: torch.device) -> int | None:
    """The most slots one decode group may span (None: no limit; on a GPU, larger is better).
    In the model's bytes, whatever the cache's dtype: a group's keys and values are gathered
    into the model's dtype (a float16 cache under a float32 model is widened as it is read),
    and it is the gathered copy that must stay in L2 until attention reads it."""
    if device.type != "cpu":
        return None
    per_layer = kv_bytes_per_token(model) // model.config.get_text_config().num_hidden_layers
    return max(1, DECODE_GROUP_BYTES // per_layer)


# Of the memory free once the model is loaded, what the KV cache takes by default. A GPU's
# memory is the model process's alone (vLLM's gpu_memory_utilization takes 0.9 of all of it),
# less room for a step's activations and the allocator's slack; a CPU's is shared with Redis,
# the API, the worker and whatever else runs on the host.
KV_FREE_FRACTION = {"cuda": 0.8, "cpu": 0.4}


def auto_kv_budget(device: torch.device, most_ever: int, fraction: float | None = None) -> int:
    """Bytes for the KV cache when LLMQ_KV_CACHE_MB is not set: `fraction` (the device's
    KV_FREE_FRACTION) of the memory free now (the model is loaded), as vLLM's
    gpu_memory_utilization; never more than the batch could ever fill (`most_ever`: every
    row at the model's full context)."""
    if fraction is None:
        fraction = KV_FREE_FRACTION.get(device.type, KV_FREE_FRACTION["cpu"])
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    return max(1, min(int(free * fraction), most_ever))
