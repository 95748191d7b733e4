"""The bench's first table: llmq and its peers under the same load, in the same run (issue 17).

Each system is started here on a free loopback port. By default (--peers-order interleaved) all
are started once and kept up, and at each level they take turns back to back; on a GPU host,
where two engines would contend for its memory, one is up at a time (sequential):
  llmq[<backend>]  the bench's Stack (redis-server, one worker, the API) for --backend and each
                   name in --llmq-backends (generic over the backend name)
  vLLM             vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on
                   the converted SmolLM2 folder, float32, when vllm is importable
  llama-server     llama.cpp's server (`make peers` builds it) on the GGUF the llama_cpp backend
                   loads, one slot per sequence (continuous batching)
A peer that is absent is reported as skipped, never as an error. The load is the same for all,
from the same client: streaming POST /v1/completions, 40-token synthetic prompts (distinct from
their first token, so no prefix cache helps), exactly `tokens` output tokens (ignore_eos, and
min_tokens where the server takes it), closed loop at each concurrency; then, with `mixed`,
the mixed load (bench/peers_mixed.py: 16 streams over prompts of 16-3,000 tokens) as one more
row per system.
"""
from __future__ import annotations

import importlib.util
import os
import random
import sys
import time
from pathlib import Path

import psutil
import requests

from .efficiency import fraction_for
from .loadgen import closed_loop, stream_completion
from .peers_mixed import (MIXED, MIXED_STREAMS, MIXED_TIME_LIMIT_S, mixed_prompt_lengths,
                          mixed_prompts)
from .report import FLOAT32_LABEL, best_peer_ratios, level_key, summarize
from .stack import HOST, Proc, Stack, free_port, wait_until
from common.settings import Settings
from worker.model_manager import resolve_dtype

PEER_NAMES = ("vllm", "llama-server")
LLAMA_SERVER = Path.home() / ".cache" / "llmq" / "peers" / "bin" / "llama-server"
PROMPT_TOKENS = 40
# llama-server's context per slot: a 40-token prompt and 64 tokens fit with room (-c is
# slots x this; the KV buffer is allocated whole at start).
LLAMA_SERVER_CONTEXT_PER_SLOT = 512
LLAMA_SERVER_MIN_CONTEXT = 8192   # the mixed load's longest prompt and its output, with room
VLLM_KVCACHE_GIB = 1   # 64 x ~100 tokens need ~0.3 GiB in fp32; the machine is shared
# vLLM's context: the mixed load's longest prompt (3,000 tokens) and its output fit, so that it
# serves every prompt the others serve; a refused prompt's prefill, the costliest work of the
# load, would be missing from its row.
VLLM_MAX_MODEL_LEN = 4096
FORCE_LENGTH = {"ignore_eos": True}   # every server takes it; min_tokens is added where taken
WORDS = ("river stone light garden window music paper winter market silver story forest "
         "engine candle harbor letter mountain yellow bridge signal coffee planet thunder "
         "lantern velvet meadow compass orchard castle whisper ribbon falcon glacier").split()


def synthetic_prompts(tokenizer, n: int, num_tokens: int = PROMPT_TOKENS, offset: int = 0,
                      seed: int = 17) -> list[str]:
    """n distinct prompts of about num_tokens tokens each: a number, then random words, cut to
    num_tokens tokens (decoded text re-encodes to within a token or so of it)."""
    rng = random.Random(seed + offset)
    out = []
    for i in range(offset, offset + n):
        words = [str(i)] + [rng.choice(WORDS) for _ in range(num_tokens)]
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:num_tokens]
        out.append(tokenizer.decode(ids))
    return out


def completion_payload(model: str, prompt: str, tokens: int, force: dict) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **force}


def served_model(url: str) -> str:
    """The model id the server lists first (GET /v1/models: llmq, vLLM and llama-server)."""
    r = requests.get(f"{url}/v1/models", timeout=10)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


