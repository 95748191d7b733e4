"""`make run` (scripts/run.sh) and Ctrl-C while work is in flight.

The script runs as a terminal runs it: in its own foreground process group, and Ctrl-C is
SIGINT to that whole group. It must stop the API, then the workers (drain within
LLMQ_SHUTDOWN_GRACE, hand the rest back), then Flower, then Redis, all within the grace + 10 s;
the next start finishes every job that was in flight. Redis has a password kept in the private
run folder, and nothing it writes there is readable by others.
"""
from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
from pathlib import Path

import psutil
import pytest
import redis

from support import ROOT, free_port, wait_until

from .factories import Api, running_with_tokens

pytestmark = [pytest.mark.slow, pytest.mark.integration]

GRACE_S = 3
MARGIN_S = 10          # the bound: every process gone within the grace + 10 s
START_S = 300          # Redis, a worker loading the model, the API and Flower, on a loaded host
LONG = {"max_tokens": 480, "ignore_eos": True, "temperature": 0}


def _default_sigint() -> None:
    # A shell that starts a job in the background ignores SIGINT in it, and a script cannot trap
    # a signal ignored on entry; a terminal's foreground job has the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class RunScript:
    """scripts/run.sh as a terminal's foreground job, its output in a file."""

    def __init__(self, env: dict, out: Path):
        self.env, self.out = env, out
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RunScript":
        self.out.write_text("")
        self.proc = subprocess.Popen(
            ["bash", "scripts/run.sh"], cwd=ROOT, env=self.env, stdout=self.out.open("w"),
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_default_sigint)
        return self

    def output(self) -> str:
        return self.out.read_text()

    def wait_output(self, text: str, timeout_s: float) -> None:
        def seen():
            if text in self.output():
                return True
            if self.proc.poll() is not None:
                raise AssertionError(f"run.sh exited ({self.proc.returncode}):\n{self.output()}")
            return False
        wait_until(seen, timeout_s, f"run.sh to print {text!r}")

    def processes(self) -> list[psutil.Process]:
        """The script and everything it started (each part runs in a session of its own, so
        the tree, not the process group, finds them)."""
        me = psutil.Process(self.proc.pid)
        return [me, *me.children(recursive=True)]

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)


