"""The CPU kernels' module: built once, loaded, or None.

One module of five sources: decode attention over the paged KV cache
(worker/model/transformers/decode_attention.cpp), a Llama layer's fused elementwise ops (worker/model/transformers/layer_ops.cpp),
weight-only quantized linear layers (worker/model/transformers/quant_linear.cpp), a decoder
layer of a small decode step in one call over them (worker/model/transformers/decode_layer.cpp) and
their bindings (worker/model/transformers/cpu_kernels.cpp), with the AVX2 helpers they share (worker/model/transformers/simd.h) and their entry points' declarations (kernels.h);
bfloat16's ops and attention have AVX512-BF16 paths, compiled function by function and taken
where the CPU has the instructions (docs/architecture.md, "The CPU kernels").
`python -m worker.model.transformers.cpu_kernels build` compiles it (`make model` runs it, so neither the tests nor
the first worker start pay the ~1 minute); otherwise the first use compiles it. The build is
cached by torch under ~/.cache/torch_extensions (keyed by the sources' and the flags' hash, so
an edit rebuilds). Without a compiler, ninja, or on a failed build, `load()` logs one line and
returns None, and the torch paths serve: paged attention's gather + SDPA, and the layer's torch
ops (worker/model/transformers/llama_forward.py).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [HERE / "cpu_kernels.cpp", HERE / "decode_attention.cpp", HERE / "layer_ops.cpp",
           HERE / "quant_linear.cpp", HERE / "decode_layer.cpp"]
HEADERS = [HERE / "simd.h", HERE / "kernels.h"]
# Portable flags only: -march=native builds crashed on AMX-reporting CPUs (llama.cpp), and the
# cache may be shared by machines of different CPUs. AVX2 + FMA + F16C is every x86 server
# CPU since 2013.
# -ffp-contract=off: a multiply then an add stays two roundings, as torch's separate ops are
# (the layer ops match them to the bit where they can); explicit FMAs are unaffected.
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-ffp-contract=off"]

_loaded: dict[str, object] = {}


def load(verbose: bool = False):
    """The compiled module (.decode_attention, .add_rms_norm, .silu_mul, .rotary, .wide_ops,
    .int8_linear, .int4_linear, .DecodeLayer),
    or None when it cannot be built here."""
    if "module" in _loaded:
        return _loaded["module"]
    module = None
    try:
        import platform

        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise RuntimeError(f"the kernel needs x86-64 AVX2, not {platform.machine()}")
        if not _cpu_has("avx2", "fma", "f16c"):   # (its code would stop at an illegal instruction)
            raise RuntimeError("the kernel needs a CPU with AVX2, FMA and F16C")
        from torch.utils.cpp_extension import load as build

        # torch's cache keys on the sources and flags, not on the headers they include: the
        # headers' hash goes in as a define, so an edit to one rebuilds.
        headers = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
        # One build folder per checkout: torch's build names its sources by path, so two
        # checkouts sharing one folder (worktrees, the bench's baseline copy) would rebuild it
        # in turn at every worker start, each waiting on the other's lock.
        where = hashlib.sha256(str(HERE.resolve()).encode()).hexdigest()[:8]
        name = f"llmq_cpu_kernels_{where}"
        with _only_builder(name):
            module = build(name=name, sources=[str(s) for s in SOURCES],
                           extra_cflags=FLAGS + ["-fopenmp", f"-DLLMQ_HEADERS={headers}"],
                           extra_ldflags=["-fopenmp"], verbose=verbose)
    except Exception as e:    # no compiler, no ninja, a failed build: the torch paths serve
        log.warning("CPU kernels unavailable, using torch's ops (gather + SDPA attention): %s",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
    _loaded["module"] = module
    return module


@contextmanager
def _only_builder(name: str):
    """Holds an OS lock on the build folder while torch builds or loads the module there.

    torch's own build lock is a file it deletes when the build ends; a builder killed
    mid-build (a worker SIGKILLed in its first start) leaves the file, and every later load
    waits on it for ever. An flock is released by the kernel when its holder dies, so whoever
    holds it is the only live builder, and a torch lock file found then is a dead one's."""
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, verbose=False))
    with open(folder / "llmq.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cpu_has(*flags: str) -> bool:
    """Whether the CPU reports these flags (Linux's /proc/cpuinfo; elsewhere assumed)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    have = next((line.split(":", 1)[1].split() for line in text.splitlines()
                 if line.startswith("flags")), [])
    return all(f in have for f in flags)


def main(argv: list[str]) -> int:
    if argv[1:] != ["build"]:
        print("usage: python -m worker.model.transformers.cpu_kernels build", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO)
    module = load(verbose=bool(os.environ.get("VERBOSE")))
    print("CPU kernels:", "built" if module is not None else "unavailable")
    # Not an error: a machine without a compiler serves with the torch path. Unless required
    # (CI): a build that broke would turn the kernels' tests into skips and pass.
    return 1 if module is None and os.environ.get("LLMQ_REQUIRE_KERNELS") == "1" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
