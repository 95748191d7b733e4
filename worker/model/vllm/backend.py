"""The vLLM backend: vLLM's own engine (paged attention, its kernels, its sampler) behind llmq's
step protocol (LLMQ_BACKEND=vllm; `make vllm`).

Who does what (docs/architecture.md, "vLLM behind llmq"): llmq's workload manager decides who
runs (priorities, fair share, cancel, preemption) and admits no more than vLLM's KV cache holds,
which it learns from the Ready message; so every request llmq hands vLLM runs at once and vLLM's
own waiting queue stays empty. One llmq step is one `LLMEngine.step()`: vLLM decodes every
running request by one token and advances prompts by a chunk, and the result carries whatever
tokens that step made. A prompt still being prefilled in chunks answers nothing, as on the
transformers backend; tokens beyond one per step (speculative decoding) wait in a buffer.

vLLM samples (seeded per request, so a seed gives the same text whatever shares the batch),
computes logprobs and constrains structured output (llguidance, as llmq's own sampler); llmq stops sequences (EOS, stop tokens, stop strings, max_tokens) and frees
them, which aborts the request in vLLM. The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0): the model process is already the process that isolates the
model from the Celery worker, a daemonic process may not start children, and a second process
would be one more hop per step and one more orphan when the worker is killed.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque

from ...messages import NewSequence, StepRequest, StepResult, TokenLogprobs
from ...model_manager import ModelInfo, ModelManager, eos_token_ids, generation_defaults
from ..backend import BackendUnavailable, ModelBackend, StepHooks

log = logging.getLogger("llmq.vllm")

DEFAULT_CPU_KV_CACHE_GIB = 4   # VLLM_CPU_KVCACHE_SPACE when neither it nor LLMQ_KV_CACHE_MB is set


class VllmBackend(ModelBackend):
    """Adapts vllm.LLMEngine (its engine core in this process) to StepRequest/StepResult."""

    def __init__(self, engine, info: ModelInfo, kv_capacity: tuple[int, int]):
        self.engine = engine
        self.info = info
        self.kv_capacity = kv_capacity     # (blocks, tokens per block): llmq fills no more
        self.buffers: dict[str, deque[int]] = {}   # tokens made, not yet handed out
        self.seen: dict[str, int] = {}             # output tokens of each request read so far
        self.logprobs: dict[str, deque[TokenLogprobs]] = {}   # with the buffered tokens
        self.k: dict[str, int | None] = {}           # top logprobs each request asked for
        self.prompt_logprobs: dict[str, int] = {}   # k, for requests that asked (until read)

    @classmethod
    def load(cls, settings, hooks: StepHooks = StepHooks()) -> "VllmBackend":
        """(vLLM neither interjects nor runs multi-step requests: it uses no hook.)"""
        _configure_env(settings)
        try:
            from vllm import EngineArgs, LLMEngine
            from vllm.config import StructuredOutputsConfig
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise BackendUnavailable(
                "LLMQ_BACKEND=vllm but vLLM is not installed (make vllm; see "
                "docs/deployment.md)") from exc
        device = current_platform.device_type   # vLLM's build decides: cpu or cuda
        if settings.device not in ("auto", device) and not settings.device.startswith(device):
            raise BackendUnavailable(f"LLMQ_DEVICE={settings.device} but this vLLM build runs "
                                     f"on {device}")
        mm = ModelManager.from_settings(settings)
        path = mm.resolve()
        args = dict(
            model=path, dtype=_dtype(settings.dtype, device), seed=0,
            kv_cache_dtype=_kv_cache_dtype(settings.kv_cache_dtype, _dtype(settings.dtype, device)),
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=max(settings.max_num_batched_tokens, settings.max_num_seqs),
            enable_prefix_caching=settings.prefix_cache_mb > 0, disable_log_stats=True,
            # llguidance, the compiler llmq's own structured output uses; compact JSON
            structured_outputs_config=StructuredOutputsConfig(backend="guidance",
                                                              disable_any_whitespace=True))
        if settings.max_model_len:
            args["max_model_len"] = settings.max_model_len
        if device == "cpu":
            # Eager on CPU: measured here (SmolLM2, fp32, in-process engine), torch.compile made
            # a start take 65 s instead of 3.7 s for the same step time (20.5 vs 19.3 tok/s at
            # batch 1, 181 vs 187 at 16), and vLLM 0.32's compile cache does not load back, so
            # every worker start paid it. On CUDA, compiling and CUDA graphs do pay.
            args["enforce_eager"] = True
        if device == "cuda" and settings.kv_cache_mb:
            args["kv_cache_memory_bytes"] = settings.kv_cache_mb << 20
        try:
            engine = LLMEngine.from_engine_args(EngineArgs(**args))
        except Exception as exc:
            raise RuntimeError(f"vLLM could not load {path}: {type(exc).__name__}: {exc}") from exc
        tok = mm.load_tokenizer()
        cfg = engine.model_config
        cache = engine.vllm_config.cache_config
        gen = mm.generation_config()
        info = ModelInfo(
            name=settings.model, path=path,
            # (vLLM's own EOS handling is off, ignore_eos: llmq ends sequences on this set)
            eos_token_ids=eos_token_ids(getattr(gen, "eos_token_id", None),
                                        getattr(cfg.hf_config, "eos_token_id", None),
                                        tok.eos_token_id),
            max_model_len=int(cfg.max_model_len), vocab_size=int(cfg.get_vocab_size()),
            device=device, dtype=str(cfg.dtype).replace("torch.", ""),
            generation_defaults=generation_defaults(gen),
            kernels=f"vLLM ({device})",
            # a re-added request starts vLLM's grammar, seeded generator and penalty counts
            # again (docs/architecture.md, "vLLM behind llmq"): vLLM preempts those itself,
            # keeping them
            resumes_exactly=False)
        info = dataclasses.replace(info, kv_cache_dtype=(
            info.dtype if cache.cache_dtype == "auto" else str(cache.cache_dtype)))
        blocks = int(cache.num_gpu_blocks or 0)
        log.info("vLLM loaded %s on %s (%s): KV cache %d blocks of %d tokens", path, device,
                 info.dtype, blocks, cache.block_size)
        return cls(engine, info, (blocks, int(cache.block_size)))

    # --- a step -------------------------------------------------------------------------------
    def step(self, req: StepRequest, early=None) -> StepResult:   # answers in one piece
        res = StepResult()
        for sid in req.free_seq_ids:
            self._free(sid)
        for seq in req.prefill:
            error = self._add(seq)
            if error:
                res.errors[seq.seq_id] = error
        t0 = time.perf_counter()
        if self.engine.has_unfinished_requests():
            for out in self.engine.step():
                self._collect(out, res)
        res.decode_s = time.perf_counter() - t0
        for sid in list(req.decode_seq_ids) + [s.seq_id for s in req.prefill]:
            buf = self.buffers.get(sid)
            if buf:
                res.token_ids[sid] = buf.popleft()
                if self.logprobs[sid]:
                    res.logprobs[sid] = self.logprobs[sid].popleft()
        return res

    def _add(self, seq: NewSequence) -> str | None:
        """Hands a newcomer to vLLM; returns an error for it alone."""
        prompt = {"prompt_token_ids": list(seq.token_ids)}
        if seq.params.cache_salt:   # vLLM's prefix cache shares blocks only within a salt
            prompt["cache_salt"] = seq.params.cache_salt
        try:
            self.engine.add_request(seq.seq_id, prompt, self._sampling(seq))
        except Exception as exc:  # noqa: BLE001 - vLLM refused this request: it fails alone
            return f"{type(exc).__name__}: {exc}"
        self.buffers[seq.seq_id] = deque()
        self.logprobs[seq.seq_id] = deque()
        self.seen[seq.seq_id] = 0
        self.k[seq.seq_id] = seq.params.logprobs
        if seq.params.prompt_logprobs is not None:
            self.prompt_logprobs[seq.seq_id] = seq.params.prompt_logprobs
        return None

    def _sampling(self, seq: NewSequence):
        from vllm import SamplingParams

        p, done = seq.params, seq.num_output_tokens
        return SamplingParams(
            n=1, temperature=p.temperature or 0.0, top_p=p.top_p or 1.0, top_k=p.top_k or 0,
            min_p=p.min_p or 0.0, repetition_penalty=p.repetition_penalty or 1.0,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            logit_bias=p.logit_bias, seed=p.seed,
            # llmq ends the sequence (one token past max_tokens is never asked for); vLLM stops
            # on the same stop ids (EOS included unless ignore_eos) and masks them before
            # min_tokens, as llmq's own sampler does.
            max_tokens=max(1, p.max_tokens - done) + 1, min_tokens=max(0, p.min_tokens - done),
            stop_token_ids=list(seq.stop_token_ids), ignore_eos=True,
            logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs, detokenize=False,
            structured_outputs=_structured(p.structured))

    def _collect(self, out, res: StepResult) -> None:
        """Buffers what one request made in this step (and its cached prefix, at its first)."""
        sid = out.request_id
        if sid not in self.buffers:
            return   # aborted meanwhile
        done = self.seen[sid]
        if done == 0:
            res.cached_tokens[sid] = int(out.num_cached_tokens or 0)
            k = self.prompt_logprobs.pop(sid, None)
            if k is not None and out.prompt_logprobs is not None:
                ids = out.prompt_token_ids or []
                res.prompt_logprobs[sid] = [_token_logprobs(d, t, k) for d, t in
                                            zip(list(out.prompt_logprobs)[1:], ids[1:])]
        comp = out.outputs[0]
        ids = comp.token_ids
        self.buffers[sid].extend(ids[done:])
        k = self.k.get(sid)
        if k is not None and comp.logprobs is not None:
            self.logprobs[sid].extend(_token_logprobs(comp.logprobs[i], ids[i], k)
                                      for i in range(done, len(ids)))
        self.seen[sid] = len(ids)

    def _free(self, sid: str) -> None:
        if self.buffers.pop(sid, None) is None:
            return
        self.seen.pop(sid, None)
        self.logprobs.pop(sid, None)
        self.k.pop(sid, None)
        self.prompt_logprobs.pop(sid, None)
        self.engine.abort_request([sid])

    def warm_up(self) -> None:
        """One short request through vLLM, so the first real one meets warm kernels (vLLM
        compiled and profiled the model while loading)."""
        from common.protocol import SamplingParams

        warm = NewSequence("__warmup__", [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=2))
        self.step(StepRequest(prefill=[warm]))
        self.step(StepRequest(decode_seq_ids=["__warmup__"]))
        self.step(StepRequest(free_seq_ids=["__warmup__"]))


def _structured(spec: dict | None):
    """llmq's structured-output spec (common/structured.py) as vLLM's: the same five kinds, a
    JSON schema with the same bounds as llmq's own grammars (integers to int64's range,
    numbers to float64's digits)."""
    if not spec:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    from common.structured import bounded

    kind, value = spec["type"], spec.get("value")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        value = bounded(value)
    return StructuredOutputsParams(**{"json_schema": {"json": value}, "regex": {"regex": value},
                                      "choice": {"choice": value},
                                      "grammar": {"grammar": value}}[kind])


