"""Downloads the wheels a bare GPU machine needs to run llmq (`make gpu-wheels`).

Such a machine has PyTorch, transformers and what they pull, and no package registry: what
else llmq needs travels with the working tree (64 MiB a call) as wheels in `.gpu-wheels/`,
installed there by scripts/gpu_check.sh with `pip install --no-index`. The set is
requirements.txt's closure, at the versions this venv holds, minus the closure of torch and
transformers (the machine's own, which the wheels must not replace), for each Python version
the machine may run. `.gpu-wheels/requirements.txt` names what to install.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What the GPU machine brings: these and everything they require...
PROVIDED = ("torch", "transformers")
# ...but for these, which llmq requires and the machine's image lacks (KINDS.md's package
# list), though this venv's transformers pulls them (through typer).
LACKING = ("pydantic",)
# The platform tags a manylinux x86-64 wheel may carry (pip matches each tag exactly).
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 27, 28, 31, 34, 35)]
LIMIT_BYTES = 64 << 20   # what one device call carries, the working tree included
# What the model-worker tests need there beyond the runtime (tests/conftest.py imports lupa),
# for `GPU_CHECK_TESTS=1` (scripts/gpu_check.sh), and the default model's tokenizer files they
# build the tiny model with (a few MB; its 538 MB of weights are not needed).
TEST_EXTRAS = ("lupa",)
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json", "chat_template.jinja")


def _env(python: str, extra: str = "") -> dict:
    return {"python_version": python, "python_full_version": python + ".99",   # the series' latest
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "os_name": "posix", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "extra": extra}


def _requires(name: str, extras: set[str], python: str) -> list[Requirement]:
    """The installed distribution's requirements that apply on the target (with `extras`)."""
    out = []
    for raw in metadata.requires(name) or []:
        req = Requirement(raw)
        if req.marker is None or any(req.marker.evaluate(_env(python, e))
                                     for e in extras | {""}):
            out.append(req)
    return out


def closure(roots: list[Requirement], python: str, stop: set[str] = frozenset()
            ) -> dict[str, str]:
    """{name: installed version} of `roots` and everything they require on `python`, not
    going past the names in `stop`."""
    seen: dict[str, str] = {}
    todo = [(r.name, set(r.extras)) for r in roots]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in stop:
            continue
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            # (only a marker this venv's Python does not meet can leave a requirement out)
            sys.exit(f"{name} is not installed here: install it, then fetch again")
        first = key not in seen
        seen[key] = version
        if first or extras:
            todo += [(r.name, set(r.extras)) for r in _requires(name, extras, python)]
    return seen


def requirements(path: Path) -> list[Requirement]:
    lines = (re.sub(r"#.*", "", line).strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def wanted(python: str, reqs: list[Requirement]) -> dict[str, str]:
    """{name: version} to carry for `python`: llmq's runtime closure minus the machine's."""
    torch = set(closure([Requirement("torch")], python))
    provided = (set(closure([Requirement(p) for p in PROVIDED], python))
                - set(closure([Requirement(p) for p in LACKING], python, stop=torch)))
    return closure([r for r in reqs if r.marker is None or r.marker.evaluate(_env(python))],
                   python, stop=provided)


def copy_tokenizer(target: Path) -> None:
    """The default model's tokenizer and config files (converted once, as the tests do)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from worker.model_manager import ModelManager

    source = Path(ModelManager().resolve())
    target.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copyfile(source / name, target / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=".gpu-wheels")
    ap.add_argument("--python", action="append", help="target Python versions (3.12, 3.11)")
    ap.add_argument("--requirements", default="requirements.txt")
    ap.add_argument("--list", action="store_true", help="print what would be fetched, fetch nothing")
    args = ap.parse_args(argv)
    pythons = args.python or ["3.12", "3.11"]
    dest = Path(args.dest)
    reqs = requirements(Path(args.requirements)) + [Requirement(r) for r in TEST_EXTRAS]
    pins: dict[str, str] = {}
    for py in pythons:
        pins.update(wanted(py, reqs))
    if args.list:
        print("\n".join(f"{n}=={v}" for n, v in sorted(pins.items())))
        return 0
    dest.mkdir(exist_ok=True)
    for py in pythons:
        names = [f"{n}=={v}" for n, v in sorted(wanted(py, reqs).items())]
        subprocess.run([sys.executable, "-m", "pip", "download", "-qq", "--no-deps",
                        "--only-binary=:all:", "--implementation", "cp", "--python-version", py,
                        *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest),
                        *names], check=True)
    copy_tokenizer(dest / "tokenizer")
    (dest / "requirements.txt").write_text(
        "".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"{dest}: {len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB "
          f"(Python {', '.join(pythons)})")
    if size > LIMIT_BYTES:
        print(f"{dest} is over the {LIMIT_BYTES >> 20} MiB a device call carries", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