class LlmqSystem:
    """llmq on one backend: the bench's own stack, started for this table alone."""

    role = "llmq"

    def __init__(self, backend: str, workdir: Path, tokens: int, row_dtype: str | None = None,
                 label: str = "", **stack_kwargs):
        # label: tells a second row of the same backend apart (its float32 twin)
        self.name = f"llmq[{backend}]" + (f" {label}" if label else "")
        self.backend = backend
        self.dtype = row_dtype or stack_kwargs.get("dtype", "float32")   # what the row served in
        # (the optional backends' packages share their names: make llama-cpp, make vllm)
        optional = backend in ("llama_cpp", "vllm")
        self.skip = (f"{backend} is not installed (make {backend.replace('_', '-')})"
                     if optional and importlib.util.find_spec(backend) is None else None)
        self.force = {**FORCE_LENGTH, "min_tokens": tokens}
        self.stack = Stack(workdir / ("-".join(["llmq", backend] + ([label] if label else []))),
                           backend=backend, **stack_kwargs)

    def start(self) -> str:
        self.stack.start("continuous")
        return self.stack.url

    def stop(self) -> None:
        self.stack.stop()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of each part: the model process (the worker's child), the engine
        (the Celery worker itself), the API and Redis."""
        worker = process_cpu(self.stack.worker)
        model = {k: v for k, v in worker.items() if k != "root"}
        return {"model": sum(model.values()), "engine": worker.get("root", 0.0),
                "api": sum(process_cpu(self.stack.api).values()),
                "redis": sum(process_cpu(self.stack.redis).values())}


class ServerPeer:
    """A peer's own OpenAI-compatible server: one process group on a free loopback port, ready
    when GET /health answers 200 (vLLM once its engine is up, llama-server once loaded)."""

    role = "peer"

    def __init__(self, name: str, argv, env: dict, dtype: str, force: dict, log_path: Path,
                 ready_timeout_s: float, absent=lambda: None):
        self.name, self.argv, self.env, self.dtype, self.force = name, argv, env, dtype, force
        self.log_path, self.ready_timeout_s, self.absent = log_path, ready_timeout_s, absent
        self.proc: Proc | None = None

    @property
    def skip(self) -> str | None:
        """Why the peer cannot run, asked when its turn comes (a build may finish meanwhile)."""
        return self.absent()

    def start(self) -> str:
        port = free_port()
        url = f"http://{HOST}:{port}"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = Proc(self.name, self.argv(port), self.env, self.log_path).start()
        session = requests.Session()

        def healthy():
            self.proc.check_alive()
            try:
                return session.get(f"{url}/health", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        try:
            wait_until(healthy, self.ready_timeout_s, f"{self.name} to answer /health", interval=0.5)
        finally:
            session.close()
        return url

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(grace_s=10)
            self.proc = None

    def cpu_seconds(self) -> dict[str, float]:
        return {"server": sum(process_cpu(self.proc).values())}


def process_cpu(proc: Proc | None) -> dict:
    """CPU seconds (user + system) of a process ("root") and of each living descendant (by
    pid); {} when it is not running."""
    if proc is None or proc.proc is None:
        return {}
    try:
        root = psutil.Process(proc.proc.pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out["root" if p is root else p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def cpu_ms_per_token(before: dict, after: dict, tokens: int) -> dict:
    """Each part's CPU milliseconds per output token over a level (where a served system's
    time goes: the model's compute against the serving around it), plus their total."""
    per = {k: round(1000 * (after[k] - before.get(k, 0.0)) / max(1, tokens), 2) for k in after}
    return {**per, "total": round(sum(per.values()), 2)}


def vllm_peer(model_dir: str, workdir: Path, max_num_seqs: int, tokens: int) -> ServerPeer:
    import importlib.util

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GIB), "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}

    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--dtype", "float32", "--max-model-len", str(VLLM_MAX_MODEL_LEN),
                "--max-num-seqs", str(max_num_seqs), "--host", HOST, "--port", str(port)]

    def absent():
        return None if importlib.util.find_spec("vllm") else "vllm is not installed (make vllm)"

    # The first start compiles for 1-2 minutes (cached in ~/.cache/vllm); a shared CPU, more.
    return ServerPeer("vLLM", argv, env, "float32", {**FORCE_LENGTH, "min_tokens": tokens},
                      workdir / "vllm.log", ready_timeout_s=900, absent=absent)