def _token_logprobs(d: dict, token_id: int, k: int) -> TokenLogprobs:
    """vLLM's {token id: Logprob} for one position as llmq's TokenLogprobs."""
    me = d[token_id]
    top = sorted((lp.rank, tid, lp.logprob) for tid, lp in d.items() if lp.rank <= k)
    return TokenLogprobs(float(me.logprob), int(me.rank), [t for _r, t, _l in top],
                         [float(lp) for _r, _t, lp in top])


def _dtype(dtype: str, device: str) -> str:
    """float32 on CPU unless asked: vLLM's CPU path answered in gibberish in bfloat16."""
    if dtype != "auto":
        return dtype
    return "float32" if device == "cpu" else "auto"


def _kv_cache_dtype(name: str, dtype: str) -> str:
    """LLMQ_KV_CACHE_DTYPE as vLLM's kv_cache_dtype: `auto`, the model's dtype, for `auto`,
    `model` or the served dtype named (llmq's float16 under float32 is for its own C++ kernel);
    anything else a ValueError at start. vLLM keeps its cache in the model's dtype (its other
    float choices are for models that default to fp8), and its CPU build, asked for float16
    under a float32 model, took it without a word and answered gibberish (vLLM 0.32)."""
    if name in ("auto", "model", dtype):
        return "auto"
    raise ValueError(f"LLMQ_KV_CACHE_DTYPE={name} under LLMQ_DTYPE={dtype}: vLLM keeps its KV "
                     "cache in the model's dtype (use auto, or choose it with LLMQ_DTYPE)")


def _configure_env(settings) -> None:
    """vLLM reads these at import: its engine core in this process, and on CPU its KV cache
    in GiB (LLMQ_KV_CACHE_MB rounded up; an operator's own VLLM_CPU_KVCACHE_SPACE wins)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    gib = -(-settings.kv_cache_mb // 1024) if settings.kv_cache_mb else DEFAULT_CPU_KV_CACHE_GIB
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(gib))
    if settings.torch_threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(settings.torch_threads))