def _names(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(" ".join(p.cmdline())[:80])
        except psutil.NoSuchProcess:
            pass
    return "\n".join(out)


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


@pytest.fixture
def run_env(tmp_path, tiny_model_dir) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "LLMQ_REDIS_URL", "LLMQ_API_KEYS")}
    env.update(
        LLMQ_RUN_DIR=str(tmp_path / "run"), REDIS_PORT=str(free_port()),
        LLMQ_HOST="127.0.0.1", LLMQ_PORT=str(free_port()), FLOWER_PORT=str(free_port()),
        LLMQ_MODEL=tiny_model_dir, WORKERS="1", LLMQ_SHUTDOWN_GRACE=str(GRACE_S),
        LLMQ_DEVICE="cpu", LLMQ_MAX_NUM_SEQS="16", LLMQ_LOG_FORMAT="text",
        # Two shared cores: one torch thread per process.
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", LLMQ_TORCH_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def test_ctrl_c_stops_everything_in_order_and_the_next_run_finishes_the_jobs(run_env, tmp_path):
    run_dir = Path(run_env["LLMQ_RUN_DIR"])
    first = RunScript(run_env, tmp_path / "run1.out")
    second = RunScript(run_env, tmp_path / "run2.out")
    started: list[psutil.Process] = []   # for the clean-up, whatever happens
    try:
        first.start()
        first.wait_output(" - ready.", START_S)
        started = first.processes()

        # Redis wants the password kept in the private run folder.
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        password = (run_dir / "redis.password").read_text().strip()
        assert len(password) >= 32
        port = int(run_env["REDIS_PORT"])
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        r = redis.Redis(port=port, password=password, decode_responses=True)
        assert r.ping()

        api = Api(f"http://127.0.0.1:{run_env['LLMQ_PORT']}")
        ids = [j["id"] for j in api.submit_many([f"Tell a long story {i}." for i in range(3)],
                                                **LONG)]
        wait_until(lambda: len(running_with_tokens(r, ids, 1)) == 3, 60, "the jobs to run")
        # Every file Redis wrote (the append-only file is full of prompts) is this user's only.
        for path in run_dir.rglob("*"):
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path

        procs = first.processes()
        assert len(procs) >= 6, _names(procs)   # run.sh, redis, worker + model, api, flower
        first.ctrl_c()
        first.wait_output("Ctrl-C again stops everything at once", 10)
        _gone, alive = psutil.wait_procs(procs, timeout=GRACE_S + MARGIN_S)
        assert not alive, f"still running after the grace + {MARGIN_S} s:\n{_names(alive)}\n" \
                          f"{first.output()}"
        assert first.proc.wait(5) == 0, first.output()

        # The order: the API, the workers, Flower, Redis last; the worker reached Redis
        # for what it handed back.
        out = first.output()
        steps = ["stopping the API", "stopping the workers", "stopping Flower",
                 "stopping Redis", "stopped."]
        at = [out.find(s) for s in steps]
        assert -1 not in at and at == sorted(at), out
        worker_log = (run_dir / "worker0.log").read_text()
        assert "could not hand back" not in worker_log, worker_log[-3000:]

        # The next run finishes every one of those jobs.
        second.start()
        second.wait_output(" - ready.", START_S)
        started = second.processes()
        for seq_id in ids:
            job = api.wait_job(seq_id, 240)
            assert job["status"] == "succeeded", job
            assert job["usage"]["completion_tokens"] == LONG["max_tokens"], job

        procs = second.processes()
        second.ctrl_c()
        _gone, alive = psutil.wait_procs(procs, timeout=GRACE_S + MARGIN_S)
        assert not alive, _names(alive)
    finally:
        for script in (first, second):
            if script.proc is not None and script.proc.poll() is None:
                started += script.processes()
        _kill(started)


def test_a_part_that_cannot_start_is_said_at_once_and_stops_the_rest(run_env, tmp_path):
    """The API's port is taken: gunicorn exits at once, and run.sh printed dots for ten
    minutes, then "try: curl ...". It must say which part died, show its log, stop the others
    and exit non-zero."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", int(run_env["LLMQ_PORT"])))
    taken.listen()
    script = RunScript(run_env, tmp_path / "run.out").start()
    started: list[psutil.Process] = []
    try:
        wait_until(lambda: (started.extend(p for p in script.processes() if p not in started)
                            or script.proc.poll() is not None), START_S, "run.sh to exit")
        out = script.output()
        assert script.proc.returncode == 1, out
        assert "the API exited before the service was ready" in out
        assert "try: curl" not in out
        left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, _names(left)   # the worker, Flower and Redis were stopped
    finally:
        taken.close()
        _kill(started)


def _taken_not_listening(port: int) -> socket.socket | None:
    """A socket bound to the port that does not listen, as an outbound connection's local port
    is: nothing answers there, and a server cannot bind it. None when the port is in use."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    return s


def test_a_redis_without_a_password_on_the_port_is_not_used(run_env, tmp_path):
    """Debian's redis-server service answers on 6379 without a password once installed, and
    make run used it (with a warning): any local user could read every prompt. llmq starts its
    own, with its password, on the next port it can bind: the one after is taken by a socket
    that does not listen (it looks free; Redis exited on it and the worker met no Redis)."""
    while (blocker := _taken_not_listening(int(run_env["REDIS_PORT"]) + 1)) is None:
        run_env["REDIS_PORT"] = str(free_port())
    port = int(run_env["REDIS_PORT"])
    open_redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                   "--save", "", "--appendonly", "no"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    script = RunScript(run_env, tmp_path / "run.out")
    started: list[psutil.Process] = []
    try:
        plain = redis.Redis(port=port, decode_responses=True)
        wait_until(lambda: _pings(plain), 10, "the password-less Redis")
        script.start()
        script.wait_output(" - ready.", START_S)
        started = script.processes()
        out = script.output()
        assert f"127.0.0.1:{port} answers WITHOUT a password: not used" in out, out
        assert plain.keys("llmq:*") == [] and plain.keys("_kombu*") == []
        # The README's `redis-cli -u "$(bash scripts/redis.sh url)"` (no REDIS_PORT) reaches
        # llmq's Redis, not the open one, nor the taken port.
        env = {k: v for k, v in run_env.items() if k != "REDIS_PORT"}
        url = subprocess.run(["bash", "scripts/redis.sh", "url"], cwd=ROOT, env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
        assert f":{port}/" not in url and f":{port + 1}/" not in url, url
        assert redis.Redis.from_url(url).ping()
        procs = script.processes()
        script.ctrl_c()
        _gone, alive = psutil.wait_procs(procs, timeout=GRACE_S + MARGIN_S)
        assert not alive, _names(alive)
    finally:
        if script.proc is not None and script.proc.poll() is None:
            started += script.processes()
        _kill(started)
        open_redis.kill()
        open_redis.wait(10)
        blocker.close()


def test_a_redis_that_cannot_start_stops_the_run_with_its_log(run_env, tmp_path):
    """REDIS_PORT as set, taken: the script said Redis was up after 10 s of no answer and
    started the workers, which died on 'Connection refused'. It stops with Redis's reason."""
    while (blocker := _taken_not_listening(int(run_env["REDIS_PORT"]))) is None:
        run_env["REDIS_PORT"] = str(free_port())
    script = RunScript(run_env, tmp_path / "run.out").start()
    try:
        assert script.proc.wait(60) == 1, script.output()
        out = script.output()
        assert f"did not start on 127.0.0.1:{run_env['REDIS_PORT']}" in out, out
        assert "Address already in use" in out, out
        assert "worker:" not in out, out
    finally:
        if script.proc.poll() is None:
            _kill(script.processes())
        blocker.close()


def _pings(client) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False