def llama_server_peer(binary: Path, gguf: str, workdir: Path, slots: int) -> ServerPeer:
    # The llama_cpp backend's count: LLMQ_TORCH_THREADS, else every core (the same for both, so
    # a pinned comparison, e.g. LLMQ_TORCH_THREADS=1 on a shared host, stays like for like).
    threads = str(Settings.from_env().torch_threads or os.cpu_count() or 1)

    def argv(port: int) -> list[str]:
        # One KV pool for all slots (as the llama_cpp backend's), so a slot takes a prompt of
        # the mixed load's longest (3,000 tokens) beside short ones.
        return [str(binary), "-m", gguf, "--host", HOST, "--port", str(port), "-np", str(slots),
                "-c", str(max(slots * LLAMA_SERVER_CONTEXT_PER_SLOT, LLAMA_SERVER_MIN_CONTEXT)),
                "--kv-unified", "-t", threads, "-tb", threads, "--cont-batching"]

    def absent():
        return None if os.access(binary, os.X_OK) else f"{binary} is not built (make peers)"

    return ServerPeer("llama-server", argv, dict(os.environ), gguf_type(gguf), dict(FORCE_LENGTH),
                      workdir / "llama-server.log", ready_timeout_s=300, absent=absent)


def gguf_type(path: str) -> str:
    """The quantisation a GGUF file's name carries (SmolLM2-135M-Instruct.Q4_1.gguf: Q4_1)."""
    stem = Path(path).name.removesuffix(".gguf")
    return stem.rsplit(".", 1)[-1] if "." in stem else "gguf"





def build_systems(args, workdir: Path, model_dir: str, gguf: str, dtype: str) -> list:
    """llmq on --backend, its float32 twin where that serves in another dtype (issue 17's bar:
    bfloat16 at least 1.6x float32 on a CPU that computes it natively; --skip-float32-row
    leaves it out), then the peers asked for, then llmq on each other backend asked for.
    dtype: the LLMQ_DTYPE asked for (auto included), resolved for each backend; the llama_cpp
    one serves the GGUF's types."""
    stack_kwargs = dict(max_num_seqs=args.max_num_seqs, device=args.device, dtype=dtype,
                        api_app=args.api_app)

    def llmq(backend, dtype=dtype, label=""):
        if backend == "llama_cpp":
            return LlmqSystem(backend, workdir, args.peers_tokens, gguf_type(gguf), **stack_kwargs)
        served = resolve_dtype(dtype, args.device, backend)   # vLLM on CPU: float32 under auto
        return LlmqSystem(backend, workdir, args.peers_tokens, served, label,
                          **{**stack_kwargs, "dtype": served})

    systems = [llmq(args.backend)]
    if (systems[0].dtype != "float32" and args.backend != "llama_cpp"
            and not getattr(args, "skip_float32_row", False)):
        systems.append(llmq(args.backend, "float32", label=FLOAT32_LABEL))
    if "vllm" in args.peers:
        systems.append(vllm_peer(model_dir, workdir, args.max_num_seqs, args.peers_tokens))
    if "llama-server" in args.peers:
        systems.append(llama_server_peer(Path(args.llama_server), gguf, workdir, args.max_num_seqs))
    systems += [llmq(b) for b in args.llmq_backends if b != args.backend]
    return systems


def _entry(system) -> dict:
    return {"name": system.name, "role": system.role, "dtype": system.dtype, "levels": []}


