"""Batches (OpenAI's /v1/batches) in Redis: the batch, its parsed lines, their answers, and the
lease that lets exactly one driver run a batch at a time.

Every write a driver makes is idempotent by line: a line's sequence id is derived from the
batch id and the line's index, a line is answered once (the first answer wins), and the output
files get ids derived from the batch id. So a driver that dies anywhere is replaced by another
that picks up where the record says, and nothing is lost or written twice.

Keys:
  llmq:batch:<id>             hash  the batch (status, times, counts, endpoint, driver lease token)
  llmq:batch:<id>:lines       list  one parsed request per input line (JSON), or {"error": ...}
  llmq:batch:<id>:inflight    set   line indexes submitted and not yet answered
  llmq:batch:<id>:sent        set   line indexes whose sequence was queued
  llmq:batch:<id>:out         hash  line index -> output line (JSON)
  llmq:batch:<id>:err         hash  line index -> error line (JSON)
  llmq:batches:active         zset  batch id -> lease expiry (unix s): batches a driver must run
  llmq:owner:<owner>:batches  zset  see owner_index
"""
from __future__ import annotations

import json
import re
import secrets
import time
import uuid
from typing import Any

import redis

from .keys import Keys
from .owner_index import OwnerIndex
from .store.lua_scripts import register
from .store.records import REDIS_OVERHEAD

ACTIVE_KEY = Keys.batches_active
BATCH_TASK = "llmq.batch"   # the Celery task that drives one batch (sent by name)
DISPATCH_GRACE_S = 60.0     # a dispatched driver has this long to start before another is sent
TERMINAL = ("completed", "failed", "expired", "cancelled")
_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
          "failed_at", "expired_at", "cancelling_at", "cancelled_at")


batch_key = Keys.batch


# A batch id's shape; anything else names no batch and must not reach Redis ("<id>:lines" is
# the batch's list of lines, another type).
_BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def line_seq_id(batch_id: str, index: int) -> str:
    """The sequence id of a line: the same on every try, so a line is never queued twice."""
    return f"seq-{uuid.uuid5(uuid.NAMESPACE_URL, f'{batch_id}/{index}').hex}"


def line_request_id(batch_id: str, index: int) -> str:
    return f"batch_req_{uuid.uuid5(uuid.NAMESPACE_URL, f'{batch_id}#{index}').hex}"


def output_file_id(batch_id: str, kind: str) -> str:
    return f"file-{uuid.uuid5(uuid.NAMESPACE_URL, f'{batch_id}.{kind}').hex}"


# The batch's usage, summed over its answered lines: (batch field, the job's usage key).
USAGE_FIELDS = (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens"),
                ("cached_tokens", "cached_tokens"))
MAX_ERRORS = 100   # validation errors listed in the batch's `errors` (the error file has all)


