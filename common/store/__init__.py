"""The sequence store: every read and write of a sequence's record, stream and channel, and
of the worker registry and admission state around them, one concern per module:

  records.py        RecordStore     create, read, load, cancel and finish records
  events.py         EventStore      write an engine step's tokens, read event streams
  workers.py        WorkerRegistry  heartbeats, start/hold/release, reclaim a dead worker's
  admission.py      Admission       the queue's caps and a key's per-minute charges
  api_charges.py    ApiCharges      a key's refused requests and grammar compile time a minute
  stream_leases.py  StreamLeases    a key's open SSE streams
  owner_secret.py   OwnerSecret     the HMAC secret that names owners
  metrics_store.py  MetricsStore    run sequences' figures
  jobs.py           job_from_record the public job object; ids.py the id shapes
  lua/*.lua         the atomic scripts, each naming its KEYS and ARGV at the top (the
                    other stores' too, as <store>_<role>.lua: batch_claim.lua, ...)

Each part stands alone over a Redis client (`RecordStore(client)`); SequenceStore is all of
them on one client, and owns the connection (dedicated blocking readers, CLIENT UNBLOCK).

Keys (all names are built in common/keys.py, and read and written only by the stores):
  llmq:seq:<id>            hash    the sequence record (status, prompt, params, text, usage, times)
  llmq:seq:<id>:events     stream  token / reset / done events; entry ids are the SSE ids
  llmq:tokens:<id>         pub/sub the same events, at-most-once, for direct subscribers
  llmq:text:<id>           string  a running attempt's text so far, appended to at each step
  llmq:cancelled           set     ids whose cancellation was asked for; the engine polls it
  llmq:workers             zset    worker name -> last engine heartbeat (unix seconds)
  llmq:worker:<name>       hash    what that worker reports (model, device, counters)
  llmq:running:<name>      set     ids a worker started and has not finished, and ids it took
                                   back (from a dead worker) and has not yet sent again
  llmq:rate:<owner>:<min>  hash    a key's sequences and tokens in one minute (rate limits),
                                   its refused requests and grammar compile ms (API budgets)
  llmq:owner:<owner>:seqs  zset    a key's unfinished sequences -> created (its queue share)
  llmq:owner:<owner>:streams zset  a key's open SSE streams -> lease end (its stream cap)
  llmq:owner:<owner>:stored  zset  a key's ended sequences "<id> <bytes>" -> their expiry, and
  llmq:owner:<owner>:stored-bytes  their sum (its storage quota, LLMQ_KEY_STORAGE_BYTES)
  llmq:owner-secret        string the HMAC secret naming owners, when no setting gives one
  llmq:held:<name>         set     ids whose message that worker received, task not yet ended
  llmq:admitting           zset    ids admitted to the queue, message not sent yet -> when
  llmq:unstarted           zset    ids accepted and not yet started or ended -> when their
                                   message was last sent or seen (common/reconcile_store.py)
"""
from __future__ import annotations

from typing import Any

import redis

from .admission import ADMITTING_S, PRIORITY_SEP, Admission, queue_lists, reserved_tokens
from .api_charges import ApiCharges
from .base import (ADMITTING_KEY, CANCELLED_KEY, OWNER_SECRET_KEY, UNSTARTED_KEY, WORKERS_KEY,
                   StorePart, channel, events_key, held_key, owner_seqs_key, owner_streams_key,
                   rate_key, record_key, running_key, text_key, worker_key)
from .events import EventStore, TokenDelta, reset_data
from .ids import is_seq_id, valid_stream_id
from .jobs import Job, Usage, job_from_record
from .metrics_store import MetricsStore
from .owner_secret import OwnerSecret
from .records import Finish, RecordStore
from .stream_leases import StreamLeases
from .workers import WorkerRegistry

