"""Admission to the queue: its depth, a key's share of it, and a key's per-minute charges."""
from __future__ import annotations

import math
import time

from ..protocol import SequenceRequest
from .base import (ADMITTING_KEY, UNSTARTED_KEY, StorePart, owner_seqs_key,
                   owner_stored_bytes_key, owner_stored_key, rate_key)

PRIORITY_SEP = "\x06\x16"   # kombu's Redis priority-queue separator
ADMITTING_S = 60.0   # an admission whose messages were never sent (a dead API) counts this long
STORAGE_PRUNE = 1000   # expired storage entries pruned at most per call (admit.lua's PRUNE)


def queue_lists(queue: str) -> list[str]:
    """The broker's lists of one queue: Celery's Redis transport keeps one per priority step
    (name, name + sep + step)."""
    return [queue] + [f"{queue}{PRIORITY_SEP}{p}" for p in range(1, 10)]


def reserved_tokens(req: SequenceRequest) -> int:
    """What a sequence is charged against its key's tokens per minute when it is accepted:
    max_tokens plus its prompt as OpenAI estimates it (a token per 4 bytes; the API does not
    tokenize). The end settles the charge with the real prompt and completion counts."""
    text = req.prompt or "".join(m.get("content", "") for m in req.messages or [])
    return req.params.max_tokens + math.ceil(len(text.encode("utf-8")) / 4)


class Admission(StorePart):
    """Admits sequences to the queue against its caps, and charges keys' rate windows."""

    SCRIPTS = {"_admit": "admit", "_reserve": "reserve", "_unstore": "unstore"}

    def queue_depth(self, queue: str) -> int:
        """Messages in the broker queue. Celery's Redis transport keeps one list per queue and
        priority step (name, name + sep + step)."""
        pipe = self.r.pipeline(transaction=False)
        for name in queue_lists(queue):
            pipe.llen(name)
        return sum(pipe.execute())

    def reserve_usage(self, owner: str, seqs: int, tokens: int, rpm: int, tpm: int
                      ) -> tuple[str, int, str]:
        """Charges the caller's fixed one-minute window (shared by every API replica) with
        `seqs` sequences and `tokens` tokens unless that passes `rpm` or `tpm` (0 = no limit).
        Returns (the limit hit: "rpm", "tpm" or "" when charged, seconds until the window
        ends, the window's key)."""
        t = time.time()
        window = int(t // 60)
        key = rate_key(owner, window)
        hit = self._reserve(keys=[key], args=[seqs, tokens, rpm, tpm])
        return ("" if hit == "ok" else hit), max(1, int((window + 1) * 60 - t) + 1), key

    def admit(self, queue: str, seq_ids: list[str], owner: str, max_queued: int,
              owner_cap: int, owner_floor: int = 0, storage_quota: int = 0,
              stored_by: str | None = None) -> tuple[str, int]:
        """Admits the sequences in one atomic step unless the queue (LLMQ_MAX_QUEUED) or the
        owner's share (owner_cap; 0: none) is full; an owner with a cap whose unfinished
        sequences, these included, stay within owner_floor gets in even past a full queue
        (other keys' backlog cannot lock it out). With a `storage_quota` (0: none), the bytes
        that `stored_by`'s (by default the owner's) ended sequences keep must be under it.
        Returns ("ok", the owner's unfinished sequences before them) or the cap that refused
        them ("queue", "key" or "storage") and its count (for "storage", the bytes kept).
        Admitted ids count towards the queue until `sent` (or unadmit) takes them out."""
        t = time.time()
        stored_by = owner if stored_by is None else stored_by
        kind, count = self._admit(
            keys=[ADMITTING_KEY, owner_seqs_key(owner), UNSTARTED_KEY,
                  owner_stored_key(stored_by), owner_stored_bytes_key(stored_by),
                  *queue_lists(queue)],
            args=[t, t - ADMITTING_S, t - self.pending_ttl_s, max_queued, owner_cap,
                  int(self.pending_ttl_s), owner_floor, storage_quota, *seq_ids])
        return (kind.decode() if isinstance(kind, bytes) else kind), int(count)

    def storage_frees_in(self, owner: str) -> int:
        """Seconds until the oldest of an owner's stored sequences expires (and frees its
        room); at least 1."""
        oldest = self.r.zrange(owner_stored_key(owner), 0, 0, withscores=True)
        return max(1, int((oldest[0][1] if oldest else 0) - time.time()) + 1)

    def storage_used(self, owner: str) -> int:
        """The bytes an owner's stored results keep now, its expired entries pruned first
        (what admit.lua does inside admission; here for stores that charge outside it, as a
        batch's creation does)."""
        gone = self.r.zrangebyscore(owner_stored_key(owner), "-inf", time.time(), 0,
                                    STORAGE_PRUNE)
        if gone:
            pipe = self.r.pipeline(transaction=False)
            for member in gone:
                item_id, size = (member.decode() if isinstance(member, bytes)
                                 else member).rsplit(" ", 1)
                self._unstore(keys=[owner_stored_key(owner), owner_stored_bytes_key(owner)],
                              args=[item_id, int(size)], client=pipe)
            pipe.execute()
        return int(self.r.get(owner_stored_bytes_key(owner)) or 0)

    def unstore(self, owner: str, seq_id: str, size: int) -> None:
        """An ended sequence's record was deleted before it expired: its `size` bytes no
        longer count toward its owner's storage quota."""
        if size:
            self._unstore(keys=[owner_stored_key(owner), owner_stored_bytes_key(owner)],
                          args=[seq_id, size])

    def sent(self, seq_ids: list[str]) -> None:
        """Their messages are in the broker's lists (or never will be): the queue counts them
        there, not as admitted."""
        if seq_ids:
            self.r.zrem(ADMITTING_KEY, *seq_ids)

    def unadmit(self, seq_ids: list[str], owner: str) -> None:
        """Takes back an admission that a later check refused (nothing was created)."""
        if seq_ids:
            pipe = self.r.pipeline(transaction=True)
            pipe.zrem(ADMITTING_KEY, *seq_ids)
            pipe.zrem(UNSTARTED_KEY, *seq_ids)
            if owner:
                pipe.zrem(owner_seqs_key(owner), *seq_ids)
            pipe.execute()

    def unfinished_of(self, owner: str) -> int:
        """How many sequences of a key are queued or running (records that expired without
        finishing drop out after the pending TTL)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zremrangebyscore(owner_seqs_key(owner), "-inf", time.time() - self.pending_ttl_s)
        pipe.zcard(owner_seqs_key(owner))
        return pipe.execute()[1]
