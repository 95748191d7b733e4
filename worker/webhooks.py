"""Webhook delivery: the Celery task `llmq.webhook` that posts one signed event, with retries
and backoff, and the loop in every worker that queues job events as they become due.

Signatures follow Standard Webhooks (standardwebhooks.com): `webhook-id` (the event's stable
id: a receiver drops repeats by it), `webhook-timestamp` (unix seconds of this attempt) and
`webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">`, keyed with the base64
part of LLMQ_WEBHOOK_SECRET (`whsec_<base64>`) or, with API keys, with the job's owner's own
key derived from it (common/webhook_store.py: owner_key). Every attempt resolves the host
again, checks every address (common/webhook_guard.py) and connects to a checked address: DNS
rebinding after the check at submit reaches nothing private. Redirects are not followed.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import logging
import random
import socket
import threading
import time

import urllib3
import urllib3.connection
from celery import shared_task, signals
from redis.exceptions import RedisError

from common.store import job_from_record
from common.webhook_guard import Target, WebhookUnresolvable, WebhookURLError, check_url
from common.webhook_store import WEBHOOK_TASK, event_body, event_id, owner_key

from .services import Services, services, start_loop

log = logging.getLogger("llmq.webhooks")

DISPATCH_S = 0.5         # between two looks for due job events
MAX_BACKOFF_S = 3600.0


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def backoff_s(retries: int) -> float:
    """1, 2, 4, ... seconds up to an hour, with jitter so retries do not arrive together: the
    default 20 attempts span about 8 hours (OpenAI retries for up to 3 days, Standard Webhooks'
    schedule about a day), so a receiver down for an afternoon loses nothing."""
    return min(MAX_BACKOFF_S, 2.0 ** retries) * random.uniform(1.0, 1.25)


def _abort(conn) -> None:
    """Shuts the connection's socket down under a blocked read (from the deadline's timer)."""
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def post(target: Target, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
    """POSTs to the checked addresses in turn (the first that answers) and returns the status,
    all within timeout_s. A socket timeout counts per read, so a receiver that answers a byte
    at a time would hold a task thread (shared with generation) for ever: past the deadline the
    socket is shut down under the read. The answer's body is never read."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    for addr in target.addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if target.scheme == "https":
            conn = urllib3.connection.HTTPSConnection(addr, target.port, timeout=left,
                                                      server_hostname=target.host,
                                                      assert_hostname=target.host)
        else:
            conn = urllib3.connection.HTTPConnection(addr, target.port, timeout=left)
        timer = threading.Timer(left, _abort, args=(conn,))
        timer.daemon = True
        timer.start()
        try:
            conn.request("POST", target.path, body=body, preload_content=False,
                         headers={**headers, "Host": target.host_header})
            return conn.getresponse().status
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
            last = exc if time.monotonic() < deadline else TimeoutError(
                f"no answer from {target.host_header} within {timeout_s:g} s")
        finally:
            timer.cancel()
            conn.close()
    raise last or TimeoutError(f"no answer from {target.host_header} within {timeout_s:g} s")


# max_retries=None: the attempts are counted here (LLMQ_WEBHOOK_MAX_ATTEMPTS); Celery's own
# default (3) ended every event after 4 attempts, in about 8 s. A Redis error (the event or its
# attempt could not be read or written) is retried with backoff too: a task that fails is
# acknowledged (acks_late acks failures), and the event would be lost.
@shared_task(name=WEBHOOK_TASK, bind=True, max_retries=None, autoretry_for=(RedisError,),
             retry_backoff=True, retry_backoff_max=int(MAX_BACKOFF_S), retry_jitter=True)