__all__ = [
    "ADMITTING_KEY", "ADMITTING_S", "CANCELLED_KEY", "OWNER_SECRET_KEY", "PRIORITY_SEP",
    "UNSTARTED_KEY", "WORKERS_KEY", "Admission", "ApiCharges", "EventStore", "Finish", "Job",
    "MetricsStore", "OwnerSecret", "RecordStore", "SequenceStore", "StorePart", "StreamLeases",
    "TokenDelta", "WorkerRegistry", "channel", "events_key", "held_key", "is_seq_id",
    "job_from_record", "owner_seqs_key", "owner_streams_key", "queue_lists", "rate_key",
    "record_key", "reserved_tokens", "reset_data", "running_key", "text_key", "Usage",
    "valid_stream_id", "worker_key"
]


class SequenceStore(RecordStore, EventStore, WorkerRegistry, Admission, ApiCharges,
                    StreamLeases, OwnerSecret, MetricsStore):
    """All the store's parts on one Redis client; both the API and the worker go through it."""

    def __init__(self, client: redis.Redis, *, result_ttl_s: int = 86400,
                 pending_ttl_s: int = 7 * 86400, stream_maxlen: int = 20_000):
        super().__init__(client, result_ttl_s=result_ttl_s, pending_ttl_s=pending_ttl_s,
                         stream_maxlen=stream_maxlen)
        self._conn_id: int | None = None   # a dedicated store's connection id, kept current

    def beside(self, store_cls: type, *args: Any):
        """Another store (files, batches, webhooks, an owner's index) on this one's connection:
        the stores are the only modules that touch Redis (tests/unit/test_keys.py)."""
        return store_cls(self.r, *args)

    @classmethod
    def from_settings(cls, settings, client: redis.Redis | None = None) -> "SequenceStore":
        # redis-py's default 5 s socket timeout would cut every XREAD BLOCK that waits longer
        # (an SSE stream whose next token is slow): allow the longest block plus a margin, and
        # still notice a dead server.
        client = client or redis.Redis.from_url(
            settings.redis_url, decode_responses=True, health_check_interval=30,
            socket_timeout=max(settings.sse_keepalive_s, settings.wait_timeout_s / 60) + 15,
            socket_connect_timeout=5, retry_on_timeout=False,
            # redis-py 8 caps a pool at 100 connections; every open SSE stream holds one while
            # it blocks in XREAD, and an API process serves 256 threads.
            max_connections=1024)
        return cls(client, result_ttl_s=settings.result_ttl_s,
                   pending_ttl_s=settings.pending_ttl_s, stream_maxlen=settings.stream_maxlen)

    def dedicated(self) -> "SequenceStore":
        """This store over a connection of its own, held (not returned to the pool between
        commands): a blocking reader that others must be able to name (CLIENT UNBLOCK). Its
        id is kept current: redis-py reconnects a dropped connection inside a command, and
        retries the command (a blocking XREAD too) under the new id."""
        client = type(self.r)(connection_pool=self.r.connection_pool,
                              single_connection_client=True)
        store = SequenceStore(client, result_ttl_s=self.result_ttl_s,
                              pending_ttl_s=self.pending_ttl_s, stream_maxlen=self.stream_maxlen)
        store._conn_id = int(client.client_id())
        conn = getattr(client, "connection", None)
        if hasattr(conn, "register_connect_callback"):
            conn.register_connect_callback(store._reconnected)
        return store

    def _reconnected(self, conn) -> None:
        """redis-py's callback after it (re)connected a dedicated store's connection: its
        new id, asked on that connection before the command it retries goes out."""
        conn.send_command("CLIENT", "ID")
        self._conn_id = int(conn.read_response())

    def close(self) -> None:
        """Lets go of this store's connections (a dedicated one's included)."""
        conn = getattr(self.r, "connection", None)
        if self._conn_id is not None and hasattr(conn, "deregister_connect_callback"):
            conn.deregister_connect_callback(self._reconnected)   # it goes back to the pool
        self.r.close()

    def client_id(self) -> int:
        """The connection's id (a dedicated store's as of its last connect, no round trip)."""
        return self._conn_id if self._conn_id is not None else int(self.r.client_id())

    def unblock_client(self, client_id: int) -> bool:
        """Ends another connection's blocking command (as if it timed out); False when it was
        not blocked."""
        return bool(self.r.client_unblock(client_id))
