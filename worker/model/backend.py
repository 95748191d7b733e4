"""The backend contract: what the model process needs from an inference engine.

A backend turns StepRequests into StepResults (one token per sequence per step, or a few for a
multi-step request) over one model; the engine, the API and the wire types never change with
it. Selected by LLMQ_BACKEND:

  transformers  (default) worker.model.transformers.backend.TransformersBackend: our batched
                decode over Hugging Face models, paged KV cache and CPU kernels
  llama_cpp     worker.model.llama_cpp.backend.LlamaCppBackend: llama.cpp over the GGUF file
                (optional extra: `make llama-cpp`)
  vllm          worker.model.vllm.backend.VllmBackend: vLLM's engine, in the model process
                (optional extra: `make vllm`; its CPU build on x86-64, CUDA on GPU hosts)

A backend's own package is imported only when it is selected. Everything the model process
reads from a backend is declared on ModelBackend below, with the default that means "not
offered"; a new backend subclasses it and overrides what it can do (docs/architecture.md,
"Writing a backend").
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from ..messages import StepRequest, StepResult


def _always() -> bool:
    return True


@dataclass(frozen=True)
class StepHooks:
    """What the model process offers a backend during a step (given at load, never changed)."""

    # Before each decoder layer of a step in flight: serves an interjected request that has
    # arrived meanwhile (a better priority's prefill, run in its own pass). Only backends
    # that declare `interjects` call it; None (tests, tools): nothing can arrive.
    between_layers: Callable[[], None] | None = None
    # Before each pass after a multi-step request's first: False ends the passes there (the
    # engine sent CutShort: newcomers are waiting). Only backends that declare `multi_step`.
    another_pass: Callable[[], bool] = _always


class ModelBackend:
    """The one contract a backend fulfils: `step`, `info` and the capabilities it declares."""

    info: object                     # a worker.model_manager.ModelInfo (resumes_exactly on it)
    # (blocks, tokens per block) of the KV cache the workload manager may fill; (0, 0): the
    # backend sizes its own batch and the workload manager counts no blocks.
    kv_capacity: tuple[int, int] = (0, 0)
    interjects: bool = False         # runs an `interject` request between its layers
    multi_step: bool = False         # runs a request's `num_steps` decode passes back to back
    hooks: StepHooks = StepHooks()

    @classmethod
    def load(cls, settings, hooks: StepHooks = StepHooks()) -> "ModelBackend":
        """Loads the model LLMQ_* settings name onto their device."""
        raise NotImplementedError

    def step(self, req: StepRequest, early: Callable[[StepResult], None] | None = None
             ) -> StepResult:
        """One step; may hand the newcomers' first tokens to `early` (a partial StepResult)
        before the rest of the step runs."""
        raise NotImplementedError

    def warm_up(self) -> None:
        """Runs whatever makes the first real step fast (kernels, graphs); called once."""

    def run_ahead(self) -> None:
        """Called once a step's result is sent, while the engine takes its turn: a backend may
        compute what the next step will ask for (llama_cpp decodes a lone sequence's next
        token). Not called after a step that was cut short."""


class BackendUnavailable(RuntimeError):
    """The selected backend's package is not installed (a clear error at start-up)."""


# name (LLMQ_BACKEND) -> "module:class", imported only when chosen (and named, not imported,
# here: the backends import this module).
BACKENDS = {
    "transformers": "worker.model.transformers.backend:TransformersBackend",
    "llama_cpp": "worker.model.llama_cpp.backend:LlamaCppBackend",
    "vllm": "worker.model.vllm.backend:VllmBackend",
}


def load_backend(settings, hooks: StepHooks = StepHooks()) -> ModelBackend:
    """The backend LLMQ_BACKEND names, loaded."""
    where = BACKENDS.get(settings.backend)
    if where is None:
        raise BackendUnavailable(f"unknown LLMQ_BACKEND {settings.backend!r}; choose one of "
                                 f"{', '.join(BACKENDS)}")
    module, cls = where.split(":")
    return getattr(importlib.import_module(module), cls).load(settings, hooks)