def start_system(system, warm_prompts: list[str], progress) -> tuple[dict, str | None]:
    """Starts one system and warms it up (connections, kernels, allocator; not measured).
    Returns its entry and the model id it serves; no model when it was skipped or failed to
    start (the entry says which, and a failed system is stopped again)."""
    entry = _entry(system)
    if system.skip:
        entry["skipped"] = system.skip
        progress(f"peers: {system.name}: SKIPPED ({system.skip})")
        return entry, None
    try:
        t = time.monotonic()
        url = system.start()
        entry["start_s"] = round(time.monotonic() - t, 1)
        model = served_model(url)
        progress(f"peers: {system.name} ready in {entry['start_s']} s ({url}, model {model!r})")
        warm = [completion_payload(model, p, 8, system.force) for p in warm_prompts]
        closed_loop(url, len(warm), warm, hard_limit_s=120, send=stream_completion)
        system.url = url
        return entry, model
    except Exception as exc:  # noqa: BLE001 - one system's failure is a row, not the run's end
        entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
        progress(f"peers: {system.name}: ERROR {entry['error']}")
        system.stop()
        return entry, None


def measure_level(system, model: str, c: int, prompts: list[str], tokens: int,
                  level_time_limit: float, eff: dict | None, progress,
                  bystanders: tuple = ()) -> dict:
    """One level of one running system: the closed loop, its summary, where the CPU went.
    c: the concurrency, or MIXED for the mixed load (MIXED_STREAMS streams).
    bystanders: the systems kept up meanwhile (interleaved order); the CPU they used during
    the level is recorded, the check that an idle system does not slow the one measured."""
    payloads = [completion_payload(model, p, tokens, system.force) for p in prompts]
    load, c = (MIXED, MIXED_STREAMS) if c == MIXED else (None, c)
    settled = settle(bystanders)
    cpu = system.cpu_seconds()
    others = cpu_total(bystanders)
    if load:
        level_time_limit = max(level_time_limit, MIXED_TIME_LIMIT_S)
    results, wall, cut = closed_loop(system.url, c, payloads, level_time_limit,
                                     2 * level_time_limit, send=stream_completion)
    s = summarize(results, wall)
    s.update(concurrency=c, max_tokens=tokens, truncated=cut)
    if load:
        s["load"] = load
    s["cpu_ms_per_token"] = cpu_ms_per_token(cpu, system.cpu_seconds(),
                                             round((s["tokens_per_s_all"] or 0) * wall))
    if bystanders:
        # % of one core: a few tenths is Redis's and Celery's heartbeats; more would show.
        used = cpu_total(bystanders) - others
        # max 0: a bystander's child that exits mid-level takes its CPU seconds with it.
        s["bystanders_cpu_pct"] = max(0.0, round(100 * used / max(wall, 1e-9), 1))
        s["settle_s"] = settled
    # (The limit is the uniform load's: the mixed load's prompts make its steps other work.)
    s["compute_fraction"] = None if load else fraction_for(eff, s["tokens_per_s_all"],
                                                          system.dtype, c)
    fail = (f", {s['failures']} failed ({'; '.join(s['failure_examples'])})"
            if s["failures"] else "")
    idle = (f", others idle at {s['bystanders_cpu_pct']}% of a core"
            if "bystanders_cpu_pct" in s else "")
    progress(f"peers: {system.name} {load or ''} c={c}: {s['tokens_per_s_all']} tok/s, TTFT "
             f"p50 {s['ttft_p50_s']} s p95 {s['ttft_p95_s']} s, ITL p50 {s['itl_p50_s']} s, CPU ms/token "
             f"{s['cpu_ms_per_token']}{fail}{idle}"
             f"{' (cut by the time limit)' if cut else ''}")
    return s


def cpu_total(systems) -> float:
    """The CPU seconds so far of every part of these systems, together."""
    return sum(sum(x.cpu_seconds().values()) for x in systems)


QUIET_PCT = 5.0   # % of one core: Redis's and Celery's heartbeats stay under it


def _until_quiet(window_pct, quiet_pct: float, window_s: float, max_s: float
                 ) -> tuple[float | None, float]:
    """Measures CPU over windows of window_s (window_pct(window_s) returns the window's %)
    until one is under quiet_pct. Returns (the seconds it took, or None after max_s, and the
    last window's %)."""
    t0 = time.monotonic()
    while True:
        pct = window_pct(window_s)
        if pct < quiet_pct:
            return round(time.monotonic() - t0, 1), pct
        if time.monotonic() - t0 >= max_s:
            return None, pct


