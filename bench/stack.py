"""The served stack the benchmark drives: its own redis-server, one Celery worker and the API
under gunicorn (gthread), all on free loopback ports, each in its own process group so that
stopping one also stops what it spawned (the worker's model process)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition", interval: float = 0.05):
    """Polls an observable condition (not a sleep-and-hope); returns its first truthy value.
    The tests use it too (tests/support.py)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class Proc:
    """A child process in its own session (so its whole group can be signalled)."""

    def __init__(self, name: str, argv: list[str], env: dict, log_path: Path, cwd: Path = ROOT):
        self.name, self.argv, self.env, self.log_path, self.cwd = name, argv, env, log_path, cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Proc":
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; "
                               f"log {self.log_path}:\n{_tail(self.log_path)}")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the leader (a graceful stop), then SIGKILL to the whole group."""
        if self.proc is None:
            return
        pgid = self.proc.pid   # session leader: its pid is the group id
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:
            os.killpg(pgid, signal.SIGKILL)   # stragglers: the model process, gunicorn workers
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None


class Stack:
    """redis-server + one worker + the API. `restart_worker(...)` swaps the worker's settings.
    `root`: the source tree whose worker and API run (another commit's, for the baseline
    comparison), with this venv and this redis-server."""

    def __init__(self, workdir: Path, *, max_num_seqs: int = 64, device: str = "cpu",
                 backend: str = "transformers",
                 dtype: str = "float32", api_workers: int = 2, api_threads: int = 256,
                 api_app: str = "app.wsgi:application", log=print, root: Path = ROOT,
                 extra_paths: tuple[Path, ...] = (), extra_env: dict[str, str] | None = None,
                 metrics_key: str | None = None, task_threads: int | None = None):
        self.root = Path(root)
        self.extra_paths = [str(p) for p in extra_paths]   # ahead of the venv (an overlay)
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.redis_port = free_port()
        self.api_port = free_port()
        self.max_num_seqs = max_num_seqs
        # The worker's Celery task threads (default: one per batch slot). scripts/worker.sh
        # starts a quarter more, which is what lets another key's sequence reach the engine
        # while one key fills the batch: a phase about tenants runs that.
        self.task_threads = task_threads or max_num_seqs
        self.device, self.dtype = device, dtype
        self.backend = backend
        self.api_workers, self.api_threads = api_workers, api_threads
        self.api_app = api_app
        self.log = log
        self.extra_env = dict(extra_env or {})   # settings of the API and the worker
        # With API keys set, /readyz lists the workers only to a key in LLMQ_METRICS_KEYS.
        self.auth = {"Authorization": f"Bearer {metrics_key}"} if metrics_key else {}
        self.redis: Proc | None = None
        self.worker: Proc | None = None
        self.delivery: Proc | None = None   # webhook deliveries' worker, where a phase needs it
        self.api: Proc | None = None
        self.worker_name = ""
        self._worker_count = 0
        self.worker_start_s: float | None = None   # the last worker start, until ready

    @property
    def redis_url(self) -> str:
        return f"redis://{HOST}:{self.redis_port}/0"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.api_port}"

    def base_env(self) -> dict:
        env = dict(os.environ)
        env.pop("REDIS_URL", None)
        env.update(LLMQ_REDIS_URL=self.redis_url, LLMQ_MODEL="smollm2",
                   LLMQ_MAX_NUM_SEQS=str(self.max_num_seqs), LLMQ_DEVICE=self.device,
                   LLMQ_DTYPE=self.dtype, LLMQ_BACKEND=self.backend, LLMQ_HOST=HOST, LLMQ_PORT=str(self.api_port),
                   PYTHONUNBUFFERED="1")
        # The tree's own packages first (the venv's editable install points at one tree), and
        # not this checkout's when another tree runs.
        rest = [p for p in (env.get("PYTHONPATH") or "").split(os.pathsep)
                if p and Path(p).resolve() not in (self.root.resolve(), ROOT)]
        env["PYTHONPATH"] = os.pathsep.join([str(self.root), *self.extra_paths, *rest])
        env.pop("LLMQ_API_KEYS", None)   # the benchmark sends no key
        env.update(self.extra_env)
        return env

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self, batch_policy: str = "continuous", timeout_s: float = 300.0) -> "Stack":
        exe = shutil.which("redis-server")
        if not exe:
            raise RuntimeError("redis-server is not installed (make setup installs it)")
        self.redis = Proc("redis-server", [exe, "--port", str(self.redis_port), "--bind", HOST,
                                           "--save", "", "--appendonly", "no",
                                           "--dir", str(self.workdir)],
                          dict(os.environ), self.workdir / "redis.log").start()
        import redis

        client = redis.Redis(host=HOST, port=self.redis_port)

        def ping():
            self.redis.check_alive()
            try:
                return client.ping()
            except redis.RedisError:
                return False

        wait_until(ping, 15, "redis-server to answer")
        client.close()
        self.api = Proc("api", [sys.executable, "-m", "gunicorn", "--bind", f"{HOST}:{self.api_port}",
                                "--worker-class", self.http_worker_class(), "--workers", str(self.api_workers),
                                "--threads", str(self.api_threads), "--timeout", "0",
                                "--graceful-timeout", "5", self.api_app],
                        self.base_env(), self.workdir / "api.log", self.root).start()
        self.start_worker(batch_policy, timeout_s)
        return self

    def http_worker_class(self) -> str:
        """The tree's own gunicorn worker; trees older than app/http_worker.py served gthread."""
        return ("app.http_worker.ThreadWorker" if (self.root / "app" / "http_worker.py").exists()
                else "gthread")

    def start_worker(self, batch_policy: str, timeout_s: float = 300.0) -> None:
        self._worker_count += 1
        self.worker_name = f"llmq-bench-{batch_policy}{self._worker_count}@{socket.gethostname()}"
        env = self.base_env()
        env["LLMQ_BATCH_POLICY"] = batch_policy
        self.worker = Proc(f"worker ({batch_policy})",
                           [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker",
                            "--pool", "threads", "--concurrency", str(self.task_threads),
                            "--queues", env.get("LLMQ_QUEUE", "llmq"), "--prefetch-multiplier", "1",
                            "--task-events", "--hostname", self.worker_name,
                            "--loglevel", env.get("LLMQ_LOG_LEVEL", "INFO"),
                            "--without-mingle", "--without-gossip"],
                           env, self.workdir / f"worker{self._worker_count}-{batch_policy}.log",
                           self.root).start()
        t = time.monotonic()
        self.wait_ready(timeout_s)
        self.worker_start_s = time.monotonic() - t   # what a restart costs, for time budgets

    def wait_ready(self, timeout_s: float) -> None:
        """Until /readyz (through gunicorn) lists this run's worker with its model loaded."""
        session = requests.Session()
        session.headers.update(self.auth)

        def ready():
            self.api.check_alive()
            self.worker.check_alive()
            try:
                r = session.get(f"{self.url}/readyz", timeout=2)
            except requests.RequestException:
                return False
            if r.status_code != 200:
                return False
            return any(w.get("name") == self.worker_name for w in r.json().get("workers", []))

        try:
            wait_until(ready, timeout_s, "the API and the worker to be ready", interval=0.25)
        finally:
            session.close()

    COUNTERS = ("num_steps", "num_finished", "prefill_tokens", "prefix_cached_tokens",
                "num_held_steps", "num_interjected")

    def worker_report(self) -> dict[str, str]:
        """What the stack's worker reports in its heartbeat (/readyz): its dtype, KV cache dtype
        and kernels beside its counters."""
        r = requests.get(f"{self.url}/readyz", headers=self.auth, timeout=5)
        return next((w for w in r.json().get("workers", []) if w.get("name") == self.worker_name),
                    {})

    def worker_info(self, settle_s: float = 10.0) -> dict[str, float]:
        """The worker's counters and StepTiming totals (from its heartbeat), once they stop
        moving (the heartbeat lags the last step by up to LLMQ_WORKER_HEARTBEAT)."""
        last, deadline = None, time.monotonic() + settle_s
        while time.monotonic() < deadline:
            r = requests.get(f"{self.url}/readyz", headers=self.auth, timeout=5)
            w = next((w for w in r.json().get("workers", []) if w.get("name") == self.worker_name), {})
            now = {k: float(v) for k, v in w.items()
                   if k.startswith("timing_") or k in self.COUNTERS}
            if now and now == last:
                return now
            last = now
            time.sleep(1.0)
        return last or {}

    def worker_timing(self, settle_s: float = 10.0) -> dict[str, float]:
        """The worker's StepTiming totals (timing_* of its heartbeat, without the prefix)."""
        return {k[len("timing_"):]: v for k, v in self.worker_info(settle_s).items()
                if k.startswith("timing_")}

    def start_delivery_worker(self, threads: int = 16) -> None:
        """A delivery worker as scripts/delivery.sh starts it: webhook deliveries on their own
        queue and pool, no model. Not waited for: deliveries wait in their queue until it is up."""
        env = self.base_env()
        self.delivery = Proc("delivery worker",
                             [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker",
                              "--pool", "threads", "--concurrency", str(threads),
                              "--queues", f"{env.get('LLMQ_QUEUE', 'llmq')}.webhooks",
                              "--prefetch-multiplier", "1", "--hostname",
                              f"llmq-bench-delivery@{socket.gethostname()}",
                              "--loglevel", env.get("LLMQ_LOG_LEVEL", "INFO"),
                              "--without-mingle", "--without-gossip"],
                             env, self.workdir / "delivery.log", self.root).start()

    def restart_worker(self, batch_policy: str, timeout_s: float = 300.0) -> None:
        if self.worker is not None:
            self.worker.stop(grace_s=20)
        self.start_worker(batch_policy, timeout_s)

    def stop(self) -> None:
        for attr in ("api", "worker", "delivery", "redis"):
            proc = getattr(self, attr)
            if proc is not None:
                try:
                    proc.stop(grace_s=10 if attr != "redis" else 5)
                except Exception:  # noqa: BLE001 - stop the others whatever happens
                    pass
                setattr(self, attr, None)
