"""Files (OpenAI's /v1/files) in Redis: metadata, content and the owner's index.

Redis, because it is the one store every API replica and every worker already shares: a file
uploaded through one replica is read by the worker that drives its batch and downloaded
through another replica, with no shared disk or object store to run. The limits follow from
that: content lives in Redis's memory (size Redis's `maxmemory` for the files you keep),
`LLMQ_FILE_MAX_BYTES` caps one file (Redis itself caps a string at 512 MB), every file
expires after `LLMQ_FILE_TTL` unless deleted sooner, and an upload may not take its key's live
files past `LLMQ_FILE_MAX_BYTES_PER_KEY` or `LLMQ_FILE_MAX_FILES_PER_KEY` (that memory is
every key's).

Keys:
  llmq:file:<id>            hash    id, owner, purpose, filename, bytes, created_at, expires_at
  llmq:file:<id>:content    string  the content (UTF-8 text: batch files are JSON Lines)
  llmq:owner:<owner>:files  zset    see owner_index
"""
from __future__ import annotations

import re
import secrets
import time
import uuid
from typing import Any

import redis

from .keys import Keys
from .owner_index import OwnerIndex, index_key

file_key = Keys.file
content_key = Keys.file_content


# Every file id has this shape (input files and batch outputs alike); anything else names no
# file, and must not reach Redis: "<id>:content" is the file's content key, another type.
_FILE_ID = re.compile(r"file-[0-9a-f]{32}")


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def file_object(meta: dict[str, str]) -> dict[str, Any]:
    """OpenAI's file object."""
    return {"id": meta["id"], "object": "file", "bytes": int(meta["bytes"]),
            "created_at": int(float(meta["created_at"])), "filename": meta["filename"],
            "purpose": meta["purpose"], "status": "processed",
            "expires_at": int(float(meta["expires_at"])), "status_details": None}


class StorageFull(Exception):
    """A file would take its owner past a cap: `limit` ("bytes" or "files") and what the owner
    would hold with it."""

    def __init__(self, limit: str, would_hold: int):
        super().__init__(f"{limit}: {would_hold}")
        self.limit, self.would_hold = limit, would_hold


class FileStore:
    """Stores, reads, lists and deletes files for their owners."""

    def __init__(self, client: redis.Redis, ttl_s: int):
        self.r, self.ttl_s = client, ttl_s
        self.index = OwnerIndex(client, "files", ttl_s)

    def put(self, owner: str, purpose: str, filename: str, content: str,
            file_id: str | None = None, *, max_bytes: int = 0,
            max_files: int = 0) -> dict[str, Any]:
        """Stores a file (overwrites one with the same id: writing a batch's output twice after
        a restart leaves one file). With `max_bytes` or `max_files` (an upload; 0 = no cap),
        refuses (StorageFull) a file that would take its owner's live files past either.

        Batch output and error files are written without caps: a batch the key was allowed to
        create must not fail at its end. They are the key's files all the same (it downloads
        and deletes them), so they count toward its usage and its next uploads wait for room.
        What they add is bounded by what the key may generate (its lines' max_tokens, its rate
        limits)."""
        file_id = file_id or new_file_id()
        size = len(content.encode())
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    if max_bytes or max_files:
                        # Counted under WATCH of the owner's index: an upload, delete or prune
                        # of its files in between (another replica's) makes us count again, so
                        # uploads at once cannot each find the same room.
                        pipe.watch(index_key(owner, self.index.kind))
                        files, used = self.usage(owner)
                        if max_files and files + 1 > max_files:
                            raise StorageFull("files", files + 1)
                        if max_bytes and used + size > max_bytes:
                            raise StorageFull("bytes", used + size)
                        pipe.multi()
                    now = time.time()
                    meta = {"id": file_id, "owner": owner, "purpose": purpose,
                            "filename": filename, "bytes": size, "created_at": now,
                            "expires_at": now + self.ttl_s}
                    pipe.set(content_key(file_id), content, ex=self.ttl_s)
                    pipe.hset(file_key(file_id), mapping=meta)
                    pipe.expire(file_key(file_id), self.ttl_s)
                    self.index.add(owner, {file_id: now}, pipe)
                    pipe.execute()
                    return file_object({k: str(v) for k, v in meta.items()})
                except redis.WatchError:
                    continue

    def usage(self, owner: str) -> tuple[int, int]:
        """The files and bytes an owner holds: read from its live files' metadata, not kept in
        a counter, so a file that expired or was deleted counts for nothing."""
        ids = self.r.zrange(index_key(owner, self.index.kind), 0, -1)
        sizes = [int(m["bytes"]) for m in self.index.fields(file_key, ids, "bytes") if m]
        return len(sizes), sum(sizes)

    def get(self, file_id: str, owner: str) -> dict[str, Any] | None:
        """The file object, or None when it does not exist for this owner."""
        meta = self._meta(file_id, owner)
        return file_object(meta) if meta else None

    def content(self, file_id: str, owner: str) -> str | None:
        if self._meta(file_id, owner) is None:
            return None
        return self.r.get(content_key(file_id))

    def delete(self, file_id: str, owner: str) -> bool:
        if self._meta(file_id, owner) is None:
            return False
        self.r.delete(file_key(file_id), content_key(file_id))
        self.index.remove(owner, file_id)
        return True

    def list(self, owner: str, after: str | None, limit: int, purpose: str | None = None):
        def load(ids):
            pipe = self.r.pipeline(transaction=False)
            for i in ids:
                pipe.hgetall(file_key(i))
            return [file_object(m) if m else None for m in pipe.execute()]

        return self.index.page(owner, load, after, limit,
                               keep=lambda f: purpose is None or f["purpose"] == purpose)

    def _meta(self, file_id: str, owner: str) -> dict[str, str] | None:
        if not _FILE_ID.fullmatch(file_id):
            return None
        meta = self.r.hgetall(file_key(file_id))
        if not meta or not secrets.compare_digest(meta.get("owner", ""), owner):
            return None   # another key's file does not exist for this caller
        return meta
