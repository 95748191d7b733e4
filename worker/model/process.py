"""The model process: spawned by the model executor, it owns one backend (the model, its KV
cache and sampling) and answers StepRequests from the pipe with StepResults.

Being a separate process, a crash or OOM here leaves the Celery worker (and its Redis
bookkeeping) alive. The executor names `main` as its spawn target, so this module imports
nothing heavy at its top: torch and the backend are imported inside the spawned process.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from common import logs

from .. import messages
from ..messages import CutShort, Ready, Shutdown, StepRequest
from .backend import StepHooks

log = logging.getLogger("llmq.model_worker")


def _exit_at_once() -> None:
    """Ends the process without the interpreter's teardown: this process keeps nothing to
    save, and unwinding torch and transformers took ~2 s of every worker's shutdown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _resolved_dtype(settings) -> str:
    """LLMQ_DTYPE made concrete for this machine and backend, and logged: the backends read
    this value (vLLM's gets float32 on CPU under auto)."""
    from ..model_manager import pick_device, resolve_dtype

    device = pick_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device, settings.backend)
    log.info("dtype %s on %s (LLMQ_DTYPE=%s)", dtype, device, settings.dtype)
    return dtype


def main(conn, settings) -> None:
    """Entry point of the spawned process: load, warm up, then serve steps until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's to handle
    if settings.device.startswith("cuda:") and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = settings.device.split(":", 1)[1]
        settings = settings.replace(device="cuda:0")
    logs.configure("model_worker")
    import torch

    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    from ..model_manager import pick_device
    from .backend import load_backend

    deferred: list = []   # read between layers, not an interjection: served after the step
    cut = [False]         # this step's passes were cut short: newcomers wait, no running ahead
    backend = None

    def send(msg) -> None:
        conn.send_bytes(messages.encode(msg))

    def serve(req: StepRequest) -> None:
        send(backend.step(req, early=send))

    def between_layers() -> None:
        if not conn.poll():
            return
        try:
            msg = messages.decode(conn.recv_bytes())
            if not (isinstance(msg, StepRequest) and msg.interject):
                deferred.append(msg)
                return
            serve(msg)
        except Exception:  # noqa: BLE001 - not the interrupted step's failure: exit, and the
            log.exception("interjection failed")   # executor restarts us and re-runs both
            logging.shutdown()
            os._exit(1)

    def another_pass() -> bool:
        """Between a multi-step request's passes: go on unless the engine sent something
        meanwhile (CutShort: newcomers wait; anything else is served after the step)."""
        if not conn.poll():
            return True
        cut[0] = True
        try:
            msg = messages.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return False   # the executor went away: the main loop finds out
        if not isinstance(msg, CutShort):
            deferred.append(msg)
        return False

    try:
        # The device's engine defaults (a GPU's batch and step limits), as the engine takes
        # them from ModelInfo.device.
        settings = settings.replace(dtype=_resolved_dtype(settings)).for_device(
            pick_device(settings.device))
        backend = load_backend(settings, StepHooks(between_layers, another_pass))
        backend.warm_up()
    except Exception as exc:  # noqa: BLE001 - tell the executor why, in words, then exit
        log.exception("model worker failed to load")
        send(RuntimeError(f"{type(exc).__name__}: {exc}"))
        return
    blocks, block_size = backend.kv_capacity
    send(Ready(backend.info, blocks, block_size, backend.interjects, backend.multi_step))
    while True:
        try:
            msg = deferred.pop(0) if deferred else messages.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return   # the executor went away
        if isinstance(msg, Shutdown):
            _exit_at_once()
        if isinstance(msg, CutShort):
            continue   # it came after the step it was for had ended
        cut[0] = False
        try:
            serve(msg)
        except Exception as exc:  # noqa: BLE001 - a broken batch: report it, the executor restarts us
            log.exception("step failed")
            send(RuntimeError(f"{type(exc).__name__}: {exc}"))
            return
        # (Not after a cut: the newcomers' step is next, and a token run ahead would make
        # them wait for one more pass and keep their prefill out of the decode's.)
        if not cut[0]:
            try:
                backend.run_ahead()
            except Exception:  # noqa: BLE001 - as a broken step: exit, the executor restarts us
                log.exception("running ahead failed")
                return
