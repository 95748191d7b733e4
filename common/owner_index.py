"""Per-owner indexes (sorted sets, newest first) of jobs, files and batches, and the cursor
pagination over them that every list route shares (OpenAI's `after` + `limit`).

Keys:
  llmq:owner:<owner>:<kind>   zset  id -> created_at (unix seconds)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import redis

from .keys import Keys

index_key = Keys.owner_index


class UnknownCursor(ValueError):
    """`after` names no entry of the caller's list."""


@dataclass(frozen=True)
class Page:
    """One page of a list: the objects and whether more follow."""

    data: list[dict[str, Any]]
    has_more: bool

    def as_json(self) -> dict[str, Any]:
        return {"object": "list", "data": self.data,
                "first_id": self.data[0]["id"] if self.data else None,
                "last_id": self.data[-1]["id"] if self.data else None,
                "has_more": self.has_more}


class OwnerIndex:
    """One kind of object ("jobs", "files", "batches") listed per owner, newest first."""

    def __init__(self, client: redis.Redis, kind: str, ttl_s: int):
        self.r, self.kind, self.ttl_s = client, kind, ttl_s

    def add(self, owner: str, items: dict[str, float], pipe=None) -> None:
        """Indexes ids with their creation times; entries older than the TTL are dropped (their
        objects have expired), so an index never outgrows what it can list."""
        p = pipe if pipe is not None else self.r.pipeline(transaction=False)
        key = index_key(owner, self.kind)
        p.zadd(key, items)
        p.zremrangebyscore(key, "-inf", time.time() - self.ttl_s)
        p.expire(key, self.ttl_s)
        if pipe is None:
            p.execute()

    def remove(self, owner: str, item_id: str) -> None:
        self.r.zrem(index_key(owner, self.kind), item_id)

    def page(self, owner: str, load: Callable[[list[str]], list[dict | None]],
             after: str | None = None, limit: int = 20,
             keep: Callable[[dict], bool] = lambda _obj: True, chunk: int = 200) -> Page:
        """The objects after `after` (newest first). `load` reads a chunk of ids (None for an
        expired one, dropped from the index here); `keep` filters (a status filter)."""
        key = index_key(owner, self.kind)
        start = 0
        if after:
            rank = self.r.zrevrank(key, after)
            if rank is None:
                raise UnknownCursor(f"'after' is not one of your {self.kind}: {after!r}")
            start = rank + 1
        out: list[dict] = []
        while len(out) <= limit:
            ids = self.r.zrevrange(key, start, start + chunk - 1)
            if not ids:
                break
            start += len(ids)
            objs = load(ids)
            gone = [i for i, o in zip(ids, objs) if o is None]
            if gone:
                self.r.zrem(key, *gone)
                start -= len(gone)
            out += [o for o in objs if o is not None and keep(o)]
        return Page(out[:limit], len(out) > limit)
