"""The GPU check's parts that need no model: its table, its agreement verdict, and the wheel
set `make gpu-wheels` carries to a GPU machine (bench/gpu_check.py, scripts/gpu_wheels.py)."""
from __future__ import annotations

import importlib.util
import os

from bench.gpu_check import compare, format_agreement, format_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_table_shows_the_columns_some_row_has_and_dashes_for_the_rest():
    rows = [{"batch": 1, "decode_tok_s": 123.4, "step_ms": 8.1049},
            {"batch": 256, "decode_tok_s": 25_000.0, "step_ms": 10.0, "kernels_per_step": 1534}]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["batch", "decode", "tok/s", "step", "ms", "kernels"]
    assert lines[1].split() == ["1", "123", "8.10", "-"]
    assert lines[2].split() == ["256", "25,000", "10.00", "1,534"]
    assert len({len(line) for line in lines}) == 1   # aligned


def test_agreement_forgives_a_divergence_only_at_a_near_tie():
    ref = [{"tokens": [5, 6, 7], "margins": [1.0, 1.0, 1.0]},
           {"tokens": [5, 6, 7], "margins": [1.0, 1e-5, 1.0]},
           {"tokens": [5, 6, 7], "margins": [1.0, 0.5, 1.0]}]
    got = [[5, 6, 7], [5, 9, 9], [5, 9, 7]]
    a = compare(ref, got)
    assert (a["whole"], a["tie_diverged"], a["diverged"]) == (1, 1, 1)
    assert a["first_divergence"] == [None, 1, 1]
    assert a["common_prefix_mean"] == (3 + 1 + 1) / 3
    assert "1/3 prompts agree whole" in format_agreement({"float32": {**a, "tokens": 3,
                                                                      "strict": True}})


def _gpu_wheels():
    spec = importlib.util.spec_from_file_location(
        "gpu_wheels", os.path.join(ROOT, "scripts", "gpu_wheels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wheel_set_leaves_out_what_torch_and_transformers_bring():
    """What a GPU machine has (torch, transformers and their closure) is never carried, so it is
    never replaced there; llmq's own needs are, pydantic too (that machine's image lacks it)."""
    gw = _gpu_wheels()
    reqs = gw.requirements(__import__("pathlib").Path(ROOT, "requirements.txt"))
    carried = gw.wanted("3.12", reqs)
    for name in ("torch", "transformers", "tokenizers", "safetensors", "numpy",
                 "huggingface-hub", "jinja2", "typing-extensions"):
        assert name not in carried, name
    for name in ("celery", "redis", "flask", "llguidance", "pydantic", "pydantic-core",
                 "kombu", "psutil"):
        assert name in carried, name
