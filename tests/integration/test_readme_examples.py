"""Every example of README.md, run as a reader would against a stack like `make run`'s (the
default model, SmolLM2-135M-Instruct, on the default backend): each must print an answer.

The ```bash and ```python blocks are taken from README.md itself, so an example that is edited
is the one tested. The stack is the tests' own (a free port for Redis and the API), so the
examples' `http://127.0.0.1:8000` is replaced with its address. Bash blocks share `$ID` as a
reader's shell would (the jobs example sets it, the stream example reads it); a python block
runs after the python blocks before it (the Batch API example uses their `client`), whose
output is not its own.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from support import ROOT, ApiServer, WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.integration]

QUEUE = "llmq-readme"   # its own queue: the shared tiny stack's worker must not take these
README_URL = "http://127.0.0.1:8000"
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.M | re.S)
TIMEOUT_S = 600   # one example, the Batch API's included, on a busy 2-core machine

# Blocks that are not run, and why. Each is matched by a piece of its text.
NOT_RUN = {
    "make run": "starts the stack this test stands in for",
    "make test": "runs the whole suite, this test included",
    # A delivery needs LLMQ_WEBHOOK_SECRET and a receiver on the internet (example.com);
    # tests/integration/test_jobs_api.py and the webhook tests deliver to a local receiver.
    "example.com": "delivers to a receiver outside this machine",
    # SUBSCRIBE waits for messages until interrupted and pub/sub keeps nothing, so it prints
    # only what is published after it subscribes (tests/integration/test_streaming.py).
    "SUBSCRIBE": "waits for pub/sub messages until interrupted",
}


def readme_blocks() -> list[tuple[str, str]]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def skip_reason(code: str) -> str | None:
    return next((why for piece, why in NOT_RUN.items() if piece in code), None)


@pytest.fixture(scope="module")
def readme_stack(tmp_path_factory, redis_server, default_model_dir):
    """Redis, one worker and the API on the default model, as `make run` starts them (the
    default model from its converted checkpoint, `LLMQ_MODEL=smollm2`)."""
    from common.settings import Settings

    logs = tmp_path_factory.mktemp("readme-logs")
    worker = WorkerProcess(redis_server.url, "smollm2", logs / "worker.log", name="readme",
                           extra_env={"LLMQ_QUEUE": QUEUE}).start(wait_ready=False)
    try:
        worker.wait_ready(timeout_s=300)
        api = ApiServer(Settings.from_env(redis_url=redis_server.url, model="smollm2",
                                          queue=QUEUE)).start()
    except BaseException:
        worker.stop()
        raise
    yield api.url
    api.stop()
    worker.stop()


def run_bash(code: str, url: str, env: dict) -> tuple[str, dict]:
    """Runs a bash block; returns its output and the shell variables it leaves (`ID`)."""
    script = code.replace(README_URL, url) + '\nprintf "\\n__ID=%s\\n" "${ID:-}"\n'
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True,
                          text=True, timeout=TIMEOUT_S, cwd=ROOT, env={**os.environ, **env})
    assert proc.returncode == 0, f"{code}\nexited {proc.returncode}: {proc.stderr}"
    out, _, left = proc.stdout.rpartition("\n__ID=")
    return out, {"ID": left.strip()} if left.strip() else {}


def run_python(before: list[str], code: str, url: str) -> str:
    """Runs a python block in a fresh interpreter after the blocks before it (their output
    discarded): what a reader typing them into one session would see for this one."""
    script = (
        "import contextlib, io\n"
        "ns = {'__name__': '__main__'}\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    for before in %r:\n"
        "        exec(compile(before, 'README.md', 'exec'), ns)\n"
        "exec(compile(%r, 'README.md', 'exec'), ns)\n"
        % ([b.replace(README_URL, url) for b in before], code.replace(README_URL, url)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, f"{code}\nexited {proc.returncode}: {proc.stderr}"
    return proc.stdout


def answer(output: str) -> str:
    """The generated text an example printed: a job's `text`, the `done` event's text of an
    SSE stream, or else what it printed (the OpenAI examples print the content)."""
    done = re.search(r"^event: done\n(?:id: .*\n)?data: (.*)$", output, re.M)
    if done:
        return json.loads(done.group(1))["text"]
    try:
        return json.loads(output)["text"]
    except (ValueError, KeyError, TypeError):
        return output


def test_readme_has_the_examples():
    """The parser finds the blocks (a changed fence would otherwise test nothing)."""
    blocks = readme_blocks()
    assert sum(lang == "bash" for lang, _ in blocks) >= 5
    assert sum(lang == "python" for lang, _ in blocks) >= 2


def test_every_readme_example_prints_an_answer(readme_stack):
    url = readme_stack
    env: dict[str, str] = {}
    python_before: list[str] = []
    ran, skipped, polls = [], [], []
    for lang, code in readme_blocks():
        why = skip_reason(code)
        if why:
            skipped.append((code.splitlines()[0], why))
            continue
        if lang == "bash":
            out, leaves = run_bash(code, url, env)
            env.update(leaves)
        else:
            out = run_python(python_before, code, url)
            python_before.append(code)
        job = _job(out)
        if job is not None and job["status"] in ("queued", "running"):
            # "poll it": what the job shows once the example after it (its stream) has
            # waited for the end is checked below, by the same command.
            polls.append(code.strip().splitlines()[-1])
            continue
        ran.append(code)
        assert answer(out).strip(), f"this README example printed no answer:\n{code}\n{out}"
    assert env.get("ID"), "the jobs example sets $ID for the ones after it"
    for poll in polls:
        out, _ = run_bash(poll, url, env)
        job = _job(out)
        assert job is not None and job["status"] == "succeeded", out
        assert job["text"].strip(), f"this README example's job has no answer:\n{poll}\n{out}"
    assert len(ran) + len(polls) >= 5 and skipped, (ran, skipped)


def _job(output: str) -> dict | None:
    try:
        job = json.loads(output)
    except ValueError:
        return None
    return job if isinstance(job, dict) and job.get("object") == "job" else None
