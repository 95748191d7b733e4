"""The import graph shows the architecture: common/ is shared by both sides and imports
neither; the worker never imports the API package (it would pull in Flask and the routes, and
tie a worker's deploy to the API's code); inside the worker, the engine side reaches the model
process's code (worker/model/) only through the executors, and worker/model/ never reaches back
into the engine; and no module imports itself through others. Checked statically, so imports
inside functions count too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "common", "worker", "bench")
# The engine side's doors into the model process: it spawns process.main, or runs a backend
# in its own thread for tests and tools.
EXECUTORS = {"worker.model_executor", "worker.inprocess_executor"}
# What the model process shares with the engine side: the pipe's contract, and the model
# files' manager (both sides load the tokenizer).
SHARED_WITH_MODEL = {"worker.messages", "worker.model_manager"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = ROOT) -> set[tuple[str, str | None]]:
    """What a file imports, anywhere in it, relative imports resolved: (module, None) for
    `import module`, (package, name) for `from package import name` (a module or a name in
    the package)."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(alias.name, None) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            found |= {(base, alias.name) for alias in node.names}
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Our modules and the modules of ours each imports (a package's name stands for its
    __init__; `from package import module` is an edge to the module alone)."""
    files = {module_name(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}

    def target(base: str, name: str | None) -> str:
        return f"{base}.{name}" if name and f"{base}.{name}" in files else base

    return {name: {m for m in (target(*i) for i in imports(path, root))
                   if m in files and m != name}
            for name, path in files.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("package, forbidden", [
    ("worker", {"app"}),
    ("common", {"app", "worker"}),
])
def test_package_does_not_import(package, forbidden):
    offenders = {mod: sorted(m for m in deps if m.split(".")[0] in forbidden)
                 for mod, deps in graph().items() if under(mod, package)}
    offenders = {mod: names for mod, names in offenders.items() if names}
    assert not offenders, offenders


def test_the_engine_side_reaches_the_model_process_only_through_the_executors():
    offenders = {mod: sorted(m for m in deps if under(m, "worker.model"))
                 for mod, deps in graph().items()
                 if under(mod, "worker") and not under(mod, "worker.model")
                 and mod not in EXECUTORS}
    offenders = {mod: names for mod, names in offenders.items() if names}
    assert not offenders, offenders


def test_the_model_process_never_imports_the_engine_side():
    g = graph()
    assert "worker.model.process" in g, "the model process's code lives in worker/model/"
    offenders = {mod: sorted(m for m in deps if under(m, "worker") and m != "worker"
                             and not under(m, "worker.model") and m not in SHARED_WITH_MODEL)
                 for mod, deps in g.items() if under(mod, "worker.model")}
    offenders = {mod: names for mod, names in offenders.items() if names}
    assert not offenders, offenders


def test_no_import_circle_anywhere():
    assert circles(graph()) == []


def test_the_checks_see_imports_inside_functions_and_relative_ones(tmp_path):
    (tmp_path / "worker" / "model").mkdir(parents=True)
    (tmp_path / "worker" / "__init__.py").write_text("")
    (tmp_path / "worker" / "model" / "__init__.py").write_text("")
    a = tmp_path / "worker" / "model" / "a.py"
    a.write_text("def f():\n    from ..engine import X\n    import app.routes\n")
    assert imports(a, tmp_path) == {("worker.engine", "X"), ("app.routes", None)}


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_naming_the_spawn_target_imports_no_torch():
    """The Celery process names the model process's entry point; torch and the backends load
    in the spawned process only."""
    import subprocess
    import sys

    code = ("import sys, worker.model_executor, worker.inprocess_executor; "
            "print(sorted(m for m in ('torch', 'transformers', 'worker.model.transformers.backend')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"
