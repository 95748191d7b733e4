"""Webhook delivery: the Celery task `llmq.webhook` that posts one signed event, with retries
and backoff, and the loop in every worker that queues job events as they become due.

Signatures follow Standard Webhooks (standardwebhooks.com): `webhook-id` (the event's stable
id: a receiver drops repeats by it), `webhook-timestamp` (unix seconds of this attempt) and
`webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">`, keyed with the base64
part of LLMQ_WEBHOOK_SECRET (`whsec_<base64>`) or, with API keys, with the job's owner's own
key derived from it (common/webhook_store.py: owner_key). Every attempt resolves the host
again, checks every address (common/webhook_guard.py) and connects to a checked address: DNS
rebinding after the check at submit reaches nothing private. Redirects are not followed.

Deliveries run on their own queue (Settings.webhook_queue, routed in common/celery_config.py)
and pool, the delivery workers' (scripts/delivery.sh), never on a generation thread. One
receiver holds little of that pool: a connection must open within LLMQ_WEBHOOK_CONNECT_TIMEOUT,
a host and a key have a cap of deliveries in flight, and a host that keeps not answering is
left alone for a while (common/webhook_store.py). A delivery held back by those is queued again
for later without counting as an attempt: the event is still delivered at least once.
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

from common.response_objects import webhook_event
from common.response_store import ResponseStore
from common.store import job_from_record
from common.webhook_guard import Target, WebhookUnresolvable, WebhookURLError, check_url
from common.webhook_store import WEBHOOK_TASK, event_body, event_id, owner_key

from .services import Services, services, start_loop

log = logging.getLogger("llmq.webhooks")

DISPATCH_S = 0.5         # between two looks for due job events
MAX_BACKOFF_S = 3600.0
# A delivery held back by a cap is tried again after DEFER_S, doubling with each time it was
# put off or failed, up to MAX_DEFER_S: thousands of one key's events held back behind one
# receiver cost the delivery pool a few task runs a second, not thousands.
DEFER_S = 2.0
MAX_DEFER_S = 64.0
LEASE_MARGIN_S = 5.0     # a delivery's slots outlast its timeout by this much


class Deferred(Exception):
    """The delivery must wait: its host's breaker is open, or its host or key is at its cap."""

    def __init__(self, reason: str, wait_s: float):
        super().__init__(f"{reason}: wait {wait_s:.1f} s")
        self.wait_s = wait_s


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


