"""Without a working build of the CPU kernels, the worker keeps its torch paths."""
from __future__ import annotations

import logging
import os

import pytest

from worker.model.transformers import cpu_kernels


def test_a_failed_build_logs_one_line_and_gives_none(monkeypatch, caplog):
    import torch.utils.cpp_extension as ext

    def no_compiler(**_kw):
        raise RuntimeError("Ninja is required to load C++ extensions\nno g++ found")

    monkeypatch.setattr(ext, "load", no_compiler)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is None
        assert cpu_kernels.load() is None            # remembered: tried once per process
    assert len(caplog.records) == 1 and "no g++ found" in caplog.records[0].getMessage()


def test_a_cpu_without_avx2_is_not_given_the_kernel(monkeypatch, caplog):
    """Its code is built for AVX2 + FMA + F16C: elsewhere it would stop at an illegal
    instruction, so the torch path serves and nothing is compiled."""
    import torch.utils.cpp_extension as ext

    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "_cpu_has", lambda *flags: False)
    monkeypatch.setattr(ext, "load", lambda **_kw: (_ for _ in ()).throw(AssertionError("built")))
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is None
    assert "AVX2" in caplog.records[0].getMessage()


def test_a_required_build_that_fails_is_an_error(monkeypatch):
    """CI requires the kernels (LLMQ_REQUIRE_KERNELS=1): a compile error in them passed the
    build step, and turned every kernel test into a skip."""
    monkeypatch.setattr(cpu_kernels, "load", lambda verbose=False: None)
    monkeypatch.delenv("LLMQ_REQUIRE_KERNELS", raising=False)
    assert cpu_kernels.main(["x", "build"]) == 0      # a machine without a compiler serves
    monkeypatch.setenv("LLMQ_REQUIRE_KERNELS", "1")
    assert cpu_kernels.main(["x", "build"]) == 1


@pytest.mark.skipif(os.environ.get("LLMQ_REQUIRE_KERNELS") != "1",
                    reason="only where the kernels are required (CI)")
def test_the_kernels_load_where_required():
    assert cpu_kernels.load() is not None


def test_a_build_lock_left_by_a_killed_builder_does_not_stall_the_next(monkeypatch, tmp_path):
    """torch's build lock is a file removed when its build ends, so a worker killed while
    compiling leaves it behind; the next builder (holding the OS lock a dead process cannot
    hold) finds no lock file, rather than waiting on it for ever."""
    import torch.utils.cpp_extension as ext

    folder = tmp_path / "build"
    folder.mkdir()
    (folder / "lock").touch()                    # what a SIGKILLed build leaves
    monkeypatch.setattr(ext, "_get_build_directory", lambda name, verbose: str(folder))

    def build(**_kw):
        assert not (folder / "lock").exists(), "torch would wait on a dead builder's lock"
        return "module"

    monkeypatch.setattr(ext, "load", build)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "_cpu_has", lambda *flags: True)
    assert cpu_kernels.load() == "module"
