"""Files (OpenAI's /v1/files) in Redis: metadata, content and the owner's index.

Redis, because it is the one store every API replica and every worker already shares: a file
uploaded through one replica is read by the worker that drives its batch and downloaded
through another replica, with no shared disk or object store to run. The limits follow from
that: content lives in Redis's memory (size Redis's `maxmemory` for the files you keep),
`LLMQ_FILE_MAX_BYTES` caps one file (Redis itself caps a string at 512 MB), and every file
expires after `LLMQ_FILE_TTL` unless deleted sooner.

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
from .owner_index import OwnerIndex

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


class FileStore:
    """Stores, reads, lists and deletes files for their owners."""

    def __init__(self, client: redis.Redis, ttl_s: int):
        self.r, self.ttl_s = client, ttl_s
        self.index = OwnerIndex(client, "files", ttl_s)

    def put(self, owner: str, purpose: str, filename: str, content: str,
            file_id: str | None = None) -> dict[str, Any]:
        """Stores a file (overwrites one with the same id: writing a batch's output twice after
        a restart leaves one file)."""
        file_id = file_id or new_file_id()
        now = time.time()
        meta = {"id": file_id, "owner": owner, "purpose": purpose, "filename": filename,
                "bytes": len(content.encode()), "created_at": now, "expires_at": now + self.ttl_s}
        pipe = self.r.pipeline(transaction=True)
        pipe.set(content_key(file_id), content, ex=self.ttl_s)
        pipe.hset(file_key(file_id), mapping=meta)
        pipe.expire(file_key(file_id), self.ttl_s)
        self.index.add(owner, {file_id: now}, pipe)
        pipe.execute()
        return file_object({k: str(v) for k, v in meta.items()})

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
