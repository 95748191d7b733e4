"""Small factories for the fault tests: each test builds its own world (its own redis-server on a
free port, its own Celery workers on the tiny model, its own HTTP API) and tears it down.

Nothing here sleeps to synchronise: helpers poll state a person could observe (HTTP answers,
Redis keys, process tables) with `wait_until`.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis
import requests

from support import (FAIL_ENV, ApiServer, DeliveryWorkerProcess, RedisServer, WorkerProcess,
                     min_step_env, wait_until)

STALE_S = 3.0          # LLMQ_WORKER_STALE of every world: a silent worker is dead after 3 s
HEARTBEAT_S = 0.2      # LLMQ_WORKER_HEARTBEAT
# What a busy machine may add to a delay the code promises (a bound that is a test's point is
# that setting plus this); generous, since the CPU may be shared and slow.
SLACK_S = 10.0
HTTP_TIMEOUT = 30
FINISHED = ("succeeded", "failed", "cancelled")


# --- processes ----------------------------------------------------------------------------------
def model_process(worker: WorkerProcess, timeout_s: float = 30.0) -> psutil.Process:
    """The worker's model-worker process: its spawned Python child (found in the process table,
    not guessed from logs). Waits for it, since a restarted one takes a moment to appear."""
    parent = psutil.Process(worker.proc.pid)

    def child():
        try:
            for c in parent.children(recursive=True):
                # multiprocessing's spawn runs `python -c "from multiprocessing.spawn import
                # spawn_main; ..."`; its resource tracker is another child, told apart here.
                cmd = " ".join(c.cmdline())
                if "spawn_main" in cmd and c.status() != psutil.STATUS_ZOMBIE:
                    return c
        except psutil.NoSuchProcess:
            return None
        return None

    return wait_until(child, timeout_s, f"the model process of {worker.hostname}")


def kill_hard(worker: WorkerProcess) -> None:
    """SIGKILL the Celery worker and its model process together, as an OOM killer or a lost
    host would: nothing runs a handler, nothing is handed back."""
    model = model_process(worker)
    os.kill(worker.proc.pid, signal.SIGKILL)
    model.kill()
    worker.proc.wait(10)
    psutil.wait_procs([model], timeout=10)


# --- the world ----------------------------------------------------------------------------------
class World:
    """One test's redis-server, workers and APIs; `close()` stops every one of them."""

    def __init__(self, tmp_path: Path, model_dir: str):
        self.tmp = tmp_path
        self.model_dir = model_dir
        self.redis_server: RedisServer | None = None
        self.workers: list[WorkerProcess] = []
        self.apis: list[ApiServer] = []
        self._clients: list[redis.Redis] = []

    # Redis -------------------------------------------------------------------------------------
    def start_redis(self, appendonly: bool = False) -> RedisServer:
        d = self.tmp / "redis"
        d.mkdir(exist_ok=True)
        self.redis_server = RedisServer(d, appendonly=appendonly).start()
        return self.redis_server

    @property
    def url(self) -> str:
        return self.redis_server.url

    def client(self) -> redis.Redis:
        c = redis.Redis.from_url(self.url, decode_responses=True)
        self._clients.append(c)
        return c

    # workers -----------------------------------------------------------------------------------
    def worker(self, name: str = "w1", *, start: bool = True, wait: bool = True,
               min_step_s: float = 0.0, **env: str) -> WorkerProcess:
        """A real Celery worker on the tiny model with a short heartbeat and staleness; with
        `min_step_s`, each engine step lasts at least that long (see support.min_step_env)."""
        base = {"LLMQ_WORKER_STALE": str(STALE_S), "LLMQ_WORKER_HEARTBEAT": str(HEARTBEAT_S),
                "LLMQ_MAX_NUM_SEQS": "16", "LLMQ_DEVICE": "cpu",
                # Two shared cores: one torch thread per process keeps workers from fighting.
                "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LLMQ_TORCH_THREADS": "1",
                "LLMQ_LOG_FORMAT": "text", **FAIL_ENV}
        if min_step_s:
            base.update(min_step_env(min_step_s))
        base.update(env)
        w = WorkerProcess(self.url, self.model_dir, self.tmp / f"{name}.log", name=name,
                          extra_env=base)
        self.workers.append(w)
        if start:
            w.start(wait_ready=wait)
        return w

    def delivery_worker(self, name: str = "d1", *, wait: bool = True, **env: str
                        ) -> WorkerProcess:
        """A real delivery worker: webhook deliveries on their own queue and pool."""
        base = {"LLMQ_WORKER_STALE": str(STALE_S), "LLMQ_WORKER_HEARTBEAT": str(HEARTBEAT_S),
                "LLMQ_LOG_FORMAT": "text", **env}
        w = DeliveryWorkerProcess(self.url, self.model_dir, self.tmp / f"{name}.log", name=name,
                                  extra_env=base)
        self.workers.append(w)
        return w.start(wait_ready=wait)

    # API ---------------------------------------------------------------------------------------
    def api(self, **overrides: Any) -> "Api":
        from common.settings import Settings

        values = dict(redis_url=self.url, model=self.model_dir, worker_stale_s=STALE_S,
                      sse_keepalive_s=1.0)
        values.update(overrides)
        server = ApiServer(Settings.from_env(**values)).start()
        self.apis.append(server)
        return Api(server.url)

    # teardown ----------------------------------------------------------------------------------
    def close(self) -> None:
        errors = []
        for api in self.apis:
            try:
                api.stop()
            except Exception as exc:  # noqa: BLE001 - stop the rest all the same
                errors.append(exc)
        for w in self.workers:
            try:
                if w.proc is not None and w.proc.poll() is None:
                    kids = psutil.Process(w.proc.pid).children(recursive=True)
                    w.stop(signal.SIGKILL)       # no grace needed at teardown
                    for k in kids:
                        try:
                            k.kill()
                        except psutil.NoSuchProcess:
                            pass
                    psutil.wait_procs(kids, timeout=10)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        for c in self._clients:
            c.close()
        if self.redis_server is not None:
            self.redis_server.stop()
        if errors:
            raise errors[0]


