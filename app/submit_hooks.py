"""What a submission does besides queueing its sequences: checks and registers its webhook, and
indexes its jobs under their owner for GET /v1/jobs.

A webhook URL the SSRF guard refuses (common/webhook_guard.py) is refused before anything is
queued; delivery (worker/webhooks.py) checks it again.
"""
from __future__ import annotations

from common.webhook_guard import WebhookURLError, check_url


def checked_webhook(req, settings) -> tuple[str, list[str]] | None:
    """(url, events) of a request that asks for a webhook, or None. Raises WebhookURLError
    when webhooks are off or the URL is not allowed."""
    url = getattr(req, "webhook", None)
    if url is None:
        return None
    if not settings.webhook_secret:
        raise WebhookURLError("webhooks are not enabled on this server (LLMQ_WEBHOOK_SECRET)")
    check_url(url, settings.webhook_allowed_hosts)
    return url, list(req.webhook_events)


def index_and_hook(extensions: dict, owner: str, jobs: list[dict],
                 hook: tuple[str, list[str]] | None) -> None:
    """Runs once the records exist and before their messages are sent (LLMEngine.submit's
    before_queue), so a job is never queued unlisted or without its webhook."""
    extensions["jobs_index"].add(owner, {j["id"]: j["created_at"] for j in jobs})
    if hook is not None:
        extensions["webhooks"].register_jobs([j["id"] for j in jobs], *hook)


def unindex_and_unhook(extensions: dict, owner: str, seq_ids: list[str],
                       hook: tuple[str, list[str]] | None) -> None:
    """Takes index_and_hook back for a submission refused after it ran (LLMEngine.submit's
    unqueue): a job the client was told was not accepted is neither listed nor reported."""
    if hook is not None:
        extensions["webhooks"].unregister_jobs(seq_ids)
    extensions["jobs_index"].remove(owner, *seq_ids)
