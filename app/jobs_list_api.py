"""GET /v1/jobs: the caller's jobs, newest first, with cursor pagination and a status filter.

Submissions index each job under its owner (app/submit_hooks.py), so a list reads only the caller's
own index: another key's jobs are never read, let alone shown.
"""
from __future__ import annotations

from flask import Blueprint, Flask, current_app, g, request

from common.owner_index import PAGE_SCAN, OwnerIndex
from common.protocol import SequenceStatus
from common.store import job_from_record, record_key
from common.webhook_store import WebhookStore

from .errors import APIError
from .listing import list_params, page_json

bp = Blueprint("jobs_list", __name__)

UNFINISHED_JOB_BYTES = 4096   # what job_size counts for a job that has not ended


def jobs_index() -> OwnerIndex:
    return current_app.extensions["llmq"]["jobs_index"]


@bp.get("/v1/jobs")
def list_jobs():
    after, limit = list_params(20, 100)
    status = request.args.get("status")
    if status is not None and status not in {s.value for s in SequenceStatus}:
        raise APIError(400, "'status' must be one of "
                       + ", ".join(s.value for s in SequenceStatus), param="status")
    index, owner = jobs_index(), g.owner

    def mine(rec):
        return bool(rec) and (rec.get("owner") or "") == owner

    def load(ids):
        return [job_from_record(rec) if mine(rec) else None
                for rec in current_app.extensions["llmq"]["store"].get_records(ids)]

    def peek(ids):
        # Each record's owner, status and size first, and whole records (the text of every
        # job passed over, logprobs gathered from events) only for the jobs the page keeps.
        return [h if mine(h) else None
                for h in index.fields(record_key, ids, "owner", "status", "stored_bytes")]

    return page_json(index.page, owner, load, after, limit,
                     keep=lambda job: status is None or job["status"] == status,
                     peek=peek, scan=PAGE_SCAN,
                     max_bytes=current_app.extensions["llmq"]["settings"].list_page_bytes,
                     size=job_size)


def job_size(rec: dict) -> int:
    """About a job's bytes in a list: an ended one's as its end counted it (what it keeps in
    Redis, a bound on its JSON); an unfinished one has no logprobs yet and at most a body's
    prompt, counted as a small one."""
    return int(rec.get("stored_bytes") or UNFINISHED_JOB_BYTES)


def init_app(app: Flask) -> None:
    ext = app.extensions["llmq"]
    ext["jobs_index"] = ext["store"].beside(OwnerIndex, "jobs", ext["settings"].pending_ttl_s)
    ext["webhooks"] = ext["store"].beside(WebhookStore, ext["settings"].pending_ttl_s)
    app.register_blueprint(bp)