# --- HTTP -------------------------------------------------------------------------------------
@dataclass
class Api:
    """A thin HTTP client of one API server (optionally with a bearer key)."""

    url: str
    key: str | None = None

    def with_key(self, key: str | None) -> "Api":
        return Api(self.url, key)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def request(self, method: str, path: str, **kw) -> requests.Response:
        kw.setdefault("timeout", HTTP_TIMEOUT)
        headers = {**self.headers, **kw.pop("headers", {})}
        return requests.request(method, self.url + path, headers=headers, **kw)

    def submit(self, **body) -> dict:
        r = self.request("POST", "/v1/jobs", json=body)
        assert r.status_code == 202, r.text
        return r.json()

    def submit_many(self, prompts: list[str], **body) -> list[dict]:
        r = self.request("POST", "/v1/jobs", json={"prompts": prompts, **body})
        assert r.status_code == 202, r.text
        return r.json()["jobs"]

    def job(self, seq_id: str) -> dict:
        """The job as GET answers it, less the `metrics` GET adds to a finished one (the job
        a done event carries has none), so that the two compare equal."""
        r = self.request("GET", f"/v1/jobs/{seq_id}")
        assert r.status_code == 200, r.text
        job = r.json()
        job.pop("metrics", None)
        return job

    def wait_job(self, seq_id: str, timeout_s: float = 90.0) -> dict:
        def finished():
            job = self.job(seq_id)
            return job if job["status"] in FINISHED else None
        return wait_until(finished, timeout_s, f"job {seq_id} to finish", interval=0.1)

    def stream(self, seq_id: str, timeout_s: float = 120.0,
               reconnect: bool = False) -> "StreamReader":
        return StreamReader(self, seq_id, timeout_s, reconnect).start()


# --- SSE ----------------------------------------------------------------------------------------
@dataclass
class SSEEvent:
    id: str | None
    event: str
    data: dict