def deliver(self, event_id_: str) -> dict:
    """One attempt to deliver an event; a failure is retried later (backoff), at most
    LLMQ_WEBHOOK_MAX_ATTEMPTS attempts in all."""
    svc = services(self.app)
    s, store = svc.settings, svc.webhooks
    event = store.get_event(event_id_)
    outcome = {"event_id": event_id_}
    if event is None or event.get("delivered_at") or event.get("settled"):
        store.settled(event_id_)   # (a second message: a redispatch, or the reconciler's)
        return {**outcome, "outcome": "expired" if event is None else
                "delivered before" if event.get("delivered_at") else "settled before"}
    if not s.webhook_secret:   # set on the API but not on this worker: nothing to sign with
        store.record_attempt(event_id_, "refused: LLMQ_WEBHOOK_SECRET is not set", False,
                             final=True)
        log.error("webhook not sent: LLMQ_WEBHOOK_SECRET is not set on this worker")
        return {**outcome, "outcome": "refused"}
    try:
        target = check_url(event["url"], s.webhook_allowed_hosts)
        timestamp, body = int(time.time()), event["body"].encode()
        status = post(target, body, {
            "Content-Type": "application/json", "User-Agent": "llmq-webhooks",
            "webhook-id": event_id_, "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(owner_key(s.webhook_key(), event.get("owner", "")),
                                      event_id_, timestamp, body)},
            s.webhook_timeout_s)
        result = f"HTTP {status}"
    except WebhookUnresolvable as exc:
        result, status = str(exc), None
        log.info("webhook host unresolvable: %s (%s)", exc, exc.detail,
                 extra={"event_id": event_id_})
    except WebhookURLError as exc:   # now resolves to a refused address: never sent there
        store.record_attempt(event_id_, f"refused: {exc}", delivered=False, final=True)
        log.warning("webhook refused: %s (%s)", exc, exc.detail, extra={"event_id": event_id_})
        return {**outcome, "outcome": "refused"}
    except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
        result, status = f"error: {exc}", None
    except Exception as exc:   # anything unforeseen is a failed attempt, retried, not a lost event
        log.exception("webhook attempt failed", extra={"event_id": event_id_})
        result, status = f"error: {type(exc).__name__}", None
    delivered = status is not None and 200 <= status < 300
    # The event counts its attempts: a delivery sent again after its message was lost starts
    # again at retries 0, and must not get a whole new schedule.
    attempt = max(self.request.retries, int(event.get("attempts") or 0)) + 1
    store.record_attempt(event_id_, result, delivered,
                         final=attempt >= s.webhook_max_attempts)
    if delivered:
        return {**outcome, "outcome": "delivered"}
    if attempt >= s.webhook_max_attempts:
        log.error("webhook given up after %d attempts: %s", attempt, result,
                  extra={"event_id": event_id_})
        return {**outcome, "outcome": f"given up: {result}"}
    log.warning("webhook attempt %d failed: %s", attempt, result, extra={"event_id": event_id_})
    raise self.retry(countdown=backoff_s(self.request.retries))


def dispatch_job_events(svc: Services) -> None:
    """Queues a delivery for every job event that became due (see common/webhook_store.py)."""
    for seq_id, event, url in svc.webhooks.due_job_events():
        rec = svc.sequences.get_record(seq_id)
        if rec:
            kind = f"job.{event}"
            eid = event_id(seq_id, kind)
            svc.webhooks.put_event(eid, url, event_body(kind, job_from_record(rec)),
                                   rec.get("owner", ""))
            svc.send_delivery(eid)
        svc.webhooks.job_event_sent(seq_id, event)


def redeliver_lost(svc: Services) -> None:
    """Queues again the deliveries whose message the broker lost (kombu's fetch is two round
    trips: a consumer killed between them loses the message, and the event, marked sent, would
    never be delivered); see common/reconcile_store.py."""
    for eid in svc.reconcile.claim_lost_events(svc.settings.worker_stale_s):
        log.warning("webhook delivery queued again: its message was lost",
                    extra={"event_id": eid})
        svc.send_delivery(eid)


@signals.worker_ready.connect
def _start_dispatcher(sender=None, **_kw):
    svc = services(sender.app)
    start_loop(svc, "llmq-webhooks", DISPATCH_S, lambda: dispatch_job_events(svc))
    start_loop(svc, "llmq-webhooks-reconciler", svc.settings.worker_stale_s / 2,
               lambda: redeliver_lost(svc))
