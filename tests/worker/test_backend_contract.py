"""The backend contract (worker/model/backend.py): the registry names real backends, each a
ModelBackend, and an unknown name is a clear error. Checked from the sources, so the optional
backends (llama.cpp, vLLM) are covered without their packages."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from common.settings import Settings
from worker.model.backend import BACKENDS, BackendUnavailable, ModelBackend, load_backend

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_registered_backend_is_a_model_backend(name):
    module, cls = BACKENDS[name].split(":")
    source = ROOT / (module.replace(".", "/") + ".py")
    assert source.is_file(), source
    [node] = [n for n in ast.parse(source.read_text()).body
              if isinstance(n, ast.ClassDef) and n.name == cls]
    assert [ast.unparse(b) for b in node.bases] == ["ModelBackend"]
    assert {f.name for f in node.body if isinstance(f, ast.FunctionDef)} >= {"load", "step"}


def test_an_unknown_backend_is_a_clear_error():
    with pytest.raises(BackendUnavailable, match="choose one of transformers, llama_cpp, vllm"):
        load_backend(Settings(backend="tensorrt"))


def test_capabilities_default_to_not_offered():
    class Minimal(ModelBackend):
        pass

    b = Minimal()
    assert (b.kv_capacity, b.interjects, b.multi_step) == ((0, 0), False, False)
    assert b.hooks.between_layers is None and b.hooks.another_pass() is True
    b.run_ahead()   # a no-op, not an error
