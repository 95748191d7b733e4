"""Fixtures of the model-worker tests: the tiny random model, loaded in this process."""
from __future__ import annotations

import os

import pytest
import torch

from factories import load_model, on_device, sharpened


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """In-process models run on one thread here: on a small machine shared with other work,
    two threads fighting for two busy cores were measured 5-7x slower than one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """(model, info) of the tiny random model (cpu, float32)."""
    return load_model(tiny_model_dir)


@pytest.fixture(scope="session")
def sharp_model(tiny_model):
    """(model, info): the tiny model with its layers scaled up so that its greedy tokens depend
    on the whole context (see factories.sharpened)."""
    model, info = tiny_model
    return sharpened(model), info


@pytest.fixture(scope="session", params=["cpu", "cuda"])
def device(request) -> str:
    """The device a model-worker test runs on: the CPU always; CUDA where LLMQ_TEST_DEVICE=cuda
    asks for it and one is present (a GPU machine's run), skipped otherwise."""
    if request.param == "cuda":
        if not os.environ.get("LLMQ_TEST_DEVICE", "cpu").startswith("cuda"):
            pytest.skip("LLMQ_TEST_DEVICE=cuda runs the device tests on CUDA too")
        if not torch.cuda.is_available():
            pytest.skip("LLMQ_TEST_DEVICE=cuda, but torch sees no CUDA device")
    return request.param


@pytest.fixture(scope="session")
def sharp_device_model(sharp_model, device):
    """(model, info): the sharpened tiny model on `device` (float32)."""
    return on_device(*sharp_model, device)


@pytest.fixture(scope="module")
def kernels():
    """The CPU kernels' module (worker/model/transformers/cpu_kernels.py); skips where it
    cannot be built."""
    from worker.model.transformers import cpu_kernels

    module = cpu_kernels.load()
    if module is None:
        pytest.skip("the CPU kernels cannot be built here")
    return module


@pytest.fixture(params=["avx2", "avx512bf16"])
def path(request):
    """Runs a CPU kernels' test on each of the bfloat16 kernels' paths: AVX2's and, where the
    CPU has AVX512-BF16, the wide one (worker/model/transformers/simd.h's llmq::wide)."""
    from worker.model.transformers import cpu_kernels

    ops = cpu_kernels.load()
    if ops is None:
        pytest.skip("the CPU kernels cannot be built here")
    if request.param == "avx512bf16" and not ops.wide_ops():
        pytest.skip("this CPU has no AVX512-BF16")
    ops.wide_ops(request.param == "avx512bf16")
    yield request.param
    ops.wide_ops(True)
