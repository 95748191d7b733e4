"""bench/peers.py and the OpenAI streaming client it drives every system with: a peer that is
absent is skipped, a peer that runs is started, measured and stopped (a stand-in OpenAI server
over real loopback HTTP), and the client reads OpenAI's stream as llmq, vLLM and llama-server
send it."""
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from bench import loadgen
from bench.loadgen import Inflight, stream_completion
from bench.peers import (ServerPeer, best_of_rounds, completion_payload, gguf_type,
                         llama_server_peer, peers_phase, refresh_fractions, run_system,
                         synthetic_prompts, vllm_peer)
from bench.peers_mixed import MIXED_RANGE
from .factories import FakeStream


class _Session:
    def __init__(self, chunks):
        self.chunks, self.sent = chunks, []

    def post(self, url, json=None, **kw):
        self.sent.append((url, json))
        return FakeStream(self.chunks)


def _chunk(body) -> bytes:
    return f"data: {json.dumps(body)}\r\n\r\n".encode()


def _text(t, finish=None):
    return _chunk({"choices": [{"index": 0, "text": t, "finish_reason": finish}]})


@pytest.fixture
def clock(monkeypatch):
    ticks = iter(range(1000))
    monkeypatch.setattr(loadgen.time, "perf_counter", lambda: float(next(ticks)))


def test_a_completion_stream_is_timed_per_text_chunk_and_counted_by_its_usage(clock):
    chunks = [_text("Hello") + _text(" wor"), _text("ld", finish="length"),
              _chunk({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 4}}),
              b"data: [DONE]\n\n"]
    session = _Session(chunks)
    r = stream_completion(session, "http://x", {"max_tokens": 4}, start=-1.0)
    assert session.sent[0][0] == "http://x/v1/completions"
    # Two events in one HTTP chunk arrive together; the usage counts 4 tokens in 3 chunks.
    assert r.ok and r.completion_tokens == 4 and r.prompt_tokens == 40
    assert r.ttft == 1.0 and r.gaps() == [0.0, 1.0]


def test_without_a_usage_chunk_the_text_chunks_are_the_tokens(clock):
    r = stream_completion(_Session([_text("a"), _text("b", finish="length"), b"data: [DONE]\n\n"]),
                          "http://x", {"max_tokens": 2})
    assert r.ok and r.completion_tokens == 2


def test_a_stream_that_ends_without_done_or_with_too_few_tokens_is_a_failure(clock):
    r = stream_completion(_Session([_text("a")]), "http://x", {"max_tokens": 2})
    assert not r.ok and "[DONE]" in r.describe_failure()
    r = stream_completion(_Session([_text("a", finish="stop"), b"data: [DONE]\n\n"]), "http://x",
                          {"max_tokens": 2})
    assert not r.ok and r.describe_failure() == "1 tokens, expected 2"


def test_past_the_deadline_the_client_closes_the_stream_and_counts_what_came(clock):
    inflight = Inflight()
    inflight.deadline = 0.5
    r = stream_completion(_Session([_text("a"), _text("b"), _text("c", finish="length")]),
                          "http://x", {"max_tokens": 3}, inflight=inflight)
    assert r.status == "cancelled" and r.completion_tokens == 1 and inflight.cancelled == 1


def test_each_server_gets_the_length_forced_in_its_own_terms():
    p = completion_payload("m", "hi", 64, {"ignore_eos": True, "min_tokens": 64})
    assert p["max_tokens"] == p["min_tokens"] == 64 and p["stream"] and p["temperature"] == 0
    assert p["stream_options"] == {"include_usage": True}


