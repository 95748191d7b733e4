"""The baseline comparison (`--baseline REF`): another commit's own stack (its worker and its
API, run from a temporary copy of its tree) against this checkout's, with the same venv,
redis-server, model, load generator, prompts and forced output length, and at the same dtype
(float32: older trees have no dtype `auto`, they serve float32 on a CPU). The systems take each
level in turn, round after round, the order reversed every other round, so that drift on a
shared machine hits all of them; each level's figure is the median over the rounds."""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from . import report
from .loadgen import closed_loop, payload
from .raw import short_prompts
from .stack import ROOT, Stack

JUDGED_DTYPE = "float32"
# Pins of REF's requirements.txt that are not overlaid: compiled cores the rest of the venv is
# built against (a differing one is reported, not installed).
NOT_OVERLAID = {"torch", "numpy"}
OVERLAY_CACHE = Path("~/.cache/llmq/baseline-deps").expanduser()


def _git(cwd: Path, *argv: str, text: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=text, timeout=120)


def resolve_ref(ref: str, cwd: Path = ROOT) -> tuple[str, str]:
    """REF (a branch, tag, sha or `HEAD~n`) as (full sha, short sha); ValueError when the
    repository at cwd has no such commit."""
    ref = (ref or "").strip()
    if not ref or ref.startswith("-"):
        raise ValueError(f"--baseline {ref!r}: not a commit name")
    try:
        found = _git(cwd, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"--baseline {ref!r}: git failed in {cwd}: {exc}") from exc
    full = found.stdout.strip()
    if found.returncode != 0 or not full:
        raise ValueError(f"--baseline {ref!r}: no such commit in {cwd}")
    short = _git(cwd, "rev-parse", "--short", full).stdout.strip() or full[:7]
    return full, short


@contextmanager
def ref_tree(sha: str, cwd: Path = ROOT, parent: Path | None = None):
    """A temporary copy of the commit's files (`git archive`, no .git of its own), removed
    afterwards whatever happens."""
    dest = Path(tempfile.mkdtemp(prefix=f"llmq-baseline-{sha[:7]}-", dir=parent))
    try:
        archive = dest / ".tree.tar"
        made = _git(cwd, "archive", "--format=tar", "-o", str(archive), sha)
        if made.returncode != 0:
            raise RuntimeError(f"git archive {sha} failed: {made.stderr.strip()}")
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
        archive.unlink()
        yield dest
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def _pins(requirements: str) -> dict[str, str]:
    """{normalised name: version} of the `name==version` lines (extras and comments dropped)."""
    pins = {}
    for line in requirements.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" not in line or line.startswith("-"):
            continue
        name, version = (x.strip() for x in line.split("==", 1))
        pins[name.split("[", 1)[0].lower().replace("_", "-")] = version.split(";", 1)[0].strip()
    return pins


def overlay_pins(requirements: str, installed) -> tuple[list[str], list[str]]:
    """What REF pins differently from this venv: (name==version to overlay for its stack,
    the differing pins left as they are (NOT_OVERLAID)). installed(name) -> version or None."""
    overlay, kept = [], []
    for name, version in sorted(_pins(requirements).items()):
        have = installed(name)
        if have is None or have.split("+", 1)[0] == version:
            continue
        (kept if name in NOT_OVERLAID else overlay).append(f"{name}=={version}")
    return overlay, kept


def _installed(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def requirements_overlay(tree: Path, progress=print) -> tuple[Path | None, list[str], list[str]]:
    """REF's own versions of the packages it pins differently (a tree written for another
    transformers can fail on this one), installed without dependencies into a cached folder
    that goes on its stack's PYTHONPATH only; this venv is left as it is. Returns (the folder
    or None, the pins overlaid, the differing pins not overlaid)."""
    req = tree / "requirements.txt"
    overlay, kept = overlay_pins(req.read_text() if req.exists() else "", _installed)
    if not overlay:
        return None, overlay, kept
    import hashlib

    folder = OVERLAY_CACHE / hashlib.sha1(" ".join(overlay).encode()).hexdigest()[:12]
    if not (folder / ".complete").exists():
        progress(f"baseline: installing {' '.join(overlay)} for the baseline's stack into {folder}")
        shutil.rmtree(folder, ignore_errors=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                            "--target", str(folder), *overlay],
                           capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"pip could not install {overlay}: {r.stderr.strip()[-800:]}")
        (folder / ".complete").write_text(" ".join(overlay) + "\n")
    return folder, overlay, kept


