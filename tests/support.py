"""Test helpers shared by every folder: a real redis-server, the tiny random model, a real Celery
worker process, the real HTTP app, and wait_until. Imported as `support` (the name `conftest`
is ambiguous: tests/worker has a conftest of its own)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

# The loopback-port and wait-for-an-event helpers are the benchmark's (bench/stack.py): one copy.
from bench.stack import free_port, wait_until  # noqa: F401 - re-exported to the tests

ROOT = Path(__file__).resolve().parents[1]


# --- Redis ------------------------------------------------------------------------------------
class RedisServer:
    """A real redis-server on a free loopback port, in a temp dir."""

    def __init__(self, workdir: Path, appendonly: bool = False):
        self.port = free_port()
        self.workdir = workdir
        self.appendonly = appendonly
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        exe = shutil.which("redis-server")
        if not exe:
            pytest.skip("redis-server is not installed (make test installs it)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port)
        wait_until(lambda: _ping(client), 10, "redis-server to answer")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def _ping(client) -> bool:
    try:
        return client.ping()
    except Exception:  # noqa: BLE001
        return False


def build_tiny_model(target: Path, tokenizer_dir: str, seed: int = 0, head_dim: int = 16) -> str:
    """A tiny random Llama with the default model's tokenizer, built from a config (vLLM's CPU
    attention takes head_dim 32 and up: its tiny model has two heads of 64)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    heads = 64 // head_dim if head_dim <= 32 else 2
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=heads * head_dim, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(target)
    tok.save_pretrained(target)
    return str(target)


# --- backends ---------------------------------------------------------------------------------
def backend_params() -> list:
    """pytest params: every backend the model worker has that can run here, or those named in
    LLMQ_TEST_BACKENDS (comma-separated; `make test-slow-engine` reruns only transformers: the
    slowed engine step is the same code on every backend)."""
    import importlib.util

    import pytest

    chosen = [b for b in os.environ.get("LLMQ_TEST_BACKENDS", "").split(",") if b]

    def param(name: str, module: str | None = None, make: str = ""):
        if chosen and name not in chosen:
            return pytest.param(name, marks=pytest.mark.skip(
                reason=f"LLMQ_TEST_BACKENDS={','.join(chosen)}"))
        missing = module is not None and importlib.util.find_spec(module) is None
        return pytest.param(name, marks=pytest.mark.skipif(
            missing, reason=f"{module} is not installed (make {make})"))

    return [param("transformers"), param("llama_cpp", "llama_cpp", "llama-cpp"),
            param("vllm", "vllm", "vllm")]


# vLLM in tests: a 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE) and 512 tokens of context.
VLLM_TEST_ENV = {"LLMQ_BACKEND": "vllm", "LLMQ_KV_CACHE_MB": "1024", "LLMQ_MAX_MODEL_LEN": "512"}


def backend_worker(backend: str, request) -> tuple[str, dict]:
    """(LLMQ_MODEL, extra worker env) for a backend: the tiny random model on transformers and
    (with heads vLLM's CPU kernels take) on vLLM, the default model's GGUF on llama.cpp (1024
    tokens of context per sequence is plenty)."""
    if backend == "transformers":
        return request.getfixturevalue("tiny_model_dir"), {}
    if backend == "vllm":
        return request.getfixturevalue("tiny_vllm_model_dir"), dict(VLLM_TEST_ENV)
    return "smollm2", {"LLMQ_BACKEND": backend, "LLMQ_MAX_MODEL_LEN": "1024"}


def public_model_name(model: str) -> str:
    """The name the API serves a model under (the OpenAI routes' `model`)."""
    return "SmolLM2-135M-Instruct" if model == "smollm2" else Path(model).name


# --- engine speed -----------------------------------------------------------------------------
# A seed the test workers fail a sequence on in the model process's sampling (the test hook
# LLMQ_TEST_FAIL_SEED): the tests of a failure while running (a 500, an error chunk).
FAIL_SEED = 990001
FAIL_ENV = {"LLMQ_TEST_FAIL_SEED": str(FAIL_SEED)}


