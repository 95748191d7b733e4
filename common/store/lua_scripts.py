"""The store's Lua scripts: each read once from common/store/lua/<name>.lua."""
from __future__ import annotations

import functools
from importlib import resources

import redis
from redis.commands.core import Script

# Every script the sequence store runs (one .lua file each); tests load them all, so a file
# missing from a package fails a fast test, not a worker.
SCRIPT_NAMES = ("start", "reclaim", "resent", "finish", "admit", "reserve", "open_stream",
                "renew_slots", "publish")


@functools.cache
def lua_source(name: str) -> str:
    """The text of lua/<name>.lua, read from the installed package once per process."""
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text("utf-8")


def register(client: redis.Redis, name: str) -> Script:
    """A script on `client` (redis-py's Script: EVALSHA, loaded again after a SCRIPT FLUSH)."""
    return client.register_script(lua_source(name))