def check_own_imports(stack: Stack) -> str:
    """The stack's processes import the tree's own packages, not this checkout's nor the venv's
    editable install (which points at one tree); returns the transformers version they get."""
    code = ("import app, common, worker, transformers; "
            "print(app.__file__, common.__file__, worker.__file__); print(transformers.__version__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=stack.root, env=stack.base_env(),
                       capture_output=True, text=True, timeout=120)
    root = stack.root.resolve()
    paths = r.stdout.split()
    if r.returncode != 0 or len(paths) != 4 or not all(
            Path(p).resolve().is_relative_to(root) for p in paths[:3]):
        raise RuntimeError(f"the tree at {root} does not import its own packages: "
                           f"{r.stdout.strip()} {r.stderr.strip()[-500:]}")
    return paths[3]


@dataclass
class System:
    """One stack of the comparison and its summaries: {concurrency: [one per round]}."""
    name: str
    role: str            # "ours" (judged), "baseline", or "ours-default" (an extra row)
    dtype: str
    root: Path
    paths: tuple[Path, ...] = ()   # on its PYTHONPATH after the tree (REF's own requirements)
    transformers: str | None = None
    stack: Stack | None = None
    runs: dict[int, list[dict]] = field(default_factory=dict)
    error: str | None = None

    def model_restarts(self) -> int:
        """Model-process crashes its worker logged (each one a restart and a re-run of its
        batch: a baseline that crashes is slow for a reason that is not its design)."""
        if self.stack is None:
            return 0
        return sum(log.read_text(errors="replace").count("model worker died")
                   for log in self.stack.workdir.glob("worker*.log"))

    def as_dict(self) -> dict:
        return {"name": self.name, "role": self.role, "dtype": self.dtype, "error": self.error,
                "transformers": self.transformers, "model_restarts": self.model_restarts(),
                "levels": [level_median(c, runs) for c, runs in sorted(self.runs.items())]}


def _median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def _tps(run: dict):
    """tok/s counting what requests cut by the time limit had made (as the peers table)."""
    return run.get("tokens_per_s_all", run["tokens_per_s"])


def level_median(concurrency: int, runs: list[dict]) -> dict:
    """One system's level over the rounds: medians of tok/s and TTFT p50, every round's too."""
    return {"concurrency": concurrency,
            "tokens_per_s": _median([_tps(r) for r in runs]),
            "ttft_p50_s": _median([r["ttft_p50_s"] for r in runs]),
            "itl_p50_s": _median([r["itl_p50_s"] for r in runs]),
            "rounds_tokens_per_s": [_tps(r) for r in runs],
            "requests": sum(r["requests"] for r in runs),
            "failures": sum(r["failures"] for r in runs),
            "truncated": any(r.get("truncated") for r in runs)}


def compare(systems: list[dict]) -> list[dict]:
    """Per llmq row and level: tok/s and TTFT p50 over the baseline's at that level."""
    base = next((s for s in systems if s["role"] == "baseline"), {"levels": []})
    by_c = {lv["concurrency"]: lv for lv in base["levels"]}
    rows = []
    for s in systems:
        if s["role"] == "baseline":
            continue
        for lv in s["levels"]:
            b = by_c.get(lv["concurrency"], {})
            rows.append({"system": s["name"], "dtype": s["dtype"], "judged": s["role"] == "ours",
                         "concurrency": lv["concurrency"], "tokens_per_s": lv["tokens_per_s"],
                         "baseline_tokens_per_s": b.get("tokens_per_s"),
                         "ratio": report.ratio(lv["tokens_per_s"], b.get("tokens_per_s")),
                         "ttft_p50_s": lv["ttft_p50_s"],
                         "baseline_ttft_p50_s": b.get("ttft_p50_s"),
                         "ttft_ratio": report.ratio(lv["ttft_p50_s"], b.get("ttft_p50_s"))})
    return rows