def settle(bystanders: tuple, quiet_pct: float = QUIET_PCT, window_s: float = 0.5,
           max_s: float = 30.0) -> float | None:
    """Waits until the systems kept up are quiet (their CPU over a window under quiet_pct of
    a core): the one measured before may still be ending its streams (a level cut by its time
    limit aborts dozens), or logging its stats. Returns the seconds it took; None after max_s
    (the level is measured anyway, and its bystanders_cpu_pct says how loud they were)."""
    if not bystanders:
        return 0.0
    last = [cpu_total(bystanders)]

    def window_pct(window_s: float) -> float:
        time.sleep(window_s)   # a measuring window, not a wait for an event
        now = cpu_total(bystanders)
        pct, last[0] = 100 * (now - last[0]) / window_s, now
        return pct
    return _until_quiet(window_pct, quiet_pct, window_s, max_s)[0]


def settle_machine(quiet_pct: float = 10.0, window_s: float = 0.5, max_s: float = 30.0
                   ) -> tuple[float | None, float]:
    """Waits until the whole machine is quiet (its CPU over a window under quiet_pct of all
    cores): the systems just stopped may still be exiting. Returns (the seconds it took, or
    None after max_s, and the last window's CPU %)."""
    psutil.cpu_percent(None)   # starts the first window

    def window_pct(window_s: float) -> float:
        time.sleep(window_s)   # a measuring window, not a wait for an event
        return psutil.cpu_percent(None)
    return _until_quiet(window_pct, quiet_pct, window_s, max_s)


def run_system(system, levels: list[int], prompts: dict[int, list[str]], tokens: int,
               level_time_limit: float, eff: dict | None, progress) -> dict:
    """Starts one system, warms it up, runs every level, stops it. Never raises: a system
    that fails is an error row, and the table goes on with the next."""
    entry, model = start_system(system, prompts[0][:4], progress)
    if model is None:
        return entry
    try:
        for c in levels:
            entry["levels"].append(measure_level(system, model, c, prompts[c], tokens,
                                                 level_time_limit, eff, progress))
    except Exception as exc:  # noqa: BLE001 - one system's failure is a row, not the run's end
        entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
        progress(f"peers: {system.name}: ERROR {entry['error']}")
    finally:
        system.stop()
    return entry


def sequential_rounds(systems: list, levels, prompts, tokens, level_time_limit, eff, progress,
                      rounds: int) -> list[list[dict]]:
    """One system up at a time, every level, then the next (A B C, A B C): what a machine that
    cannot hold them all at once (one GPU) does. prompts: per round, {0: the warm-up's, level:
    its}. Each system's entry per round."""
    runs: list[list[dict]] = [[] for _ in systems]
    for r in range(rounds):
        if rounds > 1:
            progress(f"peers: round {r + 1} of {rounds}")
        for i, system in enumerate(systems):
            runs[i].append(run_system(system, levels, prompts[r], tokens, level_time_limit,
                                      eff, progress))
    return runs


