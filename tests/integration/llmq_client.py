"""Small HTTP helpers for the integration tests: submit, read and wait for jobs."""
from __future__ import annotations

import requests

from support import wait_until

FINISHED = ("succeeded", "failed", "cancelled")
TIMEOUT = 60


def submit(url: str, **body) -> dict:
    """POST /v1/jobs; asserts 202 and returns the job (or the {"jobs": [...]} list object)."""
    r = requests.post(url + "/v1/jobs", json=body, timeout=TIMEOUT)
    assert r.status_code == 202, r.text
    return r.json()


def get_job(url: str, seq_id: str) -> dict:
    """The job as GET answers it, less the `metrics` GET adds to a finished one, so that it
    compares equal to the job a done event or a waiting route carries (test_responses_api.py
    checks the metrics)."""
    r = requests.get(f"{url}/v1/jobs/{seq_id}", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    job = r.json()
    job.pop("metrics", None)
    return job


def cancel(url: str, seq_id: str) -> dict:
    r = requests.delete(f"{url}/v1/jobs/{seq_id}", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def wait_job(url: str, seq_id: str, timeout_s: float = 90.0, seen: list | None = None) -> dict:
    """Polls GET /v1/jobs/<id> until the job has finished; `seen` collects the statuses."""
    def finished():
        job = get_job(url, seq_id)
        if seen is not None and (not seen or seen[-1] != job["status"]):
            seen.append(job["status"])
        return job if job["status"] in FINISHED else None

    return wait_until(finished, timeout_s, f"job {seq_id} to finish", interval=0.1)


def generate(url: str, **body) -> dict:
    """POST /v1/generate; asserts 200 and returns the body."""
    r = requests.post(url + "/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def assert_error(r: requests.Response, status: int | None = None) -> dict:
    """A client error: 4xx with {"error": {"message": str, "type": str}} as JSON."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    if status is not None:
        assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["Content-Type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    return err
