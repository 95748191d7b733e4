"""The vLLM backend: vLLM's own engine (paged attention, CUDA graphs) behind llmq's step protocol.

llmq keeps its scheduler, sequences, detokenizer and Redis path; vLLM runs the batch. vLLM
may produce zero tokens for a request in a step (chunked prefill) or several, so tokens are
buffered per sequence and handed out one per llmq step.
"""
from __future__ import annotations

from collections import deque

from ..messages import StepRequest, StepResult
from ..model_manager import ModelInfo, ModelManager
from . import BackendUnavailable


class VllmBackend:
    """Adapts vllm.LLMEngine to StepRequest/StepResult."""

    # vLLM runs its engine core in a process of its own, stopped by vLLM's exit hooks: the
    # model process must leave through the interpreter's normal exit, not os._exit.
    needs_teardown = True

    def __init__(self, engine, info: ModelInfo):
        self.engine = engine
        self.info = info
        self.buffers: dict[str, deque[int]] = {}
        self.seen: dict[str, int] = {}

    @classmethod
    def load(cls, settings) -> "VllmBackend":
        try:
            from vllm import EngineArgs, LLMEngine
        except ImportError as exc:
            raise BackendUnavailable(
                "LLMQ_BACKEND=vllm but vllm is not installed (pip install vllm on a GPU host)"
            ) from exc
        mm = ModelManager.from_settings(settings)
        path = mm.resolve()
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=path, dtype="auto" if settings.dtype == "auto" else settings.dtype,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=max(settings.max_num_batched_tokens, 8192)))
        tok = mm.load_tokenizer()
        cfg = engine.model_config
        info = ModelInfo(
            name=settings.model, path=path,
            eos_token_ids=tuple(x for x in [tok.eos_token_id] if x is not None),
            max_model_len=int(cfg.max_model_len), vocab_size=int(cfg.get_vocab_size()),
            device="cuda", dtype=str(cfg.dtype).replace("torch.", ""),
            generation_defaults={"temperature": 0.0})
        return cls(engine, info)

    def _sampling(self, p, num_output_tokens: int):
        from vllm import SamplingParams

        return SamplingParams(
            n=1, temperature=p.temperature or 0.0, top_p=p.top_p or 1.0, top_k=p.top_k or -1,
            min_p=p.min_p or 0.0, repetition_penalty=p.repetition_penalty or 1.0,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            logit_bias=p.logit_bias,
            seed=p.seed, max_tokens=max(1, p.max_tokens - num_output_tokens) + 1,
            min_tokens=max(0, p.min_tokens - num_output_tokens),
            stop_token_ids=list(p.stop_token_ids), ignore_eos=True,  # llmq decides when to stop
            detokenize=False)

    def step(self, req: StepRequest, early=None) -> StepResult:   # answers in one piece
        res = StepResult()
        for sid in req.free_seq_ids:
            if sid in self.buffers:
                self.engine.abort_request([sid])
                self.buffers.pop(sid)
                self.seen.pop(sid, None)
        for s in req.prefill:
            missing = _unsupported(s.params)
            if missing:
                res.errors[s.seq_id] = f"the vllm backend does not support {missing} yet"
                continue
            prompt = {"prompt_token_ids": list(s.token_ids)}
            if s.params.cache_salt:   # vLLM's prefix cache shares blocks only within a salt
                prompt["cache_salt"] = s.params.cache_salt
            self.engine.add_request(s.seq_id, prompt,
                                    self._sampling(s.params, s.num_output_tokens))
            self.buffers[s.seq_id] = deque()
            self.seen[s.seq_id] = 0
        wanted = [s.seq_id for s in req.prefill if s.seq_id not in res.errors]
        wanted += list(req.decode_seq_ids)
        while any(not self.buffers[sid] for sid in wanted):
            for out in self.engine.step():
                sid = out.request_id
                if sid not in self.buffers:
                    continue
                ids = out.outputs[0].token_ids
                self.buffers[sid].extend(ids[self.seen[sid]:])
                self.seen[sid] = len(ids)
            if not self.engine.has_unfinished_requests() and any(
                    not self.buffers[sid] for sid in wanted):
                for sid in wanted:
                    if not self.buffers[sid]:
                        res.errors[sid] = "vLLM finished the request without a token"
                break
        for sid in wanted:
            if self.buffers[sid]:
                res.token_ids[sid] = self.buffers[sid].popleft()
        return res

    def warm_up(self) -> None:
        pass   # vLLM profiles and captures CUDA graphs while loading


def _unsupported(p) -> str | None:
    """Features llmq implements in its own sampler, which this backend does not use (vLLM
    samples itself): the sequence fails with a clear error rather than quietly without them."""
    if p.structured:
        return "structured output"
    if p.logprobs is not None or p.prompt_logprobs is not None:
        return "logprobs"
    return None