def batch_object(h: dict[str, str], counts: tuple[int, int] | None = None) -> dict[str, Any]:
    """OpenAI's batch object; counts (completed, failed) are live until the batch has ended."""
    completed, failed = counts if counts else (int(h.get("completed_count") or 0),
                                               int(h.get("failed_count") or 0))
    obj: dict[str, Any] = {"id": h["id"], "object": "batch", "endpoint": h["endpoint"],
                           "model": h.get("model") or None,
                           "errors": json.loads(h["errors"]) if h.get("errors") else None,
                           "input_file_id": h["input_file_id"],
                           "completion_window": h["completion_window"], "status": h["status"],
                           "output_file_id": h.get("output_file_id") or None,
                           "error_file_id": h.get("error_file_id") or None}
    for name in _TIMES:
        obj[name] = int(float(h[name])) if h.get(name) else None
    obj["request_counts"] = {"total": int(h.get("total") or 0), "completed": completed,
                             "failed": failed}
    obj["metadata"] = json.loads(h["metadata"]) if h.get("metadata") else None
    used = {name: int(h.get(f"usage_{name}") or 0) for name, _ in USAGE_FIELDS}
    obj["usage"] = {"input_tokens": used["input_tokens"],
                    "input_tokens_details": {"cached_tokens": used["cached_tokens"]},
                    "output_tokens": used["output_tokens"],
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": used["input_tokens"] + used["output_tokens"]}
    return obj


def validation_errors(errors: list[dict[str, Any]]) -> str:
    """The batch's `errors` in OpenAI's shape ({"object": "list", "data": [{"code", "message",
    "param", "line"}]}), the first MAX_ERRORS of them, as stored; "" for none."""
    if not errors:
        return ""
    return json.dumps({"object": "list", "data": errors[:MAX_ERRORS]}, ensure_ascii=False)


class BatchStore:
    """Reads and writes batches; the API creates and cancels them, a driver runs them."""

    def __init__(self, client: redis.Redis, ttl_s: int):
        self.r, self.ttl_s = client, ttl_s
        self.index = OwnerIndex(client, "batches", ttl_s)
        self._claim = register(client, "batch_claim")
        self._renew = register(client, "batch_renew")
        self._answer = register(client, "batch_answer")
        self._cancel = register(client, "batch_cancel")

    # --- API side ----------------------------------------------------------------------------
    def create(self, fields: dict[str, Any], lines: list[str], errors: dict[int, str],
               stored_bytes: int = 0) -> dict:
        """Stores a new batch with its parsed lines and the error lines of malformed ones, and
        marks it due for a driver. `stored_bytes` (batch_stored_size) is charged to its
        owner's storage quota until the batch expires, in the same transaction."""
        batch_id = fields["id"]
        ttl = int(float(fields["expires_at"]) - time.time()) + self.ttl_s
        pipe = self.r.pipeline(transaction=True)
        if stored_bytes:
            owner = fields["owner"]
            pipe.zadd(Keys.owner_stored(owner), {f"{batch_id} {stored_bytes}": time.time() + ttl})
            pipe.incrby(Keys.owner_stored_bytes(owner), stored_bytes)
        pipe.hset(batch_key(batch_id), mapping={**fields, "total": len(lines), "next_line": 0})
        for start in range(0, len(lines), 1000):
            pipe.rpush(batch_key(batch_id, "lines"), *lines[start:start + 1000])
        if errors:
            pipe.hset(batch_key(batch_id, "err"), mapping={str(i): e for i, e in errors.items()})
        for part in ("", "lines", "err"):
            pipe.expire(batch_key(batch_id, part), ttl)
        pipe.zadd(ACTIVE_KEY, {batch_id: 0})
        self.index.add(fields["owner"], {batch_id: float(fields["created_at"])}, pipe)
        pipe.execute()
        return self.get(batch_id, fields["owner"])

    @staticmethod
    def stored_size(fields: dict[str, Any], lines: list[str], errors: dict[int, str]) -> int:
        """About the bytes a new batch keeps in Redis (its owner's storage quota counts them):
        its parsed lines, error lines and record, with Redis's overhead (records.py's)."""
        raw = (sum(map(len, lines)) + sum(map(len, errors.values()))
               + sum(len(k) + len(str(v)) for k, v in fields.items()))
        return int(REDIS_OVERHEAD * raw)

    def get(self, batch_id: str, owner: str) -> dict | None:
        if not _BATCH_ID.fullmatch(batch_id):
            return None
        h = self.record(batch_id)
        if not h or not secrets.compare_digest(h.get("owner", ""), owner):
            return None   # another key's batch does not exist for this caller
        return batch_object(h, None if h["status"] in TERMINAL else self.live_counts(batch_id))

    def list(self, owner: str, after: str | None, limit: int):
        def load(ids):
            pipe = self.r.pipeline(transaction=False)
            for i in ids:
                pipe.hgetall(batch_key(i))
                pipe.hlen(batch_key(i, "out"))
                pipe.hlen(batch_key(i, "err"))
            res = pipe.execute()
            return [batch_object(h, None if h["status"] in TERMINAL else (n_out, n_err))
                    if h else None for h, n_out, n_err in zip(res[::3], res[1::3], res[2::3])]

        return self.index.page(owner, load, after, limit)

    def request_cancel(self, batch_id: str) -> None:
        self._cancel(keys=[batch_key(batch_id)], args=[time.time()])

    # --- driver side -------------------------------------------------------------------------
    def record(self, batch_id: str) -> dict[str, str]:
        return self.r.hgetall(batch_key(batch_id))

    def live_counts(self, batch_id: str) -> tuple[int, int]:
        pipe = self.r.pipeline(transaction=False)
        pipe.hlen(batch_key(batch_id, "out"))
        pipe.hlen(batch_key(batch_id, "err"))
        n_out, n_err = pipe.execute()
        return n_out, n_err

    def due(self, limit: int = 16) -> list[str]:
        """Batches whose lease ran out (their driver died) or that no driver took yet."""
        return self.r.zrangebyscore(ACTIVE_KEY, "-inf", time.time(), start=0, num=limit)

    def claim(self, batch_id: str, token: str, grace_s: float) -> bool:
        now = time.time()
        return bool(self._claim(keys=[ACTIVE_KEY, batch_key(batch_id)],
                                args=[batch_id, now, now + grace_s, token]))

    def renew(self, batch_id: str, token: str, lease_s: float) -> bool:
        """Keeps the lease (False: another driver has it, stop); lease_s 0 hands it back."""
        expiry = time.time() + lease_s if lease_s else 0
        return bool(self._renew(keys=[ACTIVE_KEY, batch_key(batch_id)],
                                args=[batch_id, token, expiry]))

    def owner(self, batch_id: str) -> str:
        return self.r.hget(batch_key(batch_id), "owner") or ""

    def inflight_by_owner(self) -> tuple[dict[str, int], set[str]]:
        """Lines of every running batch that are queued or running now, summed by key, and the
        keys with a running batch that has lines left to send."""
        ids = self.r.zrange(ACTIVE_KEY, 0, -1)
        if not ids:
            return {}, set()
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.scard(batch_key(i, "inflight"))
            pipe.hmget(batch_key(i), "owner", "status", "next_line", "total")
        res = pipe.execute()
        inflight: dict[str, int] = {}
        wanting: set[str] = set()
        for n, (owner, status, next_line, total) in zip(res[::2], res[1::2]):
            if owner is None:   # (ended and gone between the two reads)
                continue
            inflight[owner] = inflight.get(owner, 0) + n
            if status in ("validating", "in_progress") and int(next_line or 0) < int(total or 0):
                wanting.add(owner)
        return inflight, wanting

    def line(self, batch_id: str, index: int) -> dict[str, Any]:
        return json.loads(self.r.lindex(batch_key(batch_id, "lines"), index))

    def lines_from(self, batch_id: str, start: int) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.r.lrange(batch_key(batch_id, "lines"), start, -1)]

    def inflight(self, batch_id: str) -> tuple[set[int], set[int]]:
        """(lines in flight, of all lines those whose sequence was queued)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.smembers(batch_key(batch_id, "inflight"))
        pipe.smembers(batch_key(batch_id, "sent"))
        flying, sent = pipe.execute()
        return {int(i) for i in flying}, {int(i) for i in sent}

    def take_line(self, batch_id: str, index: int) -> None:
        """Marks a line in flight before its sequence exists (a driver that dies next finds it)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.sadd(batch_key(batch_id, "inflight"), index)
        pipe.expire(batch_key(batch_id, "inflight"), self.ttl_s)
        pipe.execute()

    def untake_line(self, batch_id: str, index: int) -> None:
        self.r.srem(batch_key(batch_id, "inflight"), index)

    def line_sent(self, batch_id: str, index: int) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.sadd(batch_key(batch_id, "sent"), index)
        pipe.expire(batch_key(batch_id, "sent"), self.ttl_s)
        pipe.hset(batch_key(batch_id), "next_line", index + 1)
        pipe.execute()

    def skip_line(self, batch_id: str, index: int) -> None:
        self.r.hset(batch_key(batch_id), "next_line", index + 1)

    def answer(self, batch_id: str, index: int, ok: bool, line: dict[str, Any],
               usage: dict[str, Any] | None = None) -> bool:
        """Records a line's output (ok) or error line, unless it has one already; the first
        answer adds its sequence's usage (a job's usage object) to the batch's."""
        target = batch_key(batch_id, "out" if ok else "err")
        usage = usage or {}
        tokens = {**usage, "cached_tokens": (usage.get("prompt_tokens_details") or {})
                  .get("cached_tokens", 0)}
        written = self._answer(
            keys=[batch_key(batch_id, "out"), batch_key(batch_id, "err"),
                  batch_key(batch_id, "inflight"), target, batch_key(batch_id)],
            args=[index, json.dumps(line, ensure_ascii=False),
                  *(x for name, key in USAGE_FIELDS for x in (f"usage_{name}",
                                                              int(tokens.get(key) or 0)))])
        if written:
            self.r.expire(target, self.ttl_s)
        return bool(written)

    def answered(self, batch_id: str, kind: str) -> list[str]:
        """The output ("out") or error ("err") lines, in input order."""
        lines = self.r.hgetall(batch_key(batch_id, kind))
        return [lines[k] for k in sorted(lines, key=int)]

    def set_fields(self, batch_id: str, **fields: Any) -> None:
        self.r.hset(batch_key(batch_id), mapping={k: "" if v is None else v
                                                  for k, v in fields.items()})

    def finish(self, batch_id: str, final: dict[str, Any]) -> None:
        """The batch's end: final status, times and counts; out of the active set; its work
        keys gone (the output files hold the answers now)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(batch_key(batch_id), mapping={**final, "driver": ""})
        pipe.zrem(ACTIVE_KEY, batch_id)
        pipe.delete(*(batch_key(batch_id, p) for p in ("lines", "inflight", "sent", "out", "err")))
        pipe.expire(batch_key(batch_id), self.ttl_s)
        pipe.execute()