@dataclass
class StreamReader:
    """Reads GET /v1/jobs/<id>/stream in a thread, from before a fault until the done event,
    as a client that stays connected through the fault would. With `reconnect`, it behaves like
    a browser's EventSource: when the connection breaks (or is refused with a 503) it connects
    again after the server's `retry:` delay, sending Last-Event-ID, and counts `reconnects`."""

    api: Api
    seq_id: str
    timeout_s: float
    reconnect: bool = False
    events: list[SSEEvent] = field(default_factory=list)
    reconnects: int = 0
    resumed_after: list[str] = field(default_factory=list)   # Last-Event-IDs a 200 resumed
    error: BaseException | None = None
    _thread: threading.Thread | None = None

    def start(self) -> "StreamReader":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        retry_s, last_id = 1.0, None
        while True:
            try:
                headers = {"Last-Event-ID": last_id} if last_id else {}
                with self.api.request("GET", f"/v1/jobs/{self.seq_id}/stream", stream=True,
                                      headers=headers, timeout=self.timeout_s) as resp:
                    if not (self.reconnect and resp.status_code == 503):
                        assert resp.status_code == 200, resp.text
                        if last_id:
                            self.resumed_after.append(last_id)
                        for ev in parse_sse(resp):
                            if ev.event == "retry":
                                retry_s = ev.data / 1000
                                continue
                            self.events.append(ev)
                            last_id = ev.id or last_id
                            if ev.event == "done":
                                return
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
                if not self.reconnect:
                    self.error = exc
                    return
            except BaseException as exc:  # noqa: BLE001 - reported by result()
                self.error = exc
                return
            if not self.reconnect or time.monotonic() > deadline:
                self.error = AssertionError(f"stream of {self.seq_id} ended without done")
                return
            self.reconnects += 1
            threading.Event().wait(retry_s)   # EventSource's reconnection delay (retry: ms)

    def result(self, timeout_s: float | None = None) -> "StreamReader":
        self._thread.join(timeout_s if timeout_s is not None else self.timeout_s)
        assert not self._thread.is_alive(), f"stream of {self.seq_id} did not end"
        if self.error is not None:
            raise self.error
        return self

    @property
    def kinds(self) -> list[str]:
        return [e.event for e in self.events]

    @property
    def done(self) -> dict:
        dones = [e for e in self.events if e.event == "done"]
        assert len(dones) == 1, self.kinds
        return dones[0].data

    def texts_after_last_reset(self) -> str:
        last = max((i for i, e in enumerate(self.events) if e.event == "reset"), default=-1)
        return "".join(e.data["text"] for e in self.events[last + 1:] if e.event == "token")


def parse_sse(resp: requests.Response):
    """SSE fields this server writes (id, event, data, retry), split on bytes before decoding;
    a `retry:` field comes out as an event named "retry" whose data is the delay in ms."""
    buf, cur = b"", {}
    for chunk in resp.iter_content(chunk_size=None):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.rstrip(b"\r").decode("utf-8")
            if not line:
                if "data" in cur:
                    yield SSEEvent(cur.get("id"), cur.get("event", "message"),
                                   json.loads(cur["data"]))
                elif cur.get("retry", "").isdigit():
                    yield SSEEvent(None, "retry", int(cur["retry"]))
                cur = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                cur[name] = value[1:] if value.startswith(" ") else value


# --- Redis-side checks --------------------------------------------------------------------------
def stream_kinds(r: redis.Redis, seq_id: str) -> list[str]:
    """The kinds of every event stored for a sequence (what any reader would be sent)."""
    return [f["event"] for _id, f in r.xrange(f"llmq:seq:{seq_id}:events")]


def worker_info(r: redis.Redis, hostname: str) -> dict:
    return r.hgetall(f"llmq:worker:{hostname}")


def record(r: redis.Redis, seq_id: str) -> dict:
    return r.hgetall(f"llmq:seq:{seq_id}")


def assert_all_succeeded_once(api: Api, r: redis.Redis, ids: list[str], max_tokens: int,
                              timeout_s: float = 120.0) -> dict[str, dict]:
    """Every sequence ends succeeded with its full length and exactly one done event."""
    finals = {}
    for seq_id in ids:
        job = api.wait_job(seq_id, timeout_s)
        assert job["status"] == "succeeded", job
        assert job["finish_reason"] == "length", job
        assert job["usage"]["completion_tokens"] == max_tokens, job
        kinds = stream_kinds(r, seq_id)
        assert kinds.count("done") == 1, (seq_id, kinds)
        assert kinds[-1] == "done", (seq_id, kinds)
        finals[seq_id] = job
    return finals


def running_with_tokens(r: redis.Redis, ids: list[str], n: int) -> list[str]:
    """Ids whose record is running with at least n tokens published."""
    out = []
    for seq_id in ids:
        rec = record(r, seq_id)
        if rec.get("status") == "running" and int(rec.get("completion_tokens") or 0) >= n:
            out.append(seq_id)
    return out


def statuses(r: redis.Redis, ids: list[str]) -> list[str]:
    return [r.hget(f"llmq:seq:{i}", "status") for i in ids]


def elapsed(fn, *a, **kw):
    t0 = time.monotonic()
    out = fn(*a, **kw)
    return out, time.monotonic() - t0
