"""The sequence store's parts: each Lua script ships and loads and names its KEYS and ARGV, and
each part works alone over a client (SequenceStore composes them; tests/unit/test_store.py)."""
from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch
import ast
from pathlib import Path

import fakeredis
import lupa
import pytest
from redis.commands.core import Script

from common.protocol import FinishReason, SequenceRequest, SequenceStatus
from common.store import (Admission, EventStore, MetricsStore, OwnerSecret, RecordStore,
                          SequenceStore, StorePart, StreamLeases, TokenDelta, WorkerRegistry,
                          events_key, running_key)
from common.batch_store import BatchStore
from common.idempotency_store import IdempotencyStore
from common.queue_store import QueueStore
from common.reconcile_store import ReconcileStore
from common.response_store import ResponseStore
from common.store.lua_scripts import SCRIPT_NAMES, SEQUENCE_SCRIPTS, STORE_SCRIPTS, lua_source
from common.webhook_store import WebhookStore

ROOT = Path(__file__).resolve().parents[2]
COMMON = ROOT / "common"
LUA_DIR = ROOT / "common" / "store" / "lua"
PARTS = (RecordStore, EventStore, WorkerRegistry, Admission, StreamLeases, OwnerSecret,
         MetricsStore)


@pytest.fixture
def r():
    return fakeredis.FakeRedis(decode_responses=True)


# --- the scripts -----------------------------------------------------------------------------
def test_every_script_has_its_file_and_every_file_is_a_script():
    assert sorted(p.stem for p in LUA_DIR.glob("*.lua")) == sorted(SCRIPT_NAMES)


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_every_script_loads_and_compiles(name):
    lupa.LuaRuntime().compile(lua_source(name))   # a syntax error raises here


def test_a_missing_script_fails_to_load():
    with pytest.raises(FileNotFoundError):
        lua_source("no_such_script")