def interleaved_rounds(systems: list, levels, prompts, tokens, level_time_limit, eff, progress,
                       rounds: int) -> list[list[dict]]:
    """Every system started once and kept up; at each level of each round they take turns,
    back to back, in the reverse order every other round (A B C, C B A). On a shared VM the
    speed drifts by a fifth over minutes, more than the systems differ: systems a whole table
    apart (sequential) see different machines, systems a level apart nearly the same one.
    Each system's entry per round, as sequential_rounds gives them."""
    started: list[tuple[dict, str | None]] = []
    live: list[int] = []
    stopped: set[int] = set()
    try:
        # Inside the try: an interrupt during vLLM's ~2.5-minute start stops the ones up,
        # and the one starting.
        for i, system in enumerate(systems):
            started.append(start_system(system, prompts[0][0], progress))
            if started[-1][1] is not None:
                live.append(i)
        runs = [[dict(entry, levels=[]) for _ in range(rounds)] for entry, _ in started]
        for r in range(rounds):
            if rounds > 1:
                progress(f"peers: round {r + 1} of {rounds}")
            for c in levels:
                for i in (live if r % 2 == 0 else live[::-1]):
                    system, model = systems[i], started[i][1]
                    others = tuple(systems[j] for j in live if j != i)
                    try:
                        runs[i][r]["levels"].append(measure_level(
                            system, model, c, prompts[r][c], tokens, level_time_limit, eff,
                            progress, bystanders=others))
                    except Exception as exc:  # noqa: BLE001 - this system's rows end here
                        runs[i][r]["error"] = f"{type(exc).__name__}: {exc}"[:500]
                        progress(f"peers: {system.name}: ERROR {runs[i][r]['error']}")
                        live = [j for j in live if j != i]
                        stopped.add(i)
                        _stop(system)
    finally:
        # Every system that was or may be up (a start interrupted midway included), once.
        for i in range(min(len(started) + 1, len(systems))):
            if i not in stopped:
                _stop(systems[i])
    return runs


def _stop(system) -> None:
    try:
        system.stop()
    except Exception:  # noqa: BLE001 - stop the others whatever happens
        pass


def peers_phase(systems: list, tokenizer, levels: list[int], requests: list[int], tokens: int,
                level_time_limit: float, eff: dict | None = None, progress=print,
                rounds: int = 1, order: str = "interleaved", mixed: int = 0) -> dict:
    """Every system at every level, then on `mixed` prompts of the mixed load (0: none),
    `rounds` times, in `order` (interleaved or sequential, see their functions); each level's
    row the best of its rounds (see best_of_rounds)."""
    lengths = mixed_prompt_lengths(mixed) if mixed else []
    # The same prompts for every system in a round; each level and each round has its own,
    # so that no cache carries over (a system kept up between rounds would otherwise see its
    # prompts again: llama-server's slots and vLLM's prefix cache skip their prefill).
    warm, offset = synthetic_prompts(tokenizer, 4, offset=10**6), 0
    prompts: list[dict[int, list[str]]] = []
    for _ in range(rounds):
        prompts.append({0: warm})
        for c, n in zip(levels, requests):
            prompts[-1][c] = synthetic_prompts(tokenizer, n, offset=offset)
            offset += n
        if lengths:
            prompts[-1][MIXED] = mixed_prompts(tokenizer, synthetic_prompts, lengths, offset)
            offset += len(lengths)
    out = {"levels": levels, "requests": requests, "max_tokens": tokens,
           "prompt_tokens": PROMPT_TOKENS, "level_time_limit_s": level_time_limit,
           "rounds": rounds, "order": order, "load_avg_start": list(os.getloadavg()),
           "systems": []}
    if lengths:
        out["mixed"] = {"streams": MIXED_STREAMS, "prompts": len(lengths),
                        "prompt_tokens_range": [min(lengths), max(lengths)],
                        "mean_prompt_tokens": round(sum(lengths) / len(lengths), 1)}
    run = {"interleaved": interleaved_rounds, "sequential": sequential_rounds}[order]
    loads = list(levels) + ([MIXED] if lengths else [])
    runs = run(systems, loads, prompts, tokens, level_time_limit, eff, progress, rounds)
    out["systems"] = [best_of_rounds(entries) for entries in runs]
    out["load_avg_end"] = list(os.getloadavg())
    best_peer_ratios(out["systems"])
    return out


