"""The packages' import graph: common/ is shared by both sides and imports neither; the worker
never imports the API package (it would pull in Flask and the routes, and tie a worker's
deploy to the API's code). Checked statically, so imports inside functions count too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_packages(path: Path) -> set[str]:
    """The top-level packages a module imports, anywhere in it (relative imports excluded)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package, forbidden", [
    ("worker", {"app"}),
    ("common", {"app", "worker"}),
])
def test_package_does_not_import(package, forbidden):
    offenders = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & forbidden)
                 for p in sorted((ROOT / package).rglob("*.py"))}
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, offenders


def test_the_check_sees_imports_inside_functions(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from app.llm_engine import X\n    import worker.tasks\n")
    assert imported_packages(mod) == {"app", "worker"}
