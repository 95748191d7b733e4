"""bench/baseline.py and its report rows: REF resolved and materialised from a real git
repository, each stack run from its own tree, medians over rounds, ratios against the
baseline, the issues' bars (with TTFT beside), a baseline that did not run as an error row,
and the batch phase's target."""
import subprocess
from pathlib import Path

import pytest

from bench.baseline import compare, level_median, overlay_pins, ref_tree, resolve_ref
from bench.report import baseline_targets, batch_targets, format_table
from bench.stack import ROOT, Stack


def _git(repo: Path, *argv: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *argv],
                          cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A repository with two commits: `old` has app/x.py = 1, the tip has 2 and a new file."""
    r = tmp_path / "repo"
    (r / "app").mkdir(parents=True)
    _git(r, "init", "-q")
    (r / "app" / "x.py").write_text("X = 1\n")
    _git(r, "add", ".")
    _git(r, "commit", "-qm", "old")
    _git(r, "tag", "old")
    (r / "app" / "x.py").write_text("X = 2\n")
    (r / "app" / "http_worker.py").write_text("")
    _git(r, "add", ".")
    _git(r, "commit", "-qm", "new")
    (r / "app" / "x.py").write_text("X = 3  # not committed\n")
    return r


def test_a_ref_resolves_to_its_full_and_short_sha(repo):
    full, short = resolve_ref("old", repo)
    assert full == _git(repo, "rev-parse", "old") and len(full) == 40
    assert full.startswith(short) and len(short) >= 7
    assert resolve_ref(short, repo)[0] == full
    assert resolve_ref("HEAD~1", repo)[0] == full


@pytest.mark.parametrize("ref", ["no-such-branch", "", "--output=/tmp/x", "deadbeef" * 5])
def test_an_unknown_or_option_like_ref_is_a_clear_error(repo, ref):
    with pytest.raises(ValueError, match="--baseline"):
        resolve_ref(ref, repo)


def test_the_tree_holds_the_commits_files_and_is_removed_afterwards(repo, tmp_path):
    full, _ = resolve_ref("old", repo)
    with ref_tree(full, repo, parent=tmp_path) as tree:
        assert (tree / "app" / "x.py").read_text() == "X = 1\n"   # not the working copy's
        assert not (tree / "app" / "http_worker.py").exists() and not (tree / ".git").exists()
    assert not tree.exists()
    with pytest.raises(RuntimeError, match="boom"):
        with ref_tree(full, repo, parent=tmp_path) as tree:
            raise RuntimeError("boom")
    assert not tree.exists()


def test_each_stack_runs_its_own_trees_code_before_this_checkouts(repo, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:/elsewhere")
    full, _ = resolve_ref("old", repo)
    with ref_tree(full, repo, parent=tmp_path) as tree:
        old = Stack(tmp_path / "old", root=tree, extra_paths=(tmp_path / "pins",))
        assert old.base_env()["PYTHONPATH"].split(":") == [str(tree), str(tmp_path / "pins"),
                                                           "/elsewhere"]
        assert old.http_worker_class() == "gthread"   # a tree before app/http_worker.py
    ours = Stack(tmp_path / "ours")
    assert ours.base_env()["PYTHONPATH"].split(":") == [str(ROOT), "/elsewhere"]
    assert ours.http_worker_class() == "app.http_worker.ThreadWorker"


def test_the_baseline_gets_its_own_pins_of_what_it_pins_differently_but_not_torch_or_numpy():
    req = ("# runtime\ntorch==2.13.0\ntransformers==5.24.0  # newer\nnumpy==2.4.6\n"
           "celery[redis]==5.7.0\nflask==3.1.3\nspectree==3.0.0\n-r other.txt\nrequests>=2\n")
    venv = {"torch": "2.12.0+cpu", "transformers": "5.19.0", "numpy": "2.3.5", "celery": "5.7.0",
            "flask": "3.1.3"}
    overlay, kept = overlay_pins(req, venv.get)
    assert overlay == ["transformers==5.24.0"]         # spectree: not installed here, not needed
    assert kept == ["numpy==2.4.6", "torch==2.13.0"]
    assert overlay_pins(req, {**venv, "transformers": "5.24.0", "numpy": "2.4.6",
                              "torch": "2.13.0+cpu"}.get) == ([], [])


def _run(tps, ttft):
    return {"tokens_per_s": tps, "ttft_p50_s": ttft, "itl_p50_s": 0.1, "requests": 8,
            "failures": 0}


def _systems(base_levels=((1, 10.0, 0.2), (64, 200.0, 2.0))):
    def sys_(name, role, dtype, levels):
        return {"name": name, "role": role, "dtype": dtype, "error": None, "levels": [
            level_median(c, [_run(tps * f, ttft) for f in (0.9, 1.0, 1.1)]) for c, tps, ttft in levels]}
    return [sys_("llmq float32", "ours", "float32", [(1, 9.8, 0.1), (64, 192.0, 1.0)]),
            sys_("baseline abc1234 float32", "baseline", "float32", base_levels),
            sys_("llmq bfloat16", "ours-default", "bfloat16", [(1, 12.0, 0.1), (64, 380.0, 1.0)])]


def test_a_level_is_the_median_of_its_rounds():
    lv = level_median(64, [_run(100.0, 1.0), _run(90.0, 3.0), _run(120.0, 2.0)])
    assert lv["tokens_per_s"] == 100.0 and lv["ttft_p50_s"] == 2.0
    assert lv["rounds_tokens_per_s"] == [100.0, 90.0, 120.0] and lv["requests"] == 24


def test_every_llmq_row_is_read_against_the_baseline_at_its_level():
    rows = {(r["system"], r["concurrency"]): r for r in compare(_systems())}
    assert set(rows) == {("llmq float32", 1), ("llmq float32", 64), ("llmq bfloat16", 1),
                         ("llmq bfloat16", 64)}
    assert rows[("llmq float32", 1)]["ratio"] == 0.98 and rows[("llmq float32", 1)]["judged"]
    assert rows[("llmq float32", 64)]["ratio"] == 0.96
    assert rows[("llmq float32", 64)]["ttft_ratio"] == 0.5
    assert rows[("llmq bfloat16", 64)]["ratio"] == 1.9 and not rows[("llmq bfloat16", 64)]["judged"]
    # A level the baseline lacks has no ratio.
    rows = compare(_systems(base_levels=[(1, 10.0, 0.2)]))
    assert next(r for r in rows if r["concurrency"] == 64)["ratio"] is None


def _baseline(**extra):
    systems = _systems()
    return {"ref": "main~3", "short": "abc1234", "levels": [1, 64], "max_tokens": 64,
            "rounds": 3, "judged_dtype": "float32", "load_avg_start": [1.0], "load_avg_end": [1.2],
            "systems": systems, "comparison": compare(systems), **extra}


def test_the_issues_bars_are_judged_on_the_float32_rows_with_ttft_beside():
    got = {t["name"]: t for t in baseline_targets(_baseline())}
    c1 = got["vs baseline abc1234 c=1: float32 tok/s ratio >= 0.97 (issue 13)"]
    assert c1["value"] == 0.98 and c1["met"] is True and c1["note"] == "TTFT p50 100 ms vs 200 ms"
    assert got["vs baseline abc1234 c=64: float32 tok/s ratio >= 0.97 (issue 13)"]["met"] is False
    assert got["vs baseline abc1234 c=64: float32 tok/s ratio >= 0.95 (issue 22)"]["met"] is True
    table = format_table({"baseline": _baseline(), "targets": baseline_targets(_baseline())})
    assert "Baseline: llmq against abc1234 (main~3)" in table
    assert "llmq bfloat16" in table and "1.900" in table          # the extra row, not judged
    assert "(TTFT p50 1000 ms vs 2000 ms)" in table
    b = _baseline()
    b["systems"][1]["model_restarts"] = 3
    assert "baseline abc1234 float32's model process crashed and restarted 3 times" in \
        format_table({"baseline": b, "targets": []})


def test_a_baseline_that_did_not_start_is_an_error_row_not_a_crash():
    systems = _systems()
    systems[1].update(levels=[], error="did not start: RuntimeError: worker exited with 1")
    for s in systems:
        s["levels"] = []
    b = _baseline(systems=systems, comparison=compare(systems), error=systems[1]["error"])
    rows = baseline_targets(b)
    assert len(rows) == 3 and all(r["value"] is None and r["met"] is None for r in rows)
    assert all("worker exited" in r["note"] for r in rows)
    table = format_table({"baseline": b, "targets": rows})
    assert "baseline abc1234 float32: error: did not start" in table
    # An unknown REF never got as far as systems.
    b = {"ref": "nope", "levels": [1, 64], "max_tokens": 64, "rounds": 2,
         "judged_dtype": "float32", "load_avg_start": [1.0], "systems": [],
         "error": "--baseline 'nope': no such commit"}
    assert "error: --baseline 'nope'" in format_table({"baseline": b, "targets": baseline_targets(b)})


def test_the_batch_target_is_the_during_over_idle_ttft_ratio():
    batch = {"lines": 200, "tokens_per_line": 16, "status": "completed", "completed": 200,
             "failed": 0, "seconds": 80.0, "lines_per_s": 2.5, "ttft_idle_p50": 0.3,
             "ttft_during_p50": 0.5, "probes_idle": 10, "probes_during": 30, "ttft_ratio": 1.67,
             "ms_per_step": 250.0, "excess_in_steps": 0.8}
    (t,) = batch_targets(batch)
    assert t["met"] is True and "2.5 lines/s" in t["note"]
    assert batch_targets({**batch, "ttft_ratio": 2.6})[0]["met"] is False
    table = format_table({"batch": batch, "targets": [t]})
    assert "Batch API: 200 lines x 16 tokens" in table and "idle 300 ms" in table
    assert "during the batch 500 ms" in table and "x1.67" in table
    assert "engine step 250 ms on average during the batch, the difference 0.80 steps" in table


def test_baseline_options():
    from bench.bench import parse_args

    assert parse_args([]).baseline is None
    assert parse_args(["--baseline", "bb17313"]).baseline_levels == [1, 64]
    assert parse_args(["--baseline", "x", "--concurrency", "1,8"]).baseline_levels == [1, 8]
    with pytest.raises(SystemExit):
        parse_args(["--only", "baseline"])
    assert parse_args(["--only", "batch"]).only == "batch"