def post(target: Target, body: bytes, headers: dict[str, str], timeout_s: float,
         connect_timeout_s: float | None = None) -> int:
    """POSTs to the checked addresses in turn (the first that answers) and returns the status,
    all within timeout_s, each connection opened within connect_timeout_s. A socket timeout
    counts per read, so a receiver that answers a byte at a time would hold a delivery thread
    for ever: past the deadline the socket is shut down under the read. The answer's body is
    never read."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    for addr in target.addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        connect_s = min(left, connect_timeout_s or left)
        if target.scheme == "https":
            conn = urllib3.connection.HTTPSConnection(addr, target.port, timeout=connect_s,
                                                      server_hostname=target.host,
                                                      assert_hostname=target.host)
        else:
            conn = urllib3.connection.HTTPConnection(addr, target.port, timeout=connect_s)
        timer = threading.Timer(left, _abort, args=(conn,))
        timer.daemon = True
        timer.start()
        try:
            conn.connect()   # (and the TLS handshake) within connect_s
            conn.timeout = max(0.001, deadline - time.monotonic())   # each read after it
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


# max_retries=None: the attempts are counted here (LLMQ_WEBHOOK_MAX_ATTEMPTS, in the event's
# record, so a delivery held back is not one); Celery's own default (3) ended every event after
# 4 attempts, in about 8 s. A Redis error (the event or its attempt could not be read or
# written) is retried with backoff too: a task that fails is acknowledged (acks_late acks
# failures), and the event would be lost.
@shared_task(name=WEBHOOK_TASK, bind=True, max_retries=None, autoretry_for=(RedisError,),
             retry_backoff=True, retry_backoff_max=int(MAX_BACKOFF_S), retry_jitter=True)
def deliver(self, event_id_: str) -> dict:
    """One attempt to deliver an event; a failure is retried later (backoff), at most
    LLMQ_WEBHOOK_MAX_ATTEMPTS attempts in all. A delivery its host or key cannot take now is
    queued again for later, not counted as an attempt."""
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
        result, status = attempt(s, store, event_id_, event, self.request.retries)
    except Deferred as exc:
        log.info("webhook delivery held back (%s)", exc, extra={"event_id": event_id_})
        raise self.retry(countdown=exc.wait_s) from None
    except WebhookUnresolvable as exc:
        result, status = str(exc), None
        log.info("webhook host unresolvable: %s (%s)", exc, exc.detail,
                 extra={"event_id": event_id_})
    except WebhookURLError as exc:   # now resolves to a refused address: never sent there
        store.record_attempt(event_id_, f"refused: {exc}", delivered=False, final=True)
        log.warning("webhook refused: %s (%s)", exc, exc.detail, extra={"event_id": event_id_})
        return {**outcome, "outcome": "refused"}
    except RedisError:
        raise   # (autoretry_for: retried with backoff, not an attempt)
    except Exception as exc:   # anything unforeseen is a failed attempt, retried, not a lost event
        log.exception("webhook attempt failed", extra={"event_id": event_id_})
        result, status = f"error: {type(exc).__name__}", None
    delivered = status is not None and 200 <= status < 300
    # The event counts its attempts (not the task's retries): a delivery sent again after its
    # message was lost starts again at retries 0, and must not get a whole new schedule.
    final = int(event.get("attempts") or 0) + 1 >= s.webhook_max_attempts
    attempts = store.record_attempt(event_id_, result, delivered, final=final)
    if delivered:
        return {**outcome, "outcome": "delivered"}
    if attempts >= s.webhook_max_attempts:
        log.error("webhook given up after %d attempts: %s", attempts, result,
                  extra={"event_id": event_id_})
        return {**outcome, "outcome": f"given up: {result}"}
    log.warning("webhook attempt %d failed: %s", attempts, result, extra={"event_id": event_id_})
    raise self.retry(countdown=backoff_s(attempts - 1))


def attempt(s, store, event_id_: str, event: dict[str, str], retries: int = 0
            ) -> tuple[str, int | None]:
    """Posts the event once, within its host's and its key's caps: (what happened, the HTTP
    status or None). Raises Deferred when the caps or the host's breaker hold it back (for
    longer the more `retries` its task has had), and the URL's errors (WebhookURLError) when it
    may not be sent there."""
    target = check_url(event["url"], s.webhook_allowed_hosts)
    owner = event.get("owner", "")
    # (without API keys every event has the one owner "": a cap per key would be the pool's)
    reason, wait_s = store.start_delivery(
        event_id_, target.host, owner, s.webhook_timeout_s + LEASE_MARGIN_S,
        s.webhook_max_per_host, s.webhook_max_per_key if owner else 0, s.webhook_breaker_s)
    if reason != "ok":
        if reason != "breaker":   # (a breaker says when it opens again)
            wait_s = min(MAX_DEFER_S, DEFER_S * 2.0 ** min(retries, 10))
        raise Deferred({"breaker": f"{target.host} not answering",
                        "host": f"{target.host} at its cap",
                        "key": "the key at its cap"}[reason], wait_s * random.uniform(1.0, 1.5))
    status = None
    try:
        timestamp, body = int(time.time()), event["body"].encode()
        status = post(target, body, {
            "Content-Type": "application/json", "User-Agent": "llmq-webhooks",
            "webhook-id": event_id_, "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(owner_key(s.webhook_key(), owner),
                                      event_id_, timestamp, body)},
            s.webhook_timeout_s, s.webhook_connect_timeout_s)
        return f"HTTP {status}", status
    except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
        return f"error: {exc}", None
    except Exception as exc:   # anything unforeseen is a failed attempt, retried, not a lost event
        log.exception("webhook attempt failed", extra={"event_id": event_id_})
        return f"error: {type(exc).__name__}", None
    finally:
        failures = store.end_delivery(event_id_, target.host, owner, status is not None,
                                      s.webhook_breaker_failures, s.webhook_breaker_s)
        if s.webhook_breaker_failures and failures == s.webhook_breaker_failures:
            log.warning("webhook host %s: %d attempts in a row without an answer; left alone "
                        "for %g s", target.host, failures, s.webhook_breaker_s)


def dispatch_job_events(svc: Services) -> None:
    """Queues a delivery for every job event that became due (see common/webhook_store.py).
    A Responses API response's end is told in OpenAI's shape (response.completed, ...: what
    `client.webhooks.unwrap` parses); a job's in llmq's (job.started, job.completed)."""
    for seq_id, event, url in svc.webhooks.due_job_events():
        rec = svc.sequences.get_record(seq_id)
        if rec:
            job = job_from_record(rec)
            if event == "completed" and _is_response(svc, seq_id):
                eid = event_id(seq_id, "response.end")
                _kind, body = webhook_event(job, eid)
            else:
                kind = f"job.{event}"
                eid = event_id(seq_id, kind)
                body = event_body(kind, job, eid)
            svc.webhooks.put_event(eid, url, body, rec.get("owner", ""))
            svc.send_delivery(eid)
        svc.webhooks.job_event_sent(seq_id, event)


def _is_response(svc: Services, seq_id: str) -> bool:
    """Whether the sequence is a Responses API response (it has a request document)."""
    return svc.sequences.beside(ResponseStore, svc.settings.pending_ttl_s).load(seq_id) \
        is not None


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
