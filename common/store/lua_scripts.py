"""The stores' Lua scripts: each read once from common/store/lua/<name>.lua."""
from __future__ import annotations

import functools
from importlib import resources

import redis
from redis.commands.core import Script

# Every script the sequence store runs (one .lua file each); tests load them all, so a file
# missing from a package fails a fast test, not a worker.
SEQUENCE_SCRIPTS = ("start", "reclaim", "resent", "finish", "admit", "reserve", "open_stream",
                    "renew_slots", "publish", "unstore")
# The other stores' scripts (common/<store>_store.py), named <store>_<role>.
STORE_SCRIPTS = ("batch_claim", "batch_renew", "batch_answer", "batch_cancel",
                 "idempotency_claim", "idempotency_settle", "queue_position",
                 "reconcile_claim", "reconcile_sweep_unacked", "response_load",
                 "response_delete", "webhook_due", "webhook_sent", "webhook_acquire",
                 "webhook_release")
SCRIPT_NAMES = SEQUENCE_SCRIPTS + STORE_SCRIPTS


@functools.cache
def lua_source(name: str) -> str:
    """The text of lua/<name>.lua, read from the installed package once per process."""
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text("utf-8")


def register(client: redis.Redis, name: str) -> Script:
    """A script on `client` (redis-py's Script: EVALSHA, loaded again after a SCRIPT FLUSH)."""
    return client.register_script(lua_source(name))
