"""What every part of the sequence store shares: the client, the TTLs, the key names."""
from __future__ import annotations

import time
from typing import Any

import redis

from ..keys import Keys
from .lua_scripts import register

# The key names the parts use, all built in common/keys.py.
CANCELLED_KEY = Keys.cancelled
WORKERS_KEY = Keys.workers
OWNER_SECRET_KEY = Keys.owner_secret
ADMITTING_KEY = Keys.admitting
UNSTARTED_KEY = Keys.unstarted
record_key, events_key, channel = Keys.record, Keys.events, Keys.channel
text_key = Keys.running_text
worker_key, running_key, held_key = Keys.worker, Keys.running, Keys.held
owner_seqs_key, owner_streams_key, rate_key = Keys.owner_seqs, Keys.owner_streams, Keys.rate
owner_stored_key, owner_stored_bytes_key = Keys.owner_stored, Keys.owner_stored_bytes


class StorePart:
    """One concern of the sequence store over a Redis client; usable alone or composed into
    SequenceStore. A part names its Lua scripts in SCRIPTS (attribute -> lua/<name>.lua); each
    is registered on the client when the part is made."""

    SCRIPTS: dict[str, str] = {}

    def __init__(self, client: redis.Redis, *, result_ttl_s: int = 86400,
                 pending_ttl_s: int = 7 * 86400, stream_maxlen: int = 20_000):
        self.r = client
        self.result_ttl_s = result_ttl_s
        self.pending_ttl_s = pending_ttl_s
        self.stream_maxlen = stream_maxlen
        for cls in type(self).__mro__:
            for attr, name in vars(cls).get("SCRIPTS", {}).items():
                setattr(self, attr, register(client, name))


def now() -> float:
    return round(time.time(), 6)


def num(v: Any, cast=float):
    """A record field as a number; None when it is missing or empty."""
    return cast(v) if v not in (None, "") else None