def baseline_phase(ref: str, *, levels: list[int], tokens: int, requests_for, rounds: int,
                   level_time_limit: float, default_dtype: str, backend: str, device: str,
                   max_num_seqs: int, workdir: Path, progress=print) -> dict:
    """Starts every system's stack (all held up at once, idle but for the one measured), warms
    each, then runs the levels round by round. A stack that does not start is an error in the
    result, not an exception."""
    out = {"ref": ref, "levels": list(levels), "max_tokens": tokens, "rounds": rounds,
           "judged_dtype": JUDGED_DTYPE, "load_avg_start": list(os.getloadavg()), "systems": []}
    try:
        sha, short = resolve_ref(ref)
    except ValueError as exc:
        out["error"] = str(exc)
        progress(f"baseline: ERROR {exc}")
        return out
    out.update(sha=sha, short=short)
    try:
        with ref_tree(sha, parent=workdir) as tree:
            folder, out["overlaid"], out["not_overlaid"] = requirements_overlay(tree, progress)
            systems = [System(f"llmq {JUDGED_DTYPE}", "ours", JUDGED_DTYPE, ROOT),
                       System(f"baseline {short} {JUDGED_DTYPE}", "baseline", JUDGED_DTYPE, tree,
                              (folder,) if folder else ())]
            if default_dtype != JUDGED_DTYPE:
                systems.append(System(f"llmq {default_dtype}", "ours-default", default_dtype, ROOT))
            try:
                for s in systems:
                    _start(s, backend, device, max_num_seqs, workdir, progress)
                if not any(s.error for s in systems if s.role != "ours-default"):
                    _measure([s for s in systems if not s.error], levels, tokens, requests_for,
                             rounds, level_time_limit, progress)
            finally:
                for s in systems:
                    if s.stack is not None:
                        s.stack.stop()
    except Exception as exc:  # noqa: BLE001 - the tree could not be made: an error row
        out["error"] = f"{type(exc).__name__}: {exc}"
        progress(f"baseline: ERROR {out['error']}")
        return out
    out["systems"] = [s.as_dict() for s in systems]
    base = next(s for s in systems if s.role == "baseline")
    if base.error or systems[0].error:
        out["error"] = base.error or systems[0].error
    out["comparison"] = compare(out["systems"])
    out["load_avg_end"] = list(os.getloadavg())
    return out


def _start(s: System, backend: str, device: str, max_num_seqs: int, workdir: Path, progress):
    slug = s.name.replace(" ", "-")
    s.stack = Stack(workdir / slug, max_num_seqs=max_num_seqs, device=device, backend=backend,
                    dtype=s.dtype, root=s.root, extra_paths=s.paths)
    progress(f"baseline: starting {s.name} from {s.root} (logs in {s.stack.workdir})")
    try:
        s.transformers = check_own_imports(s.stack)
        s.stack.start("continuous")
        warm = [payload(p, 8) for p in short_prompts(8, 500)]
        closed_loop(s.stack.url, 8, warm, hard_limit_s=120)
    except Exception as exc:  # noqa: BLE001 - reported as this system's error row
        s.error = f"did not start: {type(exc).__name__}: {str(exc)[:1500]}"
        progress(f"baseline: ERROR {s.name} {s.error}")


def _measure(systems: list[System], levels, tokens, requests_for, rounds, limit_s, progress):
    offset = 1000   # prompts no warm-up used, the same for every system, new each round
    for r in range(rounds):
        order = systems if r % 2 == 0 else systems[::-1]
        for c in levels:
            prompts = short_prompts(requests_for(c), offset)
            offset += len(prompts)
            for s in order:
                try:
                    results, wall, cut = closed_loop(s.stack.url, c,
                                                     [payload(p, tokens) for p in prompts],
                                                     limit_s, 2 * limit_s)
                except Exception as exc:  # noqa: BLE001 - this system's error; the others run on
                    s.error = f"round {r + 1} c={c}: {type(exc).__name__}: {exc}"
                    continue
                summary = report.summarize(results, wall)
                summary.update(concurrency=c, round=r + 1, truncated=cut)
                s.runs.setdefault(c, []).append(summary)
                failed = f", {summary['failures']} FAILED" if summary["failures"] else ""
                progress(f"baseline: round {r + 1}/{rounds} c={c:>3} {s.name:<26} "
                         f"{summary['tokens_per_s']} tok/s, TTFT p50 {summary['ttft_p50_s']} s"
                         f"{failed}{' (cut by the time limit)' if cut else ''}")
