"""Inference backends behind the model worker, chosen by LLMQ_BACKEND.

A backend turns StepRequests into StepResults (one token per sequence per step) and exposes
`info` (a ModelInfo) and `warm_up()`; the engine, the API and the wire types never change.

  transformers  (default) worker.model_worker.ModelWorker: our batched decode over HF models
  llama_cpp     worker.backends.llama_cpp_backend.LlamaCppBackend: llama.cpp over the GGUF file
                (optional extra: `make llama-cpp`)
  vllm          worker.backends.vllm_backend.VllmBackend: vLLM's engine, in the model process
                (optional extra: `make vllm`; its CPU build on x86-64, CUDA on GPU hosts)

A backend's own package is imported only when it is selected.
"""
from __future__ import annotations

from typing import Callable, Protocol

from ..messages import StepRequest, StepResult


class ModelBackend(Protocol):
    info: object

    def step(self, req: StepRequest, early: Callable[[StepResult], None] | None = None
             ) -> StepResult:
        """One step; may hand the newcomers' first tokens to `early` (a partial StepResult)
        before the rest of the step runs."""
        ...

    def warm_up(self) -> None: ...


class BackendUnavailable(RuntimeError):
    """The selected backend's package is not installed (a clear error at start-up)."""


BACKENDS = ("transformers", "llama_cpp", "vllm")


def load_backend(settings) -> ModelBackend:
    name = settings.backend
    if name == "transformers":
        from ..model_worker import ModelWorker

        return ModelWorker.load(settings)
    if name == "llama_cpp":
        from .llama_cpp_backend import LlamaCppBackend

        return LlamaCppBackend.load(settings)
    if name == "vllm":
        from .vllm_backend import VllmBackend

        return VllmBackend.load(settings)
    raise BackendUnavailable(f"unknown LLMQ_BACKEND {name!r}; choose one of {', '.join(BACKENDS)}")
