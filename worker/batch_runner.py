"""The batch driver: the Celery task `llmq.batch` that runs one batch to its end, and the
supervisor loop in every worker that restarts drivers whose worker died.

A driver holds a lease on its batch (renewed every step) and, step by step: answers the lines
whose sequences ended, submits more lines while fewer than LLMQ_BATCH_MAX_INFLIGHT batch lines
(all batches together; a key's share of them while other keys' batches have lines to send) are
queued or running, at Celery priority LLMQ_BATCH_PRIORITY (below interactive requests), and
ends the batch when every line is answered, when it is cancelled or when its completion window
has passed. A driver holds one of its worker's few driver slots, which keys share
(worker/batch_shares.py): asked to give way, it hands its batch back to be driven later.
Everything it writes is idempotent by line (common/batch_store.py), so a driver killed
anywhere is replaced, after its lease runs out, by one that continues: no line is lost and
none is answered twice.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from celery import shared_task, signals

from common.batch_store import (BATCH_TASK, DISPATCH_GRACE_S, TERMINAL, batch_object,
                                line_request_id, line_seq_id, output_file_id)
from common.llm_engine import Overloaded, TooLarge
from common.openai_responses import ChoiceShaper, response_body
from common.protocol import GENERATE_TASK, INPUT_ERROR_CODES, SamplingParams, SequenceStatus
from common.store import job_from_record
from common.webhook_store import event_body, event_id

from .batch_shares import line_room
from .services import BatchLineSender, Services, services, start_loop

log = logging.getLogger("llmq.batch")

STEP_S = 0.2            # between two looks at the lines in flight
RENEW_S = 0.5           # the lease is renewed at least this often, also inside a long step
SUPERVISE_S = 1.0       # between two looks for batches without a live driver
BUSY_RETRY_S = 2.0      # a batch refused by a busy worker is due again after this


class LeaseLost(Exception):
    """Another driver has the batch now (this one was too slow, or taken for dead)."""


@shared_task(name=BATCH_TASK, bind=True)
def run_batch(self, batch_id: str, token: str) -> dict:
    """Drives one batch until it ends, the worker stops, or another driver takes over."""
    svc = services(self.app)
    slot = svc.driver_slots.acquire(svc.batches.owner(batch_id))
    if slot is None:
        # This worker drives enough batches (of keys holding their share of its slots): this
        # one is due again shortly (here or on another worker) instead of holding a task
        # thread its lines may need.
        svc.batches.renew(batch_id, token, BUSY_RETRY_S)
        return {"batch_id": batch_id, "outcome": "worker busy with other batches; later"}
    try:
        return BatchDriver(svc, batch_id, token, slot.give_way).run()
    finally:
        svc.driver_slots.release(slot)


class BatchDriver:
    """Runs one batch under a lease: submit lines, answer them, end the batch."""

    def __init__(self, svc: Services, batch_id: str, token: str,
                 give_way: threading.Event | None = None):
        self.svc, self.batch_id, self.token = svc, batch_id, token
        # Set when another key's batch needs this driver's slot (worker/batch_shares.py).
        self.give_way = give_way or threading.Event()
        self.batches, self.seqs = svc.batches, svc.sequences
        self.lease_s = svc.settings.worker_stale_s
        # A line still queued this long may have had its message taken by a worker that died
        # before starting it (the broker gives such a message back only after
        # LLMQ_VISIBILITY_TIMEOUT): it is queued once more.
        self.requeue_after_s = max(60.0, 4 * svc.settings.worker_stale_s)
        self.queued_at: dict[int, float] = {}
        self.renewed = 0.0
        self.h: dict[str, str] = {}

    def run(self) -> dict:
        try:
            return self._run()
        except LeaseLost:
            return {"batch_id": self.batch_id, "outcome": "not the batch's driver (any more)"}

    def keep_lease(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.renewed >= RENEW_S:
            if not self.batches.renew(self.batch_id, self.token, self.lease_s):
                raise LeaseLost
            self.renewed = now

    def _run(self) -> dict:
        result = {"batch_id": self.batch_id}
        while not self.svc.stopping.is_set():
            self.keep_lease(force=True)
            self.h = self.batches.record(self.batch_id)
            status = self.h.get("status")
            if status in TERMINAL or not status:
                return {**result, "outcome": status or "gone"}
            if status == "validating":
                if self.batches.live_counts(self.batch_id)[1] >= int(self.h["total"]):
                    # Every line was malformed: nothing can run, the batch fails validation
                    # (as OpenAI's does), with its `errors` and its error file.
                    return {**result, "outcome": self.finalize("failed")}
                self.batches.set_fields(self.batch_id, status="in_progress",
                                        in_progress_at=time.time())
                log.info("batch started", extra={"batch_id": self.batch_id})
                continue
            if status == "in_progress":   # (again, if a driver died before it was sent)
                self.emit("started", self.h)
            self.collect()
            if status == "cancelling":
                return {**result, "outcome": self.end("cancelled", "batch_cancelled")}
            if time.time() > float(self.h["expires_at"]):
                return {**result, "outcome": self.end("expired", "batch_expired")}
            if self.submit_more() and not self.batches.inflight(self.batch_id)[0]:
                return {**result, "outcome": self.finalize("completed")}
            if self.give_way.is_set():
                # Due again shortly, here or elsewhere; its lines in flight go on meanwhile.
                self.batches.renew(self.batch_id, self.token, BUSY_RETRY_S)
                return {**result, "outcome": "handed back (another key's batch needed the slot)"}
            self.svc.stopping.wait(STEP_S)
        self.batches.renew(self.batch_id, self.token, 0)   # hand the batch back at once
        return {**result, "outcome": "handed back (worker stopping)"}

    # --- lines --------------------------------------------------------------------------------
    def collect(self) -> None:
        """Answers every line in flight whose sequence has ended."""
        flying, sent = self.batches.inflight(self.batch_id)
        flying = sorted(flying)
        # (their status: a line is answered from its finished record, which holds the text)
        recs = self.seqs.get_records([line_seq_id(self.batch_id, i) for i in flying], text=False)
        for i, rec in zip(flying, recs):
            if not rec:
                if i in sent:   # its record expired before anyone read it
                    self.answer_error(i, "request_lost", "the request's record expired")
                continue        # not queued yet: submit_more takes it (a driver died there)
            if SequenceStatus(rec["status"]).is_finished:
                self.answer(i, rec)
            elif rec["status"] == SequenceStatus.QUEUED.value and i in sent:
                since = self.queued_at.setdefault(i, float(rec["created_at"]))
                if time.time() - since > self.requeue_after_s:
                    log.warning("batch line queued again", extra={"seq_id": rec["id"]})
                    self.queue_again(rec["id"], rec.get("model"))
                    self.queued_at[i] = time.time()

    def queue_again(self, seq_id: str, model: str | None) -> None:
        """Another message for a queued record, on its model's queue: the first to start it
        runs it; a later one finds it ended (or running elsewhere) and does nothing, or
        restarts it on the worker running it: wasted work, never a second answer."""
        s = self.svc.settings
        BatchLineSender(self.svc.celery).send_task(
            GENERATE_TASK, args=[seq_id], task_id=seq_id,
            queue=(s.resolve_model(model) or s.served_models()[0]).queue,
            priority=s.batch_priority)

    def submit_more(self) -> bool:
        """Queues lines while there is room; True once every line has been queued."""
        total, i = int(self.h["total"]), int(self.h["next_line"])
        room = line_room(self.svc.settings.batch_max_inflight, self.h["owner"],
                         *self.batches.inflight_by_owner())
        submitter = None
        while i < total and room > 0:
            self.keep_lease()
            spec = self.batches.line(self.batch_id, i)
            if spec.get("error"):   # answered with an error line at create
                self.batches.skip_line(self.batch_id, i)
                i += 1
                continue
            seq_id = line_seq_id(self.batch_id, i)
            self.batches.take_line(self.batch_id, i)
            rec = self.seqs.get_record(seq_id, text=False)
            if rec is None:
                submitter = submitter or self.svc.submitter()
                try:
                    submitter.submit([spec["input"]], SamplingParams.from_dict(spec["params"]),
                                     self.h["owner"], self.timeout(spec), self.priority(spec),
                                     seq_ids=[seq_id], model=spec.get("model"))
                except Overloaded:   # the queue is full or the key is over its rate limit
                    self.batches.untake_line(self.batch_id, i)
                    return False
                except TooLarge as exc:   # more than the key's rate limit allows at all
                    self.answer_error(i, "invalid_request", str(exc), spec.get("custom_id"))
                    self.batches.skip_line(self.batch_id, i)
                    i += 1
                    continue
            elif rec["status"] == SequenceStatus.QUEUED.value and i not in self.sent():
                # created by a driver that died before queueing it
                self.queue_again(seq_id, rec.get("model"))
            self.batches.line_sent(self.batch_id, i)
            i += 1
            room -= 1
        return i >= total

    def sent(self) -> set[int]:
        return self.batches.inflight(self.batch_id)[1]

    def timeout(self, spec: dict) -> float:
        """A line ends with the batch's window at the latest."""
        left = max(1.0, float(self.h["expires_at"]) - time.time())
        return min(left, spec["timeout"]) if spec.get("timeout") else left

    def priority(self, spec: dict) -> int:
        return max(spec.get("priority") or 0, self.svc.settings.batch_priority)

    def answer(self, i: int, rec: dict[str, str]) -> None:
        """A finished sequence's output line (or error line), in OpenAI's shape; its tokens
        count in the batch's usage, whatever its end."""
        job = job_from_record(rec)
        used = job["usage"]
        if job["status"] == SequenceStatus.SUCCEEDED.value:
            spec = self.batches.line(self.batch_id, i)
            chat = self.h["endpoint"] == "/v1/chat/completions"
            # with the line's echo and logprobs, as the route answers them
            body = response_body([job], chat, job.get("model") or self.h.get("model") or "",
                                 ChoiceShaper([job], chat, **spec.get("shape", {})))
            self.batches.answer(self.batch_id, i, True,
                                self.line(i, job["id"], 200, body, spec.get("custom_id")), used)
        elif job["status"] == SequenceStatus.FAILED.value:
            failure = job["error"] or {}
            message = failure.get("message") or "generation failed"
            if failure.get("code") in INPUT_ERROR_CODES:   # the worker refused the prompt
                status, error = 400, {"message": message, "type": "invalid_request_error",
                                      "param": None, "code": failure["code"]}
            else:
                status, error = 500, {"message": message, "type": "server_error",
                                      "param": None, "code": None}
            self.batches.answer(self.batch_id, i, False,
                                self.line(i, job["id"], status, {"error": error}), used)
        elif job["finish_reason"] == "timeout":
            self.answer_error(i, "batch_expired", "the batch's completion window ended first",
                              usage=used)
        else:
            self.answer_error(i, "request_cancelled", "the request was cancelled", usage=used)

    def answer_error(self, i: int, code: str, message: str, custom_id: str | None = None,
                     usage: dict | None = None) -> None:
        line = self.line(i, None, None, None, custom_id)
        line["error"] = {"code": code, "message": message}
        self.batches.answer(self.batch_id, i, False, line, usage)

    def line(self, i: int, request_id: str | None, status: int | None, body: Any,
             custom_id: str | None = None) -> dict:
        if custom_id is None:
            custom_id = self.batches.line(self.batch_id, i).get("custom_id")
        response = None if status is None else {"status_code": status,
                                                "request_id": request_id, "body": body}
        return {"id": line_request_id(self.batch_id, i), "custom_id": custom_id,
                "response": response, "error": None}

    # --- the end ------------------------------------------------------------------------------
    def end(self, status: str, code: str) -> str:
        """Cancel or expiry: lines in flight are cancelled and, like those never queued,
        answered with an error line; what finished stays in the output."""
        message = {"batch_cancelled": "the batch was cancelled",
                   "batch_expired": "the batch's completion window ended first"}[code]
        flying, _sent = self.batches.inflight(self.batch_id)
        for i in sorted(flying):
            self.seqs.request_cancel(line_seq_id(self.batch_id, i))
            self.answer_error(i, code, message)
        start = int(self.h["next_line"])
        for offset, spec in enumerate(self.batches.lines_from(self.batch_id, start)):
            self.keep_lease()
            if not spec.get("error"):
                self.answer_error(start + offset, code, message, spec["custom_id"])
        return self.finalize(status)

    def finalize(self, status: str) -> str:
        """Writes the output and error files (ids derived from the batch: a second run after a
        crash rewrites the same files), announces the end, then closes the batch."""
        if status == "completed":
            self.batches.set_fields(self.batch_id, status="finalizing", finalizing_at=time.time())
        owner, files = self.h["owner"], {}
        for kind, name in (("out", "output"), ("err", "error")):
            lines = self.batches.answered(self.batch_id, kind)
            if lines:
                fid = output_file_id(self.batch_id, name)
                self.svc.files.put(owner, "batch_output", f"{self.batch_id}_{name}.jsonl",
                                   "\n".join(lines) + "\n", file_id=fid)
                files[f"{name}_file_id"] = fid
        n_out, n_err = self.batches.live_counts(self.batch_id)
        final = {"status": status, f"{status}_at": time.time(), "completed_count": n_out,
                 "failed_count": n_err, "output_file_id": files.get("output_file_id", ""),
                 "error_file_id": files.get("error_file_id", "")}
        self.emit("completed", {**self.h, **{k: str(v) for k, v in final.items()}})
        self.batches.finish(self.batch_id, final)
        log.info("batch ended", extra={"batch_id": self.batch_id, "status": status,
                                       "completed": n_out, "failed": n_err})
        return status

    def emit(self, event: str, h: dict[str, str]) -> None:
        """Queues the batch's webhook event once it is wanted and not queued yet (a driver that
        dies in between queues it again, under the same event id)."""
        url = self.h.get("webhook")
        if not url or event not in self.h.get("webhook_events", "").split(","):
            return
        if self.h.get(f"webhook_{event}") == "sent":
            return
        obj = batch_object(h, None if event == "completed" else
                           self.batches.live_counts(self.batch_id))
        kind = f"batch.{obj['status']}" if event == "completed" else f"batch.{event}"
        eid = event_id(self.batch_id, event)
        self.svc.webhooks.put_event(eid, url, event_body(kind, obj, eid), self.h["owner"])
        self.svc.send_delivery(eid)
        self.batches.set_fields(self.batch_id, **{f"webhook_{event}": "sent"})
        self.h[f"webhook_{event}"] = "sent"


# --- supervisor -------------------------------------------------------------------------------
def dispatch_due(svc: Services) -> None:
    """Sends a driver for every batch without a live one (new, or its worker died)."""
    for batch_id in svc.batches.due():
        token = uuid.uuid4().hex
        if svc.batches.claim(batch_id, token, DISPATCH_GRACE_S):
            log.info("dispatching a batch driver", extra={"batch_id": batch_id})
            svc.celery.send_task(BATCH_TASK, args=[batch_id, token], task_id=token,
                                 queue=svc.settings.queue, priority=0)


@signals.worker_ready.connect
def _start_supervisor(sender=None, **_kw):
    svc = services(sender.app)
    start_loop(svc, "llmq-batch-supervisor", SUPERVISE_S, lambda: dispatch_due(svc))


@signals.worker_shutting_down.connect
def _stop_drivers(**_kw):
    # Drivers hand their batches back at once rather than hold the warm shutdown: another
    # worker's supervisor restarts them.
    from .celery_app import celery

    services(celery).stopping.set()

