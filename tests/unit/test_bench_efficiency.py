"""bench/efficiency.py: FLOPs per token from a model's shapes, the measured matmul rates, and the
fraction of the compute limit a served rate reaches."""
import pytest

from bench.efficiency import (cpu_info, flops_per_token, format_rates, format_served,
                              fraction_for, fraction_of_limit, linear_shapes, measure_rates,
                              merge_probe, rate_for)

TINY = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "num_hidden_layers": 2, "vocab_size": 10}


def test_flops_per_token_are_two_per_weight_of_every_linear_layer_and_the_lm_head():
    from transformers import LlamaConfig, LlamaForCausalLM
    from torch import nn

    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True))
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    shapes = linear_shapes(TINY)
    assert len(shapes) == 7 * 2 + 1 and shapes[-1] == (8, 10)
    assert flops_per_token(shapes) == 2 * weights


def test_head_dim_defaults_to_hidden_over_heads_and_kv_heads_to_heads():
    cfg = {k: v for k, v in TINY.items() if k not in ("head_dim", "num_key_value_heads")}
    assert linear_shapes(cfg)[:4] == [(8, 8), (8, 8), (8, 8), (8, 8)]


def test_fraction_of_limit_is_served_flops_over_the_measured_rate():
    # 100 tok/s x 2 GFLOP/token = 200 GFLOP/s of a 400 GFLOP/s machine.
    assert fraction_of_limit(100.0, 2e9, 400.0) == pytest.approx(0.5)
    assert fraction_of_limit(None, 2e9, 400.0) is None
    assert fraction_of_limit(100.0, 2e9, None) is None


EFF = {"flops_per_token": 2e8, "threads": 2, "cpu": {"model": "Xeon", "flags": ["avx2"]},
       "rates_gflops": {"float32": {"1": 20.0, "16": 100.0, "64": 160.0},
                        "bfloat16": {"1": 30.0, "64": 400.0}}}


def test_the_rate_is_the_rows_dtype_at_its_batch_or_the_nearest_below():
    assert rate_for(EFF, "float32", 64) == ("float32", 160.0)
    assert rate_for(EFF, "bfloat16", 16) == ("bfloat16", 30.0)     # 1 is the nearest below 16
    assert rate_for(EFF, "Q4_1", 16) == ("float32", 100.0)         # a GGUF row: float32's
    assert rate_for(EFF, "float32", 0) == ("float32", None)
    assert fraction_for(EFF, 400.0, "float32", 64) == pytest.approx(0.5)
    assert fraction_for(None, 400.0, "float32", 64) is None


def test_measured_rates_cover_every_dtype_and_batch():
    rates = measure_rates([(16, 32), (32, 16)], [4, 1], min_time_s=0.01, warm_up_s=0.01)
    assert set(rates) == {"float32", "bfloat16"}
    assert set(rates["float32"]) == {"1", "4"} and all(r > 0 for r in rates["float32"].values())


def test_the_rate_is_the_faster_of_torchs_linear_and_the_prepacked_one_llmq_runs():
    """A limit read off the slower kernel would credit a server for beating it."""
    import torch

    kernels: dict = {}
    rates = measure_rates([(64, 96), (96, 64)], [8], dtypes=("float32",), min_time_s=0.01,
                          warm_up_s=0.01, kernels=kernels)
    found = kernels["float32"]["8"]
    want = {"torch", "prepacked"} if torch.backends.mkldnn.is_available() else {"torch"}
    assert set(found) == want and all(r > 0 for r in found.values())
    assert rates["float32"]["8"] == max(found.values())
    eff = {**EFF, "kernels": kernels}
    assert "float32 by kernel (GFLOP/s): batch 8: torch" in "\n".join(format_rates(eff))


def test_a_torch_that_cannot_pack_leaves_torchs_linear_alone(monkeypatch):
    monkeypatch.setattr("worker.model.transformers.packed_linear.pack_linears", lambda model: 0)
    kernels: dict = {}
    measure_rates([(16, 32)], [2], dtypes=("float32",), min_time_s=0.01, warm_up_s=0.01,
                  kernels=kernels)
    assert set(kernels["float32"]["2"]) == {"torch"}


def test_the_second_probe_keeps_each_kernels_higher_rate():
    start = {**EFF, "kernels": {"float32": {"64": {"torch": 60.0, "prepacked": 90.0}}}}
    end = {"rates_gflops": {"float32": {"64": 108.0}},
           "kernels": {"float32": {"64": {"torch": 70.0, "prepacked": 85.0}}}}
    merged = merge_probe(start, end)
    assert merged["kernels"]["float32"]["64"] == {"torch": 70.0, "prepacked": 90.0}
    assert merged["rates_gflops"]["float32"]["64"] == 160.0   # EFF's own, the higher


def test_cpu_info_reads_the_model_and_the_kernel_flags(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse avx2 fma amx_bf16\n\n"
                 "processor\t: 1\nmodel name\t: Some CPU\nflags\t\t: fpu\n")
    assert cpu_info(str(f)) == {"model": "Some CPU", "flags": ["avx2", "fma", "amx_bf16"]}
    assert cpu_info(str(tmp_path / "absent"))["flags"] == []


def test_the_rates_and_the_served_fractions_are_printed():
    text = "\n".join(format_rates(EFF))
    assert "flags: avx2" in text and "0.200 GFLOP/token" in text
    assert "batch 64: 160 GFLOP/s = 800 tok/s" in text
    served = [{"concurrency": 64, "tokens_per_s": 400.0}, {"concurrency": 1, "tokens_per_s": None}]
    lines = format_served(EFF, served, "float32")
    assert "400.0 tok/s of 800 (float32): 50.0%" in lines[1]
    assert lines[2].endswith(": -")
    assert format_served(None, served, "float32") == []


def test_a_second_probe_raises_a_rate_it_beats_and_never_lowers_one():
    slow_start = {"float32": {"1": 15.0, "64": 100.0}, "bfloat16": {"64": 300.0}}
    merged = merge_probe(EFF, {"rates_gflops": slow_start})
    assert merged["rates_gflops"]["float32"] == {"1": 20.0, "16": 100.0, "64": 160.0}
    assert merged["rates_gflops"]["bfloat16"] == {"1": 30.0, "64": 400.0}
    fast_end = {"float32": {"64": 320.0}}
    merged = merge_probe(merged, {"rates_gflops": fast_end})
    assert merged["rates_gflops"]["float32"]["64"] == 320.0
    assert len(merged["probes"]) == 3 and merged["probes"][0] == EFF["rates_gflops"]
    # 400 tok/s x 0.2 GFLOP is half of the higher rate, not all of the slower one.
    assert fraction_for(merged, 800.0, "float32", 64) == pytest.approx(0.5)
    assert "the higher of 3 probes" in format_rates(merged)[1]