def test_synthetic_prompts_are_distinct_and_about_the_asked_length(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = synthetic_prompts(tok, 8, 40, offset=3)
    assert len(set(prompts)) == 8 and prompts == synthetic_prompts(tok, 8, 40, offset=3)
    assert all(38 <= len(tok.encode(p, add_special_tokens=False)) <= 42 for p in prompts)
    # Distinct from the first token: no prefix cache shares a block between two of them.
    assert len({tok.encode(p, add_special_tokens=False)[0] for p in prompts}) == 8


def test_the_gguf_files_quantisation_is_the_rows_dtype():
    assert gguf_type("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert gguf_type("/x/model.gguf") == "gguf"


def test_an_absent_peer_is_skipped_without_starting_anything(tmp_path):
    peer = llama_server_peer(tmp_path / "no-llama-server", "m.gguf", tmp_path, 64)
    entry = run_system(peer, [1], {0: [], 1: ["x"]}, 8, 10.0, None, progress=lambda m: None)
    assert "make peers" in entry["skipped"] and entry["levels"] == [] and "error" not in entry
    assert peer.proc is None
    # Asked when its turn comes: a `make peers` that finishes meanwhile is seen.
    (tmp_path / "no-llama-server").write_text("#!/bin/sh\n")
    (tmp_path / "no-llama-server").chmod(0o755)
    assert peer.skip is None


# A stand-in for a peer's OpenAI server: /health, /v1/models, streaming /v1/completions.
FAKE_SERVER = textwrap.dedent('''
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a): pass
        def _json(self, body):
            data = json.dumps(body).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(data)))
            self.end_headers(); self.wfile.write(data)
        def do_GET(self):
            self._json({"status": "ok"} if self.path == "/health"
                       else {"data": [{"id": "fake-model"}]})
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert req["model"] == "fake-model" and req["ignore_eos"], req
            self.send_response(200); self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close"); self.end_headers()
            n = req["max_tokens"]
            for i in range(n):
                choice = {"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\\n\\n".encode())
                self.wfile.flush()
            usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}}
            self.wfile.write(f"data: {json.dumps(usage)}\\n\\ndata: [DONE]\\n\\n".encode())
            self.wfile.flush()
            self.close_connection = True

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


def test_a_peer_is_started_measured_at_each_level_and_stopped(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    peer = ServerPeer("fake", lambda port: [sys.executable, str(script), str(port)], {},
                      "float32", {"ignore_eos": True}, tmp_path / "fake.log", ready_timeout_s=60)
    prompts = {0: ["w"] * 4, 1: ["a", "b"], 4: ["p"] * 8}
    eff = {"flops_per_token": 1e9, "rates_gflops": {"float32": {"1": 1000.0}}}
    entry = run_system(peer, [1, 4], prompts, 6, 60.0, eff, progress=lambda m: None)
    assert "error" not in entry, entry.get("error")
    assert [lv["concurrency"] for lv in entry["levels"]] == [1, 4]
    assert [(lv["ok"], lv["completion_tokens"]) for lv in entry["levels"]] == [(2, 12), (8, 48)]
    lv = entry["levels"][1]
    assert lv["compute_fraction"] == pytest.approx(lv["tokens_per_s_all"] / 1000.0, rel=1e-3)
    # Where the level's CPU went, per output token: the peer is one process.
    assert set(lv["cpu_ms_per_token"]) == {"server", "total"}
    assert lv["cpu_ms_per_token"]["total"] == lv["cpu_ms_per_token"]["server"] >= 0
    assert peer.proc is None   # stopped


def test_cpu_per_token_is_each_parts_growth_over_the_level_and_their_sum():
    from bench.peers import cpu_ms_per_token

    before = {"model": 10.0, "engine": 2.0, "api": 1.0}
    after = {"model": 11.0, "engine": 2.25, "api": 1.5, "redis": 0.05}   # redis: new
    assert cpu_ms_per_token(before, after, 100) == {
        "model": 10.0, "engine": 2.5, "api": 5.0, "redis": 0.5, "total": 18.0}


def test_llama_server_gets_the_llama_cpp_backends_thread_count(tmp_path, monkeypatch):
    """Pinned (LLMQ_TORCH_THREADS, as a shared host wants) both sides use the same count."""
    def threads():
        argv = llama_server_peer(tmp_path / "s", "m.gguf", tmp_path, 4).argv(1)
        return argv[argv.index("-t") + 1], argv[argv.index("-tb") + 1]

    monkeypatch.setenv("LLMQ_TORCH_THREADS", "1")
    assert threads() == ("1", "1")
    monkeypatch.delenv("LLMQ_TORCH_THREADS")
    assert threads() == (str(os.cpu_count()),) * 2


def test_vllm_takes_the_mixed_loads_longest_prompt_and_its_output(tmp_path):
    """At a 2,048-token context vLLM refused the mixed load's four longest prompts, and its
    row then skipped their prefill: every peer serves the same load."""
    argv = vllm_peer("model", tmp_path, 16, 64).argv(1)
    assert int(argv[argv.index("--max-model-len") + 1]) >= MIXED_RANGE[1] + 64


def test_the_systems_are_llmq_then_the_peers_then_llmqs_other_backends(tmp_path):
    from argparse import Namespace

    from bench.peers import build_systems

    args = Namespace(max_num_seqs=64, device="cpu", api_app="app.wsgi:application",
                     peers_tokens=64, backend="transformers", peers=["vllm", "llama-server"],
                     llama_server=str(tmp_path / "absent"),
                     llmq_backends=["llama_cpp", "transformers"])
    systems = build_systems(args, tmp_path, "/m", "/x/m.Q4_1.gguf", "float32")
    assert [s.name for s in systems] == ["llmq[transformers]", "vLLM", "llama-server",
                                         "llmq[llama_cpp]"]
    assert [s.dtype for s in systems] == ["float32", "float32", "Q4_1", "Q4_1"]
    assert systems[3].stack.backend == "llama_cpp" and systems[3].stack.max_num_seqs == 64
    assert "make peers" in systems[2].skip
    assert systems[0].force == {"ignore_eos": True, "min_tokens": 64}
    assert systems[2].force == {"ignore_eos": True}   # llama-server has no min_tokens


def test_a_bfloat16_default_backend_gets_a_float32_twin_row_beside_it(tmp_path):
    """Issue 17's bf16 bar (at least 1.6x float32 at c=64) is judged in the same run: where the
    default backend serves in bfloat16, its float32 twin follows it, on a stack of its own."""
    from bench.bench import parse_args
    from bench.peers import build_systems

    args = parse_args(["--peers", "", "--llmq-backends", "llama_cpp"])
    systems = build_systems(args, tmp_path, "/m", "/x/m.Q4_1.gguf", "bfloat16")
    assert [(s.name, s.dtype) for s in systems] == [
        ("llmq[transformers]", "bfloat16"), ("llmq[transformers] float32", "float32"),
        ("llmq[llama_cpp]", "Q4_1")]
    assert [s.stack.dtype for s in systems[:2]] == ["bfloat16", "float32"]
    assert systems[0].stack.workdir != systems[1].stack.workdir
    # A float32 host has no twin, nor does a run that leaves it out.
    assert len(build_systems(args, tmp_path, "/m", "/x/m.Q4_1.gguf", "float32")) == 2
    args = parse_args(["--peers", "", "--llmq-backends", "", "--skip-float32-row"])
    assert [s.name for s in build_systems(args, tmp_path, "/m", "/x/m.Q4_1.gguf",
                                          "bfloat16")] == ["llmq[transformers]"]


def test_the_table_has_the_llama_cpp_backend_by_default_skipped_where_it_is_absent(
        tmp_path, monkeypatch):
    """Issue 17's bar for llmq[llama_cpp] is judged by the plain `make bench` run: the row is
    there by default, and a machine without llama-cpp-python reports it skipped."""
    import importlib.util

    from bench.bench import parse_args
    from bench.peers import build_systems

    assert parse_args([]).llmq_backends == ["llama_cpp"]
    assert parse_args(["--llmq-backends", ""]).llmq_backends == []
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    args = parse_args(["--peers", ""])
    row = build_systems(args, tmp_path, "/m", "/x/m.Q4_1.gguf", args.dtype)[-1]
    assert row.name == "llmq[llama_cpp]" and "make llama-cpp" in row.skip


def test_only_one_phase_runs_the_peers_table_only_when_it_is_that_phase():
    from bench.bench import parse_args

    assert parse_args(["--only", "peers"]).run_peers
    assert not parse_args(["--only", "quality"]).run_peers   # the guard alone, in ~20 s
    assert parse_args([]).run_peers and not parse_args(["--skip-peers"]).run_peers


def test_vllm_serves_float32_on_cpu_under_auto_as_the_benchs_own_backend_too():
    """--backend vllm with the default --dtype auto: the served phase and its peers row run
    vLLM in float32 on CPU (bfloat16 there answers gibberish), whatever this CPU computes."""
    from bench.bench import parse_args, served_dtype
    from bench.peers import build_systems

    args = parse_args(["--backend", "vllm", "--peers", "", "--llmq-backends", "transformers"])
    assert served_dtype(args) == "float32"
    vllm_row = build_systems(args, Path("/tmp"), "/m", "/x/m.Q4_1.gguf", args.dtype)[0]
    assert vllm_row.dtype == "float32" and vllm_row.stack.dtype == "float32"


def _level(c, tps, **kw):
    return {"concurrency": c, "tokens_per_s_all": tps, "ttft_p50_s": 1.0 / tps, **kw}


def test_each_level_of_a_system_is_its_best_round_whole_with_every_rounds_rate():
    rounds = [{"name": "s", "role": "peer", "dtype": "Q4_1",
               "levels": [_level(1, 60.0), _level(16, 90.0)]},
              {"name": "s", "role": "peer", "dtype": "Q4_1",
               "levels": [_level(1, 55.0), _level(16, 99.0)]}]
    row = best_of_rounds(rounds)
    assert [(lv["concurrency"], lv["tokens_per_s_all"]) for lv in row["levels"]] == [(1, 60.0),
                                                                                     (16, 99.0)]
    # The best round's latencies come with its rate, not another round's.
    assert row["levels"][1]["ttft_p50_s"] == 1.0 / 99.0
    assert row["levels"][1]["rounds_tokens_per_s"] == [90.0, 99.0]
    assert "error" not in row


def test_a_round_that_failed_leaves_the_others_and_says_so():
    ok = {"name": "s", "role": "llmq", "dtype": "float32", "levels": [_level(1, 20.0)]}
    failed = {"name": "s", "role": "llmq", "dtype": "float32", "levels": [], "error": "boom"}
    row = best_of_rounds([failed, ok])
    assert row["levels"][0]["tokens_per_s_all"] == 20.0 and "error" not in row
    assert row["round_errors"] == ["boom"]
    assert best_of_rounds([failed, dict(failed)])["error"] == "boom"


class _Turns:
    """A system that records when its turn came and answers each round a rate of its own."""

    role = "peer"
    skip = None
    force: dict = {}

    def __init__(self, name, rates, log):
        self.name, self.dtype, self.rates, self.log = name, "float32", list(rates), log


def test_rounds_take_the_systems_in_turn_and_keep_each_ones_best(monkeypatch):
    log: list[str] = []

    def fake_run(system, levels, *_args):
        log.append(system.name)
        return {"name": system.name, "role": system.role, "dtype": system.dtype,
                "levels": [_level(c, system.rates.pop(0)) for c in levels]}

    monkeypatch.setattr("bench.peers.run_system", fake_run)
    tok = type("T", (), {"encode": lambda self, s, **k: [1, 2, 3], "decode": lambda self, i: "x"})()
    a, b = _Turns("llmq[x]", [10.0, 30.0], log), _Turns("peer", [25.0, 20.0], log)
    a.role = "llmq"
    out = peers_phase([a, b], tok, [16], [4], 8, 10.0, rounds=2, progress=lambda m: None,
                      order="sequential")
    assert log == ["llmq[x]", "peer", "llmq[x]", "peer"]
    ours, theirs = out["systems"]
    assert ours["levels"][0]["tokens_per_s_all"] == 30.0
    assert theirs["levels"][0]["tokens_per_s_all"] == 25.0
    assert ours["levels"][0]["over_best_peer"] == pytest.approx(30.0 / 25.0, rel=1e-3)
    assert out["rounds"] == 2 and out["order"] == "sequential"


def test_fractions_are_recomputed_against_merged_rates():
    peers = {"systems": [{"name": "s", "dtype": "float32",
                          "levels": [_level(64, 100.0, compute_fraction=0.9)]}]}
    refresh_fractions(peers, {"flops_per_token": 1e9, "rates_gflops": {"float32": {"64": 400.0}}})
    assert peers["systems"][0]["levels"][0]["compute_fraction"] == pytest.approx(0.25)


def _fake_peer(tmp_path, name):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    return ServerPeer(name, lambda port: [sys.executable, str(script), str(port)], {},
                      "float32", {"ignore_eos": True}, tmp_path / f"{name}.log",
                      ready_timeout_s=60)


def test_interleaved_systems_stay_up_and_take_turns_at_each_level(tmp_path):
    """Both servers are up through the whole table (one start each), at each level of each
    round one runs right after the other, in the reverse order the next round, and each
    measured level records what the one kept idle used meanwhile."""
    a, b = _fake_peer(tmp_path, "A"), _fake_peer(tmp_path, "B")
    starts, stops = [], []
    for peer in (a, b):
        start, stop = peer.start, peer.stop
        peer.start = lambda start=start, p=peer: starts.append(p.name) or start()
        peer.stop = lambda stop=stop, p=peer: (stops.append(p.name), stop())
    msgs: list[str] = []
    tok = type("T", (), {"encode": lambda self, s, **k: [1, 2, 3], "decode": lambda self, i: "x"})()
    out = peers_phase([a, b], tok, [1, 2], [2, 4], 4, 60.0, rounds=2, progress=msgs.append)
    turns = [m.split()[1] + " " + m.split()[2].rstrip(":") for m in msgs
             if " tok/s" in m]
    assert turns == ["A c=1", "B c=1", "A c=2", "B c=2",     # round 1
                     "B c=1", "A c=1", "B c=2", "A c=2"]     # round 2, the other way round
    assert starts == ["A", "B"] and sorted(stops) == ["A", "B"]   # once each, at the end
    assert a.proc is None and b.proc is None
    assert out["order"] == "interleaved"
    for row in out["systems"]:
        assert "error" not in row, row.get("error")
        for lv in row["levels"]:
            assert len(lv["rounds_tokens_per_s"]) == 2 and all(lv["rounds_tokens_per_s"])
            assert lv["bystanders_cpu_pct"] >= 0
            assert lv["settle_s"] is not None   # the idle fake server is quiet at once
            assert lv["ok"] == {1: 2, 2: 4}[lv["concurrency"]]


def test_interleaved_a_system_that_fails_leaves_the_table_and_the_others_go_on(monkeypatch):
    """A failure at one level stops that system and drops it from later turns; the rows of
    the rest are whole, and the failed round says why."""
    log, stopped = [], []

    class Up(_Turns):
        def start(self):
            return f"http://{self.name}"

        def stop(self):
            stopped.append(self.name)

        def cpu_seconds(self):
            return {"server": 0.0}

    def fake_measure(system, model, c, *args, **kw):
        log.append((system.name, c, tuple(s.name for s in kw["bystanders"])))
        if system.name == "bad" and c == 16:
            raise RuntimeError("engine died")
        return _level(c, system.rates.pop(0))

    monkeypatch.setattr("bench.peers.measure_level", fake_measure)
    monkeypatch.setattr("bench.peers.served_model", lambda url: "m")
    monkeypatch.setattr("bench.peers.closed_loop", lambda *a, **k: ([], 0.0, False))
    tok = type("T", (), {"encode": lambda self, s, **k: [1], "decode": lambda self, i: "x"})()
    good, bad = Up("good", [1.0, 2.0, 3.0, 4.0], log), Up("bad", [5.0], log)
    out = peers_phase([good, bad], tok, [1, 16], [1, 1], 8, 10.0, rounds=2,
                      progress=lambda m: None)
    assert log == [("good", 1, ("bad",)), ("bad", 1, ("good",)), ("good", 16, ("bad",)),
                   ("bad", 16, ("good",)), ("good", 1, ()), ("good", 16, ())]
    assert stopped == ["bad", "good"]   # the failed one at once, the other at the end
    good_row, bad_row = out["systems"]
    assert [lv["rounds_tokens_per_s"] for lv in good_row["levels"]] == [[1.0, 3.0], [2.0, 4.0]]
    assert [lv["rounds_tokens_per_s"] for lv in bad_row["levels"]] == [[5.0, None]]
    assert bad_row["round_errors"] == ["RuntimeError: engine died"]


def test_a_system_that_cannot_start_is_an_error_row_and_the_table_goes_on(tmp_path):
    class Broken(_Turns):
        def start(self):
            raise RuntimeError("no port")

        def stop(self):
            self.stopped = True

    broken = Broken("broken", [], [])
    ok = _fake_peer(tmp_path, "ok")
    tok = type("T", (), {"encode": lambda self, s, **k: [1], "decode": lambda self, i: "x"})()
    out = peers_phase([broken, ok], tok, [1], [2], 4, 60.0, rounds=2, progress=lambda m: None)
    assert out["systems"][0]["error"] == "RuntimeError: no port" and broken.stopped
    assert out["systems"][1]["levels"][0]["ok"] == 2 and ok.proc is None


def test_best_of_rounds_keeps_each_rounds_rate_in_its_place():
    """Round r of one system pairs with round r of another: a round without the level is a
    gap, not a shift."""
    rounds = [{"name": "s", "role": "peer", "dtype": "Q4_1", "levels": [], "error": "x"},
              {"name": "s", "role": "peer", "dtype": "Q4_1", "levels": [_level(1, 7.0)]}]
    assert best_of_rounds(rounds)["levels"][0]["rounds_tokens_per_s"] == [None, 7.0]


def test_the_targets_show_each_rounds_pair_beside_the_best_of_rounds_verdict():
    from bench.report import peer_targets

    def row(name, role, rates):
        return {"name": name, "role": role, "dtype": "float32",
                "levels": [_level(c, max(rs), rounds_tokens_per_s=rs) for c, rs in rates.items()]}

    peers = {"levels": [16, 64], "systems": [
        row("llmq[transformers]", "llmq", {16: [100.0, 90.0], 64: [200.0, 150.0]}),
        row("vLLM", "peer", {16: [80.0, 95.0], 64: [120.0, 100.0]}),
        row("llama-server", "peer", {16: [110.0, 85.0], 64: [100.0, 100.0]}),
        row("llmq[llama_cpp]", "llmq", {16: [99.0, 80.0], 64: [90.0, 110.0]})]}
    targets = {t["name"]: t for t in peer_targets(peers, "transformers")}
    at16 = targets["peers: llmq[transformers] >= best peer @16"]
    assert at16["value"] == pytest.approx(100.0 / 110.0, abs=1e-3) and not at16["met"]
    assert at16["rounds"] == [pytest.approx(100 / 110, abs=1e-3), pytest.approx(90 / 85, abs=1e-3)]
    assert at16["note"].startswith("best peer llama-server; round by round 0.91 1.06")
    same = targets["peers: llmq[llama_cpp] >= 0.95 x llama-server @64"]
    assert same["value"] == 1.1 and same["rounds"] == [0.9, 1.1]


def test_interleaved_is_the_cpu_default_and_a_gpu_host_runs_one_system_at_a_time():
    from bench.bench import parse_args

    assert parse_args([]).peers_order == "interleaved" and parse_args([]).peers_rounds == 2
    assert parse_args(["--device", "cuda"]).peers_order == "sequential"
    assert parse_args(["--device", "cuda", "--peers-order", "interleaved"]).peers_order == \
        "interleaved"


class _Cpu:
    """A bystander whose CPU seconds grow by `steps`, one per reading, then stay."""

    def __init__(self, steps):
        self.total, self.steps = 0.0, list(steps)

    def cpu_seconds(self):
        self.total += self.steps.pop(0) if self.steps else 0.0
        return {"server": self.total}


def test_a_level_starts_once_the_systems_kept_up_are_quiet():
    from bench.peers import settle

    # Busy for three windows (a whole core: 0.01 s per 0.01 s window), then idle.
    loud = _Cpu([0.0, 0.01, 0.01, 0.01])
    assert settle((loud,), window_s=0.01, max_s=5.0) is not None
    assert loud.steps == []            # it waited through the busy windows
    assert settle(()) == 0.0
    # Never quiet: gives up after max_s and says so.
    assert settle((_Cpu([0.01] * 1000),), window_s=0.01, max_s=0.05) is None


def test_the_model_alone_waits_for_the_whole_machine_to_go_quiet(monkeypatch):
    import bench.peers as peers_mod

    # The first reading starts the window; then two loud windows and a quiet one.
    readings = [0.0, 80.0, 40.0, 3.0]
    monkeypatch.setattr(peers_mod.psutil, "cpu_percent", lambda interval: readings.pop(0))
    waited, pct = peers_mod.settle_machine(window_s=0.01, max_s=5.0)
    assert waited is not None and pct == 3.0 and readings == []
    # Never quiet: gives up after max_s with the last window's reading.
    monkeypatch.setattr(peers_mod.psutil, "cpu_percent", lambda interval: 90.0)
    assert peers_mod.settle_machine(window_s=0.01, max_s=0.05) == (None, 90.0)


class _Up(_Turns):
    """A system that is up at once and spends no CPU."""

    def start(self):
        return "http://x"

    def stop(self):
        pass

    def cpu_seconds(self):
        return {"server": 0.0}


def _measured_by(monkeypatch, fake_measure):
    """peers_phase with fake_measure for each level; returns a tokenizer of words."""
    monkeypatch.setattr("bench.peers.measure_level", fake_measure)
    monkeypatch.setattr("bench.peers.served_model", lambda url: "m")
    monkeypatch.setattr("bench.peers.closed_loop", lambda *a, **k: ([], 0.0, False))
    return type("T", (), {"encode": lambda self, s, **k: s.split(),
                          "decode": lambda self, ids: " ".join(ids)})()


def test_every_round_brings_new_prompts_the_same_for_every_system(monkeypatch):
    """Kept up between rounds, a system would see a round's prompts again and its cache
    (llama-server's slots, vLLM's and llmq's prefix caches) would skip their prefill."""
    seen: dict[tuple, tuple] = {}

    def fake_measure(system, model, c, prompts, *args, **kw):
        r = sum(1 for k in seen if k[0] == system.name and k[1] == c)
        seen[(system.name, c, r)] = tuple(prompts)
        return _level(c, 1.0)

    tok = _measured_by(monkeypatch, fake_measure)
    peers_phase([_Up("a", [], []), _Up("b", [], [])], tok, [1, 4], [2, 3], 8, 10.0, rounds=2,
                progress=lambda m: None)
    for c, n in ((1, 2), (4, 3)):
        assert seen[("a", c, 0)] == seen[("b", c, 0)] and seen[("a", c, 1)] == seen[("b", c, 1)]
        assert len(seen[("a", c, 0)]) == n
        assert not set(seen[("a", c, 0)]) & set(seen[("a", c, 1)])
    everything = [p for k, ps in seen.items() if k[0] == "a" for p in ps]
    assert len(set(everything)) == len(everything)   # no prompt twice, level or round


def test_an_interrupt_while_starting_stops_the_systems_already_up(monkeypatch):
    """vLLM takes minutes to start: a Ctrl-C then must not leave the ones up running."""
    stopped = []

    class Up(_Turns):
        def start(self):
            if self.name == "slow":
                raise KeyboardInterrupt
            return "http://x"

        def stop(self):
            stopped.append(self.name)

        def cpu_seconds(self):
            return {"server": 0.0}

    monkeypatch.setattr("bench.peers.served_model", lambda url: "m")
    monkeypatch.setattr("bench.peers.closed_loop", lambda *a, **k: ([], 0.0, False))
    tok = type("T", (), {"encode": lambda self, s, **k: [1], "decode": lambda self, i: "x"})()
    with pytest.raises(KeyboardInterrupt):
        peers_phase([Up("up", [], []), Up("slow", [], [])], tok, [1], [1], 8, 10.0,
                    progress=lambda m: None)
    assert stopped == ["up", "slow"]   # and the one interrupted while it started


def test_model_alone_steps_the_model_worker_through_the_load_and_frees_it(
        tiny_model_dir, monkeypatch):
    """bench/raw.model_alone: every prompt prefilled in one step, then new_tokens - 1 decode
    steps of all the rows, then freed, each round; its figures are that load's."""
    from bench.raw import model_alone
    from worker.model.transformers.backend import TransformersBackend

    steps = []
    real_step = TransformersBackend.step

    def spy(self, req, early=None):
        steps.append(([len(s.token_ids) for s in req.prefill], len(req.decode_seq_ids),
                      len(req.free_seq_ids), [s.token_ids[0] for s in req.prefill]))
        res = real_step(self, req, early)
        if req.free_seq_ids:
            assert self.cache.num_rows == 0   # the round's rows left the KV cache
        return res

    monkeypatch.setattr(TransformersBackend, "step", spy)
    rounds = [[[5 + i + 10 * r, 6, 7, 8, 9, 10] for i in range(3)] for r in range(2)]
    got = model_alone(rounds, 4, "float32", tiny_model_dir, progress=lambda m: None)
    one_round = [([6, 6, 6], 0, 0)] + [([], 3, 0)] * 3 + [([], 0, 3)]
    assert [x[:3] for x in steps[-2 * len(one_round):]] == one_round * 2
    # each round steps its own prompts
    assert [x[3] for x in steps[-2 * len(one_round)::len(one_round)]] == [
        [p[0] for p in r] for r in rounds]
    assert (got["rows"], got["new_tokens"], got["prompt_tokens"], got["rounds"]) == (3, 4, 6.0, 2)
    assert got["dtype"] == "float32"
    assert got["tokens_per_s"] == pytest.approx(3 * 4 / got["elapsed_s"], rel=0.01)
    assert got["decode_tokens_per_s"] == pytest.approx(3 / got["decode_step_p50_s"], rel=0.01)
    assert 0 < got["prefill_s"] < got["elapsed_s"]


def test_the_model_alone_rows_split_a_missed_limit_between_model_and_stack(default_model_dir):
    """bench/peers.add_model_alone: one ceiling per llmq[transformers] row at the top level, on
    prompts of the table's length, read against the same limit as the served row; a failure
    is an error entry, not the bench's end; the report and the limit bar show it."""
    from transformers import AutoTokenizer

    from bench.peers import add_model_alone
    from bench.report import format_table, peer_targets

    full = dict(ttft_p99_s=2.0, itl_p50_s=0.05, failures=0)   # what the table prints
    systems = [{"name": "llmq[transformers]", "role": "llmq", "dtype": "bfloat16",
                "levels": [_level(16, 300.0, **full), _level(64, 500.0, **full)]},
               {"name": "llmq[transformers] float32", "role": "llmq", "dtype": "float32",
                "levels": [_level(64, 250.0, **full)]},
               {"name": "vLLM", "role": "peer", "dtype": "float32",
                "levels": [_level(64, 200.0, **full)]},
               {"name": "llmq[llama_cpp]", "role": "llmq", "dtype": "Q4_1",
                "levels": [_level(64, 150.0, **full)]}]
    peers = {"levels": [16, 64], "requests": [32, 128], "max_tokens": 64, "prompt_tokens": 40,
             "load_avg_start": [0.1], "load_avg_end": [0.2], "systems": systems}
    eff = {"flops_per_token": 1e9, "rates_gflops": {"float32": {"64": 500.0},
                                                   "bfloat16": {"64": 2000.0}}}
    calls = []

    def run(rounds, new_tokens, dtype, model, progress):
        assert len(rounds) == 2 and rounds[0] != rounds[1]   # no prompt seen twice
        ids = rounds[0]
        calls.append((len(ids), {len(x) for x in ids}, new_tokens, dtype, model))
        if dtype == "float32":
            raise RuntimeError("out of memory")
        return {"rows": len(ids), "new_tokens": new_tokens, "prompt_tokens": 40.0,
                "prefill_s": 0.5, "elapsed_s": 4.096, "decode_step_p50_s": 0.05,
                "tokens_per_s": 1000.0, "decode_tokens_per_s": 1280.0, "dtype": dtype,
                "rounds": 2}

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    waits = []
    add_model_alone(peers, eff, tok, "the-model", progress=lambda m: None, run=run,
                    settle_first=lambda: waits.append(1) or (0.5, 3.0))
    assert len(waits) == 2            # the machine let settle before each row
    assert [c[0] for c in calls] == [64, 64] and [c[3] for c in calls] == ["bfloat16", "float32"]
    assert all(max(c[1]) <= 40 and min(c[1]) >= 38 and c[2] == 64 and c[4] == "the-model"
               for c in calls)
    bf16, fp32 = peers["model_alone"]
    assert bf16["compute_fraction"] == pytest.approx(0.5)          # 1000 x 1 GFLOP / 2000
    assert bf16["decode_compute_fraction"] == pytest.approx(0.64)
    assert bf16["served_over_alone"] == pytest.approx(0.5)         # 500 served / 1000 alone
    assert fp32 == {"system": "llmq[transformers] float32", "concurrency": 64,
                    "error": "RuntimeError: out of memory"}
    assert bf16["machine_cpu_pct"] == 3.0
    table = format_table({"peers": peers, "targets": []})
    assert ("llmq[transformers] c=64, its model worker alone in this process" in table
            and "1000.0 tok/s = 50% of the limit" in table and "served: 0.50 of it" in table)
    assert "model alone (llmq[transformers] float32, c=64): RuntimeError: out of memory" in table
    for lv in systems[0]["levels"]:
        lv["compute_fraction"] = lv["tokens_per_s_all"] / 2000
    bar = next(t for t in peer_targets(peers, "transformers") if "compute limit" in t["name"])
    assert bar["met"] is False and "alone in this process on the same load: 0.500" in bar["note"]


def test_the_mixed_loads_lengths_span_the_range_with_the_asked_mean():
    from bench.peers_mixed import mixed_prompt_lengths

    lengths = mixed_prompt_lengths(48, 16, 3000, 600)
    assert len(lengths) == 48 and min(lengths) == 16 and max(lengths) == 3000
    assert sum(lengths) / 48 == pytest.approx(600, rel=0.01)
    assert sorted(lengths) != lengths                       # shuffled, many short, few long
    assert sorted(lengths)[24] < 600 < sorted(lengths)[40]
    assert mixed_prompt_lengths(48, 16, 3000, 600) == lengths   # the same every run
    assert sum(mixed_prompt_lengths(10, 16, 3000, 1200)) / 10 == pytest.approx(1200, rel=0.02)
    with pytest.raises(ValueError):
        mixed_prompt_lengths(8, 16, 3000, 4000)


def test_the_mixed_load_is_one_more_row_per_system_at_16_streams(monkeypatch):
    seen: dict[tuple, tuple] = {}

    def fake_measure(system, model, c, prompts, *args, **kw):
        seen[(system.name, c)] = tuple(prompts)
        return _level(16, 2.0, load="mixed") if c == "mixed" else _level(c, 1.0)

    tok = _measured_by(monkeypatch, fake_measure)
    out = peers_phase([_Up("a", [], []), _Up("b", [], [])], tok, [1, 16], [2, 3], 8, 10.0,
                      rounds=2, progress=lambda m: None, mixed=6)
    assert out["mixed"]["streams"] == 16 and out["mixed"]["prompts"] == 6
    assert seen[("a", "mixed")] == seen[("b", "mixed")] and len(seen[("a", "mixed")]) == 6
    assert sorted(len(p.split()) for p in seen[("a", "mixed")])[-1] == 3000
    for sys_ in out["systems"]:   # the mixed row beside the uniform c=16 one, not instead
        assert [(lv["concurrency"], lv.get("load")) for lv in sys_["levels"]] == [
            (1, None), (16, None), (16, "mixed")]
