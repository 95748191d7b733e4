"""Settings are validated once at start (issue 13, bug 11): a bad value names its variable."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.settings import Settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("var,value", [
    ("LLMQ_BATCH_POLICY", "fifo"),         # unknown choice (was a KeyError in the engine)
    ("LLMQ_MAX_NUM_SEQS", "0"),            # a count that must be positive
    ("LLMQ_MAX_QUEUED", "-5"),
    ("LLMQ_RATE_LIMIT_RPM", "-1"),         # 0 = off, negative is a typo
    ("LLMQ_WORKER_HEARTBEAT", "two"),      # not a number
    ("LLMQ_PORT", "80x"),
    ("LLMQ_KEY_BATCH_SHARE", "1.5"),       # a share, (0, 1]
    ("LLMQ_SHUTDOWN_GRACE", "nan"),        # nan passed every range check
    ("LLMQ_MAX_STEP", "inf"),
    ("LLMQ_WORKER_HEARTBEAT", "30"),       # beats further apart than a peer waits (15 s)
    ("LLMQ_PORT", "99999"),
    ("LLMQ_API_KEYS", ","),                # a list naming no key: every route was left open
    ("LLMQ_API_KEYS", " , ,"),
    ("LLMQ_METRICS_KEYS", ","),
    ("LLMQ_WEBHOOK_MAX_PER_HOST", "-1"),
    ("LLMQ_WEBHOOK_CONNECT_TIMEOUT", "0"),
    ("LLMQ_MAX_STOP_TOKEN_IDS", "-1"),
])
def test_bad_setting_names_its_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        Settings.from_env()


def test_good_settings_pass(monkeypatch):
    monkeypatch.setenv("LLMQ_BATCH_POLICY", "static")
    monkeypatch.setenv("LLMQ_RATE_LIMIT_RPM", "0")
    monkeypatch.setenv("LLMQ_MAX_NUM_SEQS", " 8 ")
    s = Settings.from_env()
    assert (s.batch_policy, s.rate_limit_rpm, s.max_num_seqs) == ("static", 0, 8)


@pytest.mark.parametrize("start", [
    "import worker.celery_app",                           # the worker's start
    "import app; app.create_app()",                       # the API's start (gunicorn factory)
])
def test_start_fails_with_the_variable(start):
    env = dict(os.environ, PYTHONPATH=ROOT, LLMQ_BATCH_POLICY="fifo",
               LLMQ_REDIS_URL="redis://127.0.0.1:1/0")
    p = subprocess.run([sys.executable, "-c", start], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "ValueError: LLMQ_BATCH_POLICY='fifo'" in p.stderr


def test_a_zero_grace_is_a_valid_setting(monkeypatch):
    """LLMQ_SHUTDOWN_GRACE=0 hands the batch back at once (the kill-mid-hand-back test uses it)."""
    monkeypatch.setenv("LLMQ_SHUTDOWN_GRACE", "0")
    assert Settings.from_env().shutdown_grace_s == 0


def test_a_lower_case_log_level_as_celery_takes_it(monkeypatch):
    """LLMQ_LOG_LEVEL feeds Celery's --loglevel, which takes "debug": the API and the model
    process stopped at start on it (ValueError: Unknown level: 'debug')."""
    import io
    import logging

    from common import logs

    monkeypatch.setenv("LLMQ_LOG_LEVEL", "debug")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.configure("test", stream=io.StringIO())
        assert root.level == logging.DEBUG
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def test_every_setting_is_declared_once_and_documented():
    """Each field names its variable in its declaration (nowhere else in the module), and
    docs/settings.md lists every variable (docs/testing.md the test-only LLMQ_TEST_*)."""
    import dataclasses
    import re
    from pathlib import Path

    source = Path(ROOT, "common", "settings.py").read_text()
    docs = Path(ROOT, "docs", "settings.md").read_text()
    testing = Path(ROOT, "docs", "testing.md").read_text()
    names = [v for f in dataclasses.fields(Settings) for v in f.metadata["env"]]
    assert len(names) == len(set(names))
    declared = {v: len(re.findall(rf'"{v}"', source)) for v in names}
    assert all(n == 1 for n in declared.values()), declared
    undocumented = [v for v in names if v.startswith("LLMQ_") and f"`{v}`" not in
                    (testing if v.startswith("LLMQ_TEST_") else docs)]
    assert not undocumented, undocumented


def test_variables_are_read_by_the_fields_type(monkeypatch):
    monkeypatch.setenv("LLMQ_API_KEYS", " a, b ,")
    monkeypatch.setenv("LLMQ_ALLOWED_HOSTS", "Api.Example.COM")
    monkeypatch.setenv("LLMQ_PACKED_LINEARS", "0")
    monkeypatch.setenv("LLMQ_WORKER_STALE", "20.5")
    monkeypatch.delenv("LLMQ_REDIS_URL", raising=False)
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere:6380/0")
    s = Settings.from_env(max_num_seqs=3)
    assert (s.api_keys, s.allowed_hosts) == (("a", "b"), ("api.example.com",))
    assert s.packed_linears is False and s.worker_stale_s == 20.5 and s.max_num_seqs == 3
    assert s.redis_url == "redis://elsewhere:6380/0"


def test_keys_are_a_list_and_unset_or_empty_means_none(monkeypatch):
    monkeypatch.setenv("LLMQ_API_KEYS", " k1 , k2,")
    assert Settings.from_env().api_keys == ("k1", "k2")
    for empty in ("", "  "):
        monkeypatch.setenv("LLMQ_API_KEYS", empty)
        assert Settings.from_env().api_keys == ()


def test_the_api_refuses_to_start_on_a_key_list_naming_no_key():
    env = dict(os.environ, PYTHONPATH=ROOT, LLMQ_API_KEYS=",",
               LLMQ_REDIS_URL="redis://127.0.0.1:1/0")
    p = subprocess.run([sys.executable, "-c", "import app; app.create_app()"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "ValueError: LLMQ_API_KEYS=',' names no key" in p.stderr


def test_a_gpu_takes_larger_engine_defaults_where_none_is_set(monkeypatch):
    """On CUDA the engine's CPU-tuned defaults give way to a GPU's (a larger batch and step);
    a value set in the environment, or given explicitly, stays; a CPU changes nothing."""
    for var in ("LLMQ_MAX_NUM_SEQS", "LLMQ_MAX_NUM_BATCHED_TOKENS", "LLMQ_LONG_PREFILL_CHUNK",
                "LLMQ_LONG_PREFILL_TOKEN_THRESHOLD", "LLMQ_PREFILL_PASS_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LLMQ_LONG_PREFILL_CHUNK", "32")   # the CPU default, but chosen
    s = Settings.from_env()
    assert s.for_device("cpu") is s
    gpu = s.for_device("cuda:0")
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens, gpu.long_prefill_tokens,
            gpu.prefill_pass_tokens) == (256, 8192, 512, 2048)
    assert gpu.long_prefill_chunk == 32
    assert Settings(max_num_seqs=8).for_device("cuda").max_num_seqs == 8