def min_step_env(floor_s: float) -> dict:
    """Worker env whose engine steps take at least `floor_s` (LLMQ_TEST_STEP_DELAY, a test
    hook), or the suite's own delay where that is longer (a run with a slowed engine: `make
    test-slow-engine`). For tests that act while work is running: N tokens then last at least
    N * floor_s on any machine, so the work is still running when the test acts."""
    from common.test_hooks import HarnessHooks

    return {"LLMQ_TEST_STEP_DELAY": str(max(HarnessHooks.from_env().step_delay_s, floor_s))}


# --- processes --------------------------------------------------------------------------------
class WorkerProcess:
    """A real Celery worker (threads pool, its own model process) as `make worker` starts it."""

    def __init__(self, redis_url: str, model: str, log_path: Path, name: str = "w1",
                 extra_env: dict | None = None):
        self.redis_url, self.model, self.log_path, self.name = redis_url, model, log_path, name
        self.extra_env = extra_env or {}
        self.proc = None

    @property
    def hostname(self) -> str:
        return f"{self.name}@test"

    def env(self) -> dict:
        env = dict(os.environ, LLMQ_REDIS_URL=self.redis_url, LLMQ_MODEL=self.model,
                   LLMQ_MAX_NUM_SEQS="64", LLMQ_WORKER_HEARTBEAT="0.2", PYTHONUNBUFFERED="1")
        env.update(self.extra_env)
        return env

    def pool(self) -> tuple[str, str]:
        """(its task threads, its queue: with LLMQ_MODELS, its model's, as scripts/worker.sh)."""
        from unittest import mock

        from common.settings import Settings

        env = self.env()
        queue = env.get("LLMQ_QUEUE", "llmq")
        if env.get("LLMQ_MODELS"):
            with mock.patch.dict(os.environ, env, clear=True):
                queue = Settings.from_env().served_model.queue
        return env.get("LLMQ_TASK_THREADS", env["LLMQ_MAX_NUM_SEQS"]), queue

    def start(self, wait_ready: bool = True) -> "WorkerProcess":
        log = open(self.log_path, "ab")
        threads, queue = self.pool()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker",
             "--pool", "threads", "--concurrency", threads,
             "--queues", queue, "--prefetch-multiplier", "1",
             "--task-events",
             "--hostname", self.hostname, "--loglevel", "INFO", "--without-mingle",
             "--without-gossip"],
            cwd=ROOT, env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        if wait_ready:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until the worker reports its model loaded (~10 s alone; minutes on a shared CPU)."""
        import redis

        from common.store import SequenceStore

        store = SequenceStore(redis.Redis.from_url(self.redis_url, decode_responses=True))

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited: {self.log_path.read_text()[-3000:]}")
            return any(w["name"] == self.hostname and w.get("model_loaded") == "1"
                       for w in store.live_workers(30))

        wait_until(ready, timeout_s, "the worker to load its model")

    def stop(self, sig=None) -> None:
        self.signal(sig)
        self.wait_stopped()

    def signal(self, sig=None) -> None:
        import signal as _s

        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig or _s.SIGTERM)

    def wait_stopped(self) -> None:
        if self.proc:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class DeliveryWorkerProcess(WorkerProcess):
    """A real delivery worker (webhook deliveries' own queue and pool, no model) as
    scripts/delivery.sh starts it."""

    def pool(self) -> tuple[str, str]:
        env = self.env()
        return env.get("LLMQ_WEBHOOK_THREADS", "4"), env.get("LLMQ_QUEUE", "llmq") + ".webhooks"

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until Celery says it is ready (it loads no model: seconds)."""
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"delivery worker exited: {self.log_path.read_text()[-3000:]}")
            return f"{self.hostname} ready." in self.log_path.read_text(errors="replace")

        wait_until(ready, timeout_s, "the delivery worker to be ready")


def stop_workers(workers) -> None:
    """SIGTERM to all, then wait for all: their shutdowns overlap."""
    for w in workers:
        w.signal()
    for w in workers:
        w.wait_stopped()


class ApiServer:
    """The real Flask app behind a real threaded HTTP server on a loopback port."""

    def __init__(self, settings):
        from werkzeug.serving import make_server

        from app import create_app

        self.app = create_app(settings)
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "ApiServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
