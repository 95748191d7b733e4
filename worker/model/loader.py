"""Picks the backend LLMQ_BACKEND names and loads it; only the chosen backend's package (and
its engine: torch, llama.cpp, vLLM) is imported."""
from __future__ import annotations

from .backend import BackendUnavailable, ModelBackend, StepHooks

BACKENDS = ("transformers", "llama_cpp", "vllm")


def load_backend(settings, hooks: StepHooks = StepHooks()) -> ModelBackend:
    name = settings.backend
    if name == "transformers":
        from .transformers.backend import TransformersBackend

        return TransformersBackend.load(settings, hooks)
    if name == "llama_cpp":
        from .llama_cpp.backend import LlamaCppBackend

        return LlamaCppBackend.load(settings, hooks)
    if name == "vllm":
        from .vllm.backend import VllmBackend

        return VllmBackend.load(settings, hooks)
    raise BackendUnavailable(f"unknown LLMQ_BACKEND {name!r}; choose one of {', '.join(BACKENDS)}")
