"""Every Redis key is named in common/keys.py: no other module spells one; and only the store
modules touch Redis (no `store.r` elsewhere)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEY = re.compile(r"llmq:[\w{]")   # "llmq:seq:...", f"llmq:{...}"; not a log line's "llmq: "


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes (they describe keys; they build none)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def key_spellings(path: Path) -> list[str]:
    """The string literals and f-strings of a module that spell an llmq key (or its prefix)."""
    tree = ast.parse(path.read_text(), str(path))
    skip, found = _docstrings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)   # its parts are judged with it
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            if KEY.search(text) or ("PREFIX" in names and text.startswith("{}:")):
                found.append((node.lineno, text))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in skip and KEY.search(node.value)):
            found.append((node.lineno, node.value[:40]))
    return [f"{path.name}:{line}: {text!r}" for line, text in sorted(found)]


def test_no_module_but_common_keys_spells_a_redis_key():
    modules = [p for d in ("app", "worker", "common", "bench", "scripts")
               for p in (ROOT / d).rglob("*.py")]
    assert len(modules) > 40
    found = [hit for p in modules if p != ROOT / "common" / "keys.py" for hit in key_spellings(p)]
    assert found == []


def test_the_check_sees_a_key_spelled_elsewhere(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text('"""llmq:seq:<id> in a docstring is prose."""\nPREFIX = "llmq"\n'
                      'A = f"llmq:seq:{1}"\nB = f"{PREFIX}:x:{2}"\nC = "llmq:cancelled"\n'
                      'D = "llmq: a log line"\n')
    assert [h.split(": ", 1)[0] for h in key_spellings(module)] == [
        "probe.py:3", "probe.py:4", "probe.py:5"]


# The stores: the only modules that hold a Redis client as `.r` and call it.
STORE_MODULES = {Path("common", n) for n in ("batch_store.py", "file_store.py",
                                              "webhook_store.py", "owner_index.py",
                                              "response_store.py", "idempotency_store.py",
                                              "queue_store.py", "reconcile_store.py")} | {
    p.relative_to(ROOT) for p in (ROOT / "common" / "store").glob("*.py")}


def redis_touches(path: Path) -> list[str]:
    """Where a module reaches into a store's client (`store.r`, `self.seqs.r.pipeline()`)."""
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.name}:{line}" for line in sorted(
        node.lineno for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "r")]


def test_no_module_but_the_stores_touches_redis_through_a_store():
    modules = [p for d in ("app", "worker", "common", "bench", "scripts")
               for p in (ROOT / d).rglob("*.py")]
    found = [hit for p in modules if p.relative_to(ROOT) not in STORE_MODULES
             for hit in redis_touches(p)]
    assert found == []


def test_the_redis_check_sees_a_store_client_used_elsewhere(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text("def f(store, self):\n    store.r.get('x')\n    r = store.r\n"
                      "    self.seqs.r.pipeline()\n    store.read(1)\n")
    assert redis_touches(module) == ["probe.py:2", "probe.py:3", "probe.py:4"]


LUA_SPELLS_KEY = re.compile(r"\.\.\s*['\"]:")   # `rec .. ':events'`: a key part spelled in Lua


def test_no_lua_script_spells_part_of_a_key():
    """The scripts get their keys from common/keys.py (KEYS, or prefix and suffix around an id
    the script reads itself): no script appends ':events' or ':seqs' to a prefix."""
    found = []
    for rel in sorted(STORE_MODULES):
        tree = ast.parse((ROOT / rel).read_text())
        found += [f"{rel}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and "redis.call" in node.value and LUA_SPELLS_KEY.search(node.value)]
    found += [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "common").rglob("*.lua"))
              for n, line in enumerate(p.read_text().splitlines(), 1)
              if LUA_SPELLS_KEY.search(line)]
    assert found == []
