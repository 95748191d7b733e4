"""An executor that runs its backend in this process: ModelExecutor's step protocol, no
spawn, no pipe (vLLM's in-process engine client). For tests and debugging: the engine runs
unchanged over a real backend (the tiny random model) or a scripted one."""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from .messages import StepRequest, StepResult
from .model_executor import ModelExecutor, ModelWorkerDied

log = logging.getLogger("llmq.model_executor")


class InProcessExecutor(ModelExecutor):
    """Steps a backend in the caller's thread. A step that raises reads as the model process's
    death does (ModelWorkerDied, the backend gone until restart), so recovery runs as for a
    crash; `restart` builds a new backend."""

    def __init__(self, settings=None, backend_factory: Callable[[], object] | None = None):
        super().__init__(settings)
        if backend_factory is None:
            from .model.backend import load_backend

            backend_factory = lambda: load_backend(settings)   # noqa: E731
        self._factory = backend_factory
        self.backend = None
        self._results: deque[StepResult | ModelWorkerDied] = deque()

    @property
    def pid(self) -> int | None:
        return None   # nothing to kill apart from this process

    def launch(self) -> None:
        pass   # start() builds the backend

    def start(self) -> None:
        try:
            backend = self._factory()
            backend.warm_up()
        except Exception as exc:  # noqa: BLE001 - as the process reports a failed load
            raise ModelWorkerDied(f"model worker failed to start: {exc!r}") from exc
        self.backend = backend
        self.info = backend.info
        self.kv_capacity = backend.kv_capacity
        self.multi_step = backend.multi_step
        self.num_starts += 1
        self._results.clear()

    def submit(self, req: StepRequest) -> None:
        """Runs the whole step now; wait() hands out its partial results, then the rest."""
        if self.backend is None:
            raise ModelWorkerDied("model worker is not running")
        self._results.clear()
        try:
            self._results.append(self.backend.step(req, early=self._results.append))
        except Exception as exc:  # noqa: BLE001 - a broken step: as the process's exit
            log.exception("step failed")
            self.backend = None
            self._results.append(ModelWorkerDied(
                f"model worker step failed: {type(exc).__name__}: {exc}"))

    def cut_short(self) -> None:
        pass   # the step ran whole in submit(): there is nothing in flight to cut

    def wait(self, wake=None) -> StepResult:
        """The step ran whole in submit(): nothing can interject into it, so `wake` never
        interrupts the wait."""
        if not self._results:
            raise ModelWorkerDied("no step in flight")
        res = self._results.popleft()
        if isinstance(res, ModelWorkerDied):
            raise res
        return res

    def stop(self, timeout_s: float = 10.0) -> None:
        self.backend = None
        self._results.clear()
        self.exitcode = 0
