"""The CPU decode-attention kernel (worker/decode_attention.cpp): built once, loaded, or None.

`python -m worker.decode_kernel build` compiles it (`make model` runs it, so neither the tests nor
the first worker start pay the ~1 minute); otherwise the first use compiles it. The build is
cached by torch under ~/.cache/torch_extensions (keyed by the source's hash, so an edit
rebuilds). Without a compiler, ninja, or on a failed build, `load()` logs one line and returns
None, and paged attention keeps its torch path (gather + SDPA).
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")
# Portable flags only: -march=native builds crashed on AMX-reporting CPUs (llama.cpp), and the
# cache may be shared by machines of different CPUs. AVX2 + FMA + F16C is every x86 server
# CPU since 2013.
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17"]

_loaded: dict[str, object] = {}


def load(verbose: bool = False):
    """The compiled module (with .decode_attention), or None when it cannot be built here."""
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

        module = build(name="llmq_decode_attention", sources=[str(SOURCE)],
                       extra_cflags=FLAGS + ["-fopenmp"], extra_ldflags=["-fopenmp"],
                       verbose=verbose)
    except Exception as e:    # no compiler, no ninja, a failed build: the torch path serves
        log.warning("decode attention kernel unavailable, using gather + SDPA: %s",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
    _loaded["module"] = module
    return module


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
        print("usage: python -m worker.decode_kernel build", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO)
    module = load(verbose=bool(os.environ.get("VERBOSE")))
    print("decode attention kernel:", "built" if module is not None else "unavailable")
    # Not an error: a machine without a compiler serves with the torch path.
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