def test_the_package_ships_the_scripts():
    """The wheel carries the .lua files next to the code that reads them."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = data["package-data"]["common.store"]
    assert all(any(fnmatch(f"lua/{p.name}", g) for g in globs) for p in LUA_DIR.glob("*.lua"))


# A literal index (KEYS[3], ARGV[11]) anywhere but where the script names it at its top.
LITERAL_INDEX = re.compile(r"\b(KEYS|ARGV)\[\d+\]")
_ONE = r"(tonumber\()?(KEYS|ARGV)\[\d+\]\)?"
NAMING_LINE = re.compile(rf"^local \w+(, \w+)? = {_ONE}(, {_ONE})?\s*(--.*)?$")


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_every_script_names_its_keys_and_args_before_using_them(name):
    lines = lua_source(name).splitlines()
    naming = [i for i, line in enumerate(lines) if NAMING_LINE.match(line)]
    assert naming, f"{name}.lua names none of its KEYS and ARGV"
    body = [(i + 1, line) for i, line in enumerate(lines)
            if i not in naming and LITERAL_INDEX.search(line.split("--")[0])]
    assert body == []
    # ... and each name once: two locals reading one index would hide a collision.
    named = [m for i in naming for m in LITERAL_INDEX.finditer(lines[i].split("--")[0])]
    assert len({m.group(0) for m in named}) == len(named)


def test_each_part_registers_its_scripts_and_the_store_all_of_them(r):
    for part in PARTS:
        p = part(r)
        assert all(hasattr(p, attr) for attr in part.SCRIPTS)
    store = SequenceStore(r)
    registered = {name for part in PARTS for name in part.SCRIPTS.values()}
    assert registered == set(SEQUENCE_SCRIPTS)
    assert all(hasattr(store, attr) for part in PARTS for attr in part.SCRIPTS)
    assert all(issubclass(part, StorePart) for part in PARTS)


def _calls(name: str):
    """Every call in common/ of a function or method called `name`: (file, the call)."""
    for path in sorted(COMMON.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and name in (getattr(node.func, "attr", None),
                                                       getattr(node.func, "id", None)):
                yield path.relative_to(ROOT), node


def test_no_script_is_a_python_string():
    """register_script takes only a .lua file's text (lua_source), never a literal or a
    constant, so a new script cannot be written as a Python string."""
    calls = list(_calls("register_script"))
    assert calls
    for path, call in calls:
        arg = call.args[0] if call.args else call.keywords[0].value
        assert (isinstance(arg, ast.Call) and getattr(arg.func, "id", None) == "lua_source"), \
            f"{path}:{call.lineno} registers a script that is not a .lua file"


def test_the_other_stores_register_each_of_their_scripts_by_its_file_name():
    named = [call.args[1].value for _, call in _calls("register")
             if len(call.args) == 2 and isinstance(call.args[1], ast.Constant)]
    assert sorted(named) == sorted(STORE_SCRIPTS)


def test_each_store_loads_its_scripts(r):
    stores = (BatchStore(r, ttl_s=60), IdempotencyStore(r), QueueStore(r),
              ReconcileStore(r, ["q"]), ResponseStore(r, ttl_s=60), WebhookStore(r, ttl_s=60))
    scripts = [v for store in stores for v in vars(store).values() if isinstance(v, Script)]
    assert sorted(s.script for s in scripts) == sorted(lua_source(n) for n in STORE_SCRIPTS)


# --- each part alone -------------------------------------------------------------------------
def test_records_alone_create_read_and_finish(r):
    records = RecordStore(r, result_ttl_s=60)
    job = records.create([SequenceRequest("seq-a", prompt="Hi")], model="m")[0]
    assert records.get_job("seq-a") == job and job["status"] == "queued"
    assert records.finish("seq-a", FinishReason.STOP, text="done")
    assert records.get_job("seq-a")["text"] == "done"
    assert not records.finish("seq-a", FinishReason.STOP)   # once


def test_workers_and_events_alone_start_publish_and_reclaim(r):
    RecordStore(r).create([SequenceRequest("seq-a", prompt="Hi")])
    workers, events = WorkerRegistry(r), EventStore(r)
    workers.heartbeat("w1", {"model": "m"}, ttl_s=30)
    assert workers.start("seq-a", "w1") == (SequenceStatus.QUEUED.value, 1)
    assert events.publish_deltas([TokenDelta("seq-a", "x", 1, attempt=1)]) == []
    assert events.publish_deltas([TokenDelta("seq-a", "y", 2, attempt=9)]) == [0]   # fenced
    assert [k for _, k, _ in events.read_events("seq-a")] == ["token"]
    assert workers.running_ids("w1") == {"seq-a"}
    assert workers.reclaim("w1") == ["seq-a"]   # its own, forced
    assert r.exists(running_key("w1")) == 0
    assert [k for _, k, _ in events.read_events("seq-a")] == ["token", "reset"]
    assert r.ttl(events_key("seq-a")) > 0


def test_admission_alone_caps_the_queue_and_a_keys_minute(r):
    admission = Admission(r)
    assert admission.admit("q", ["seq-a", "seq-b"], "o", max_queued=2, owner_cap=0)[0] == "ok"
    assert admission.admit("q", ["seq-c"], "o", max_queued=2, owner_cap=0) == ("queue", 2)
    admission.sent(["seq-a", "seq-b"])
    assert admission.admit("q", ["seq-c"], "o", max_queued=2, owner_cap=0)[0] == "ok"
    assert admission.reserve_usage("o", 1, 10, rpm=1, tpm=0)[0] == ""
    assert admission.reserve_usage("o", 1, 10, rpm=1, tpm=0)[0] == "rpm"


def test_stream_leases_owner_secret_and_metrics_alone(r):
    leases = StreamLeases(r)
    token = leases.open_stream("o", cap=1, lease_s=30)
    assert token and leases.open_stream("o", cap=1, lease_s=30) is None
    leases.close_stream("o", token)
    assert leases.open_stream("o", cap=1, lease_s=30)
    secret = OwnerSecret(r).owner_secret()
    assert OwnerSecret(r).owner_secret() == secret and len(secret) == 64
    MetricsStore(r).record_metrics([])   # nothing to record: no round trip, no error
    assert isinstance(MetricsStore(r).metrics_snapshot(), dict)
