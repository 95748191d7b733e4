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


# A page of GET /v1/jobs passes over at most this many entries it does not return (filtered
# out, or expired) before it answers: a filter that matches few of a long index must not read
# all of it in one request. Reaching it, the page answers what it found with has_more and, as
# last_id, the last entry it looked at, for `after` to go on from (docs/api.md). Files and
# batches are not bounded so: the openai SDK pages them from the last object's id and stops at
# an empty page, and LLMQ_FILE_MAX_FILES_PER_KEY already bounds a key's files.
PAGE_SCAN = 1000


@dataclass(frozen=True)
class Page:
    """One page of a list: the objects and whether more follow. `cursor` is where the next
    page starts when that is past the last object (a page cut short by PAGE_SCAN)."""

    data: list[dict[str, Any]]
    has_more: bool
    cursor: str | None = None

    def as_json(self) -> dict[str, Any]:
        last = self.cursor or (self.data[-1]["id"] if self.data else None)
        return {"object": "list", "data": self.data,
                "first_id": self.data[0]["id"] if self.data else None,
                "last_id": last, "has_more": self.has_more}


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

    def remove(self, owner: str, *item_ids: str) -> None:
        if item_ids:
            self.r.zrem(index_key(owner, self.kind), *item_ids)

    def fields(self, key_of: Callable[[str], str], ids: list[str],
               *names: str) -> list[dict[str, str] | None]:
        """Some fields of each id's hash, in one round trip (None for a hash that is gone): what
        a filter needs, without reading whole objects (a job's text)."""
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hmget(key_of(i), *names)
        return [dict(zip(names, vals)) if any(v is not None for v in vals) else None
                for vals in (pipe.execute() if ids else [])]

    def page(self, owner: str, load: Callable[[list[str]], list[dict | None]],
             after: str | None = None, limit: int = 20,
             keep: Callable[[dict], bool] = lambda _obj: True, chunk: int = 200,
             peek: Callable[[list[str]], list[dict | None]] | None = None,
             scan: int | None = None, max_bytes: int | None = None,
             size: Callable[[dict], int] = lambda _obj: 0) -> Page:
        """The objects after `after` (newest first). `load` reads a chunk of ids (None for an
        expired one, dropped from the index here); `keep` filters (a status filter). With
        `peek` (a cheaper read of what `keep` needs), `keep` judges what `peek` read and only
        the ids kept are loaded. With `scan`, at most that many entries are passed over (see
        PAGE_SCAN). With `max_bytes`, the page stops before the object that would take it past
        that many bytes by `size` (of what `peek` read, so that what is not returned is not
        loaded either), with has_more; its first object goes in whatever its size."""
        key = index_key(owner, self.kind)
        start = 0
        if after:
            rank = self.r.zrevrank(key, after)
            if rank is None:
                raise UnknownCursor(f"'after' is not one of your {self.kind}: {after!r}")
            start = rank + 1
        out: list[dict] = []
        passed, cursor = 0, after
        used, full = 0, False   # the kept objects' bytes by `size`; whether the next is over
        while len(out) <= limit:
            # Never read more entries than the page can still return or pass over.
            room = chunk if scan is None else min(chunk, limit + 1 - len(out) + scan - passed)
            ids = self.r.zrevrange(key, start, start + room - 1)
            if not ids:
                break
            start += len(ids)
            seen = (peek or load)(ids)
            gone = [i for i, o in zip(ids, seen) if o is None]
            if gone:
                self.r.zrem(key, *gone)
                start -= len(gone)
            kept = [(i, o) for i, o in zip(ids, seen) if o is not None and keep(o)]
            kept = kept[:limit + 1 - len(out)]   # (one past the limit says has_more)
            if max_bytes is not None:
                for n, (_i, o) in enumerate(kept):
                    used += size(o)
                    if used > max_bytes and (out or n):
                        kept, full = kept[:n], True
                        break
            if peek is not None and kept:
                # Judged again as loaded: one that changed (or went) between the reads is
                # skipped (a gone one is dropped from the index by the next list).
                kept = [(i, o) for (i, _), o in zip(kept, load([i for i, _ in kept]))
                        if o is not None and keep(o)]
            out += [o for _i, o in kept]
            if full:   # the next page starts after its last object
                return Page(out[:limit], True)
            passed += len(ids) - len(kept)
            cursor = next((i for i, o in zip(reversed(ids), reversed(seen)) if o is not None),
                          cursor)
            if scan is not None and passed >= scan and len(out) <= limit:
                more = bool(self.r.zrevrange(key, start, start))
                return Page(out, more, cursor if more else None)
        return Page(out[:limit], len(out) > limit)