def best_of_rounds(entries: list[dict]) -> dict:
    """One system's row from its rounds: at each level the round with the most tok/s, whole
    (its latencies with it), and every round's tok/s beside it. Identical runs on these VMs
    vary by 10-20%, and what slows a round is something else on the machine, never the system
    itself, so the best round is the closest to what the system does; every system gets the
    same number of tries, in turn."""
    if len(entries) == 1:
        return entries[0]
    out = {k: v for k, v in entries[0].items() if k not in ("levels", "error", "skipped")}
    # Per level, each round's run of it or None, in round order (round r of one system
    # pairs with round r of another: under interleaved order they ran back to back).
    by_level: dict[int, list[dict | None]] = {}
    for r, e in enumerate(entries):
        for lv in e.get("levels", []):
            by_level.setdefault(level_key(lv), [None] * len(entries))[r] = lv
    out["levels"] = []
    for c, lvs in by_level.items():
        best = max((lv for lv in lvs if lv), key=lambda lv: lv.get("tokens_per_s_all") or 0)
        out["levels"].append({**best, "rounds_tokens_per_s": [lv and lv.get("tokens_per_s_all")
                                                              for lv in lvs]})
    errors = [e["error"] for e in entries if e.get("error")]
    if errors and not out["levels"]:
        out["error"] = errors[0]
    elif errors:
        out["round_errors"] = errors
    skipped = [e["skipped"] for e in entries if e.get("skipped")]
    if skipped and not out["levels"]:
        out["skipped"] = skipped[0]
    return out


def refresh_fractions(peers: dict, eff: dict) -> None:
    """Each row's fraction of the compute limit again, against eff's (merged) rates."""
    for sys_ in peers["systems"]:
        for lv in sys_.get("levels", []):
            if lv.get("load"):
                continue   # (no limit for the mixed load: see measure_level)
            lv["compute_fraction"] = fraction_for(eff, lv.get("tokens_per_s_all"), sys_["dtype"],
                                                  lv["concurrency"])


def add_model_alone(peers: dict, eff: dict | None, tokenizer, model: str, progress=print,
                    run=None, rounds: int = 2, settle_first=settle_machine) -> None:
    """peers["model_alone"]: for each llmq[transformers] row at the table's top level, the
    same load's ceiling on this machine (bench/raw.model_alone: llmq's model worker stepped in
    this process, no stack), its fraction of the compute limit, and the served row's tok/s
    over it. Where the limit bar is missed, this splits the miss between the model and the
    serving around it. Run after the last matmul probe, with every system stopped."""
    from .raw import model_alone

    run = run or model_alone
    c = max(peers["levels"])
    out = []
    for sys_ in peers["systems"]:
        lv = next((x for x in sys_.get("levels", []) if level_key(x) == c), None)
        if (not sys_["name"].startswith("llmq[transformers]") or lv is None
                or sys_["dtype"] not in ("float32", "bfloat16", "float16")):
            continue
        # Each round its own prompts, as in the table: the same again would hit the prefix cache.
        ids = [[tokenizer(p, add_special_tokens=False)["input_ids"]
                for p in synthetic_prompts(tokenizer, c, offset=2 * 10**6 + r * c)]
               for r in range(rounds)]
        waited, pct = settle_first()
        progress(f"model alone ({sys_['name']}): " + (f"the machine quiet after {waited} s"
                 if waited is not None else f"the machine still at {pct:.0f}% CPU, measured anyway"))
        try:
            res = run(ids, peers["max_tokens"], sys_["dtype"], model, progress=progress)
        except Exception as exc:  # noqa: BLE001 - the table stands without it
            progress(f"model alone ({sys_['name']}): {type(exc).__name__}: {exc}")
            out.append({"system": sys_["name"], "concurrency": c,
                        "error": f"{type(exc).__name__}: {exc}"})
            continue
        served = lv.get("tokens_per_s_all")
        out.append({**res, "system": sys_["name"], "concurrency": c, "machine_cpu_pct": pct,
                    "compute_fraction": fraction_for(eff, res["tokens_per_s"], sys_["dtype"], c),
                    "decode_compute_fraction": fraction_for(eff, res.get("decode_tokens_per_s"),
                                                            sys_["dtype"], c),
                    "served_tokens_per_s": served,
                    "served_over_alone": (round(served / res["tokens_per_s"], 3)
                                          if served and res["tokens_per_s"] else None)})
    peers["model_alone"] = out
