"""llmq's own job routes: queue (/v1/jobs), wait (/v1/generate), read, cancel and follow a
job's tokens (SSE), and the key's webhook secret."""
from __future__ import annotations

from flask import Blueprint, Response, g, jsonify, request

from common.store import is_seq_id, valid_stream_id
from common.webhook_store import owner_key, secret_of

from . import queue_info
from .context import engine, settings
from .errors import APIError, error_response, failure_of
from .request_body import parse_job_request
from .schemas import JobRequest
from .streaming import sse_response, take_stream_slot
from .submit import inputs_of, submit
from .waiting import WaitTimedOut, wait_or_cancel

bp = Blueprint("jobs", __name__)


def find_job(seq_id: str) -> dict:
    # Checked by shape before it becomes part of a Redis key name ("<id>:events" names a
    # stream): a malformed id is unknown like any other.
    job = engine().get(seq_id, g.owner) if is_seq_id(seq_id) else None
    if job is None:
        raise APIError(404, f"no job with id {seq_id!r}", "not_found_error")
    return job


@bp.post("/v1/jobs")
def create_jobs():
    req = parse_job_request()
    if req.stream:   # (it answers at once: a stream slot taken here would be held for nothing)
        raise APIError(400, "/v1/jobs answers at once and does not stream: use /v1/generate "
                            "with 'stream', or follow a job at /v1/jobs/<id>/stream",
                       param="stream")
    return accepted(req, submit(inputs_of(req), req))


def accepted(req: JobRequest, jobs: list[dict]):
    """202 with the jobs as they stand: a list for `prompts`, else the one job and its URL."""
    if req.prompts is not None:
        return jsonify({"object": "list", "jobs": jobs}), 202
    return jsonify(jobs[0]), 202, {"Location": f"/v1/jobs/{jobs[0]['id']}"}


@bp.get("/v1/jobs/<seq_id>")
def get_job(seq_id: str):
    job = find_job(seq_id)
    return jsonify(queue_info.annotate(job, job))


@bp.delete("/v1/jobs/<seq_id>")
def cancel_job(seq_id: str):
    find_job(seq_id)
    return jsonify(engine().cancel(seq_id, g.owner))


@bp.get("/v1/jobs/<seq_id>/stream")
def stream_job(seq_id: str):
    find_job(seq_id)
    last = request.headers.get("Last-Event-ID") or request.args.get("last_event_id") or "0-0"
    if not valid_stream_id(last):
        raise APIError(400, "Last-Event-ID must be a stream id like 1700000000000-0",
                       param="last_event_id")
    if engine().is_over(seq_id, last):
        # Resumed at (or past) the done event, as EventSource does after the server closed:
        # nothing will follow, and 204 is what tells EventSource to stop reconnecting.
        return Response(status=204, headers={"X-Request-Id": seq_id})
    take_stream_slot()
    return sse_response(seq_id, last)


@bp.post("/v1/generate")
def generate():
    req = parse_job_request()
    if req.stream and req.prompts is not None:
        raise APIError(400, "'stream' works with one prompt; use /v1/jobs for a batch")
    jobs = submit(inputs_of(req), req, waits=True)
    if req.stream:
        # The stream holds the id and can be resumed (/v1/jobs/<id>/stream, Last-Event-ID):
        # a client that hangs up does not cancel it; it runs to its end like any job.
        return sse_response(jobs[0]["id"], "0-0")
    try:
        results = wait_or_cancel([j["id"] for j in jobs], cancel_on_timeout=False)
    except WaitTimedOut:
        # Still running after LLMQ_WAIT_TIMEOUT: their ids let the caller follow them; they
        # run on.
        return accepted(req, [find_job(j["id"]) for j in jobs])
    failures = [failure_of(r) for r in results]
    if all(failures):
        # Nothing came of the request: the first failure's status and error, with the records
        err = failures[0]
        extra = {"results": results} if req.prompts is not None else {"job": results[0]}
        return error_response(err.status, err.message, err.type, param=err.param,
                              code=err.code, **extra)
    if req.prompts is not None:
        return jsonify({"object": "list", "results": results})
    return jsonify(results[0])


@bp.get("/v1/webhooks/secret")
def webhook_secret():
    """The key that signs this API key's webhook events (its own: no other key's events verify
    with it), written as Standard Webhooks' libraries take it."""
    s = settings()
    if not s.webhook_secret:
        raise APIError(404, "webhooks are not enabled on this server (LLMQ_WEBHOOK_SECRET)",
                       "not_found_error", code="webhooks_disabled")
    return jsonify({"object": "webhook_secret",
                    "secret": secret_of(owner_key(s.webhook_key(), g.owner))})
