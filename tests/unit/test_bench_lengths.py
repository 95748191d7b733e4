"""The mixed-lengths bench phase's pieces that need no stack: its options, the KV bytes its RSS
target is read against, and its targets."""
from __future__ import annotations

from bench.bench import parse_args
from bench.lengths import kv_bytes_per_token, long_prompt
from bench.report import lengths_targets


def test_only_lengths_runs_the_phase_alone_with_3000_and_8000_by_default():
    args = parse_args(["--only", "lengths"])
    assert args.only == "lengths" and not args.run_peers and args.lengths == [3000, 8000]


def test_the_kv_bytes_follow_the_served_dtype(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=3).save_pretrained(tmp_path)
    per_token_fp32 = 3 * 2 * 2 * 16 * 4            # layers x (k, v) x kv heads x dim x bytes
    assert kv_bytes_per_token(str(tmp_path)) == per_token_fp32
    assert kv_bytes_per_token(str(tmp_path), "bfloat16") == per_token_fp32 // 2


def test_the_phase_counts_the_kv_cache_dtype_the_worker_reports():
    """The RSS target is read against the cache's own bytes, in the dtype the stack's worker
    reports in its heartbeat (worker/model/transformers/backend.py chooses it; tests/worker checks the
    choice); a worker that reports none (an older tree's) is taken to store the model's."""
    from types import SimpleNamespace

    from bench.bench import served_kv_dtype

    def stack(report):
        return SimpleNamespace(dtype="float32", device="cpu", worker_report=lambda: report)

    assert served_kv_dtype(stack({"kv_cache_dtype": "float16", "dtype": "float32"})) == "float16"
    assert served_kv_dtype(stack({"dtype": "float32"})) == "float32"


def test_each_long_prompt_gets_its_latency_and_memory_target():
    runs = [{"long_prompt_tokens": 0},
            {"long_prompt_tokens": 3000, "short_p50_over_alone": 1.4, "rss_growth_over_kv": 0.3},
            {"long_prompt_tokens": 8000, "short_p50_over_alone": 1.7, "rss_growth_over_kv": None}]
    got = {t["name"]: t["met"] for t in lengths_targets({"runs": runs})}
    assert got == {
        "lengths: short p50 beside 1 x 3000 tokens <= 1.5 x alone": True,
        "lengths: model RSS growth beside 1 x 3000 <= 1.25 x its KV bytes": True,
        "lengths: short p50 beside 1 x 8000 tokens <= 1.5 x alone": False,
        "lengths: model RSS growth beside 1 x 8000 <= 1.25 x its KV bytes": None}


class _Chars:
    """A tokenizer of one id per character: enough for long_prompt's sizing loop."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_long_prompts_of_two_sizes_share_no_cached_prefix():
    """The phase runs 3,000 then 8,000 on one stack: had they begun alike, the prefix cache
    would have started the 8,000-token prefill 3,000 tokens deep."""
    tok = _Chars()
    a, b = (tok(long_prompt(tok, n))["input_ids"] for n in (3000, 8000))
    assert abs(len(a) - 3000) <= 16 and abs(len(b) - 8000) <= 16
    assert a[0] != b[0]
