"""The model executor: owns the model-worker process, sends it steps, notices when it dies."""
from __future__ import annotations

import logging
import multiprocessing as mp
import time
from multiprocessing.connection import wait as wait_any

from . import messages
from .model import process
from .messages import CutShort, Ready, Shutdown, StepRequest, StepResult

log = logging.getLogger("llmq.model_executor")


class ModelWorkerDied(RuntimeError):
    """The model process exited or broke mid-step; its KV cache is gone."""


class ModelExecutor:
    """Spawns the model worker (spawn, never fork: CUDA cannot survive a fork) and talks to it."""

    def __init__(self, settings, start_timeout_s: float = 600.0):
        self.settings = settings
        self.start_timeout_s = start_timeout_s
        self.info = None
        self.kv_capacity = (0, 0)   # the model process's KV cache: (blocks, tokens per block)
        self.interjects = False     # runs an interjection inside the step in flight
        self.multi_step = False     # runs several decode passes per request (num_steps)
        self.num_starts = 0
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._conn = None
        self._in_flight = 0      # requests sent whose (last) result has not come
        self._launched = False   # spawned by launch(), its Ready not yet read
        self.exitcode = None     # the last stopped process's (0: it honoured Shutdown)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def launch(self) -> None:
        """Spawns the model process and returns at once: it imports torch and loads the model
        while the caller does its own start-up (the worker loads its tokenizer meanwhile,
        ~6 s of a ~9 s start). start() then waits for it."""
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=process.main, args=(child, self.settings),
                                       name="llmq-model-worker", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        self._in_flight = 0
        self._launched = True

    def start(self) -> None:
        """Launches the model process unless launch() already did, and waits until it has
        loaded and warmed up its model."""
        if not self._launched:
            self.launch()
        self._launched = False
        msg = self._recv(self.start_timeout_s)
        if not isinstance(msg, Ready):
            raise ModelWorkerDied(f"model worker failed to start: {msg!r}")
        self.info = msg.info
        self.kv_capacity = (msg.kv_num_blocks, msg.kv_block_size)
        self.interjects = msg.interjects
        self.multi_step = msg.multi_step
        self.num_starts += 1
        log.info("model worker %s ready: %s on %s", self._proc.pid, self.info.name, self.info.device)

    def restart(self) -> None:
        self.stop(timeout_s=2.0)
        self.start()

    def submit(self, req: StepRequest) -> None:
        """Sends a step without waiting, so the engine can do Redis I/O while the model runs;
        or, while one is in flight, an interjection (`req.interject`), answered apart."""
        try:
            self._conn.send_bytes(messages.encode(req))
        except (OSError, EOFError, BrokenPipeError) as exc:
            raise ModelWorkerDied(str(exc)) from exc
        self._in_flight += 1

    def cut_short(self) -> None:
        """Asks the multi-step request in flight to stop after its current pass (CutShort);
        its result comes as usual, with fewer passes. Nothing is answered to this itself."""
        try:
            self._conn.send_bytes(messages.encode(CutShort()))
        except (OSError, EOFError, BrokenPipeError) as exc:
            raise ModelWorkerDied(str(exc)) from exc

    def wait(self, wake=None) -> StepResult | None:
        """The next result: partial ones (a prefill pass's first tokens, `partial` set) come
        before the rest when the step has more to run after them; an interjection's
        (`interjected`) may come before any or after all. `wake`: something with fileno() (the engine's inbox
        bell); None is returned when it rings first."""
        msg = self._recv(None, wake)
        if msg is None:
            return None
        if not isinstance(msg, StepResult):
            self._in_flight = 0
            raise ModelWorkerDied(f"model worker step failed: {msg}")
        if not msg.partial:
            self._in_flight = max(0, self._in_flight - 1)
        return msg

    def execute(self, req: StepRequest) -> StepResult:
        """Runs a step and returns its whole result (partial ones merged in)."""
        self.submit(req)
        res = self.wait()
        while res.partial:
            rest = self.wait()
            rest.token_ids = {**res.token_ids, **rest.token_ids}
            rest.errors = {**res.errors, **rest.errors}
            rest.cached_tokens = {**res.cached_tokens, **rest.cached_tokens}
            rest.logprobs = {**res.logprobs, **rest.logprobs}
            rest.prompt_logprobs = {**res.prompt_logprobs, **rest.prompt_logprobs}
            rest.more_token_ids = {**res.more_token_ids, **rest.more_token_ids}
            res = rest
        return res

    def _recv(self, timeout_s: float | None, wake=None):
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                if wake is None:
                    ready = self._conn.poll(0.5)
                else:
                    ready = wait_any([self._conn, wake], 0.5)
                    if ready and self._conn not in ready:
                        return None
                if ready:
                    return messages.decode(self._conn.recv_bytes())
            except (EOFError, OSError) as exc:
                raise ModelWorkerDied(f"model worker connection lost: {exc}") from exc
            if not self._proc.is_alive():
                raise ModelWorkerDied(f"model worker exited with code {self._proc.exitcode}")
            if deadline is not None and time.monotonic() > deadline:
                raise ModelWorkerDied("model worker did not answer in time")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._proc is None:
            return
        try:
            if self._proc.is_alive() and not self._in_flight:
                self._conn.send_bytes(messages.encode(Shutdown()))
        except OSError:
            pass
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self.exitcode = self._proc.exitcode
        self._conn.close()
        self._proc = None
        self._launched = False
