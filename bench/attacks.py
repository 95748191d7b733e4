"""One tenant against another (`--only attacks`, issue 48): on one stack with two API keys, key
b sends small chat requests (16 tokens, one after another) while key a sends, in turn, nothing
(alone), a plain flood (the control: four clients sending `n` 16, 256-token chat requests back
to back) and each attack of the issue, every one a request that a tenant may try:

  webhook_tarpit     the flood's shape as 64-prompt jobs whose webhook receiver (on loopback)
                     accepts connections and never answers
  stop_token_ids     the flood with 200,000 stop_token_ids and min_tokens
  logit_bias         the flood with a whole-vocabulary logit_bias
  costly_schema      four clients sending a chat request whose 87-byte JSON schema is costly
                     to compile (minItems 200,000)
  waiting_generate   four clients each starting 50 waiting /v1/generate requests (200 tokens)
                     every 10 s

Each row lasts `attack_seconds` (b measures after a short ramp). Between rows key a's
unfinished jobs are cancelled and the phase waits for them to end, so each row starts from an
idle worker. Reported per row: b's latency p50 and p90, x alone, x the control, b's errors
(any answer but 200: a 429 caused by a's backlog is one), and what a's requests were answered
(an attack refused up front is a row of 400s). The bar: every attack row within 2x the control,
with no error for b.
"""
from __future__ import annotations

import base64
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import requests

from .report import pct

KEY_A, KEY_B, METRICS_KEY = "bench-key-a", "bench-key-b", "bench-metrics-key"
CONTROL_BAR = 2.0            # an attack row's p50 over the control's (issue 48's done-when)
PROBE_TOKENS = 16
FLOOD_CLIENTS, FLOOD_N, FLOOD_TOKENS = 4, 16, 256
WAVE_CLIENTS, WAVE_SIZE, WAVE_EVERY_S, WAVE_TOKENS = 4, 50, 10.0, 200
VOCAB = 49152                # smollm2's; a bias over all of it is far past any cap
ROWS = ("alone", "control", "webhook_tarpit", "stop_token_ids", "logit_bias", "costly_schema",
        "waiting_generate")
LABELS = {
    "alone": "nothing (b alone)",
    "control": "plain flood (control)",
    "webhook_tarpit": "64-prompt jobs, webhook receiver never answers",
    "stop_token_ids": "flood + 200,000 stop_token_ids + min_tokens",
    "logit_bias": "flood + whole-vocabulary logit_bias",
    "costly_schema": "4 clients, JSON schema minItems 200,000",
    "waiting_generate": "4 clients x 50 waiting /v1/generate every 10 s",
}
COSTLY_SCHEMA = {"type": "array", "minItems": 200000, "items": {"type": "integer"}}


def stack_env() -> dict[str, str]:
    """The stack's settings for the phase: two tenant keys and a metrics key (its /readyz), and
    webhooks allowed to reach the loopback receiver."""
    return {"LLMQ_API_KEYS": f"{KEY_A},{KEY_B}", "LLMQ_METRICS_KEYS": METRICS_KEY,
            "LLMQ_WEBHOOK_SECRET": "whsec_" + base64.b64encode(os.urandom(32)).decode(),
            "LLMQ_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1"}


class SilentReceiver:
    """A webhook receiver on loopback that accepts connections and never answers: each
    delivery to it lasts its whole timeout. `connections` counts those it accepted (the
    webhook tests use it too)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.lock = threading.Lock()
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="silent-receiver").start()

    @property
    def connections(self) -> int:
        with self.lock:
            return len(self.held)

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.held.append(conn)

    def stop(self) -> None:
        self.closed.set()
        self.sock.close()
        with self.lock:
            for conn in self.held:
                conn.close()


def _session(key: str) -> requests.Session:
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {key}"
    return s


def _chat(tokens: int, n: int = 1, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "Write a short story about the sea."}],
            "max_tokens": tokens, "n": n, "ignore_eos": True, **extra}


class Attacker:
    """Key a's clients for one row, sending until stopped; counts how each request was
    answered (status codes; `error` for no answer)."""

    def __init__(self, url: str, kind: str, tarpit_url: str, tokens: int | None = None):
        self.url, self.kind, self.tarpit_url = url, kind, tarpit_url
        # Key a's output tokens (a smoke run on a small machine asks for fewer).
        self.flood_tokens, self.wave_tokens = tokens or FLOOD_TOKENS, tokens or WAVE_TOKENS
        self.stop = threading.Event()
        self.answers: Counter = Counter()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        if self.kind == "alone":
            return
        target = self._waves if self.kind == "waiting_generate" else self._loop
        for i in range(WAVE_CLIENTS if self.kind == "waiting_generate" else FLOOD_CLIENTS):
            t = threading.Thread(target=target, daemon=True, name=f"attack-{self.kind}-{i}")
            t.start()
            self.threads.append(t)

    def _count(self, what) -> None:
        with self.lock:
            self.answers[str(what)] += 1

    def _post(self, session: requests.Session, path: str, body: dict):
        try:
            r = session.post(f"{self.url}{path}", json=body, timeout=900)
        except requests.RequestException:
            self._count("error")
            return None
        self._count(r.status_code)
        if r.status_code == 429:   # a's own backlog: back off as told, not spin
            self.stop.wait(min(5.0, float(r.headers.get("Retry-After") or 1)))
        elif r.status_code >= 400:
            self.stop.wait(0.05)
        return r

    def _loop(self) -> None:
        """One client sending its request back to back (the next when the last has ended)."""
        session = _session(KEY_A)
        while not self.stop.is_set():
            if self.kind == "webhook_tarpit":
                r = self._post(session, "/v1/jobs", {
                    "prompts": [f"Story {i} about the sea." for i in range(64)],
                    "max_tokens": self.flood_tokens, "ignore_eos": True,
                    "webhook": self.tarpit_url,
                    "webhook_events": ["started", "completed"]})
                if r is not None and r.status_code == 202:
                    self._wait_jobs(session, [j["id"] for j in r.json()["jobs"]])
                continue
            extra = {"control": {},
                     "stop_token_ids": {"stop_token_ids": list(range(200_000)),
                                        "min_tokens": self.flood_tokens},
                     "logit_bias": {"logit_bias": {str(i): 1.0 for i in range(VOCAB)}},
                     "costly_schema": {"response_format": {"type": "json_schema", "json_schema": {
                         "name": "costly", "schema": COSTLY_SCHEMA}}}}[self.kind]
            n = 1 if self.kind == "costly_schema" else FLOOD_N
            self._post(session, "/v1/chat/completions", _chat(self.flood_tokens, n, **extra))

    def _wait_jobs(self, session: requests.Session, ids: list[str]) -> None:
        for seq_id in ids:
            while not self.stop.is_set():
                try:
                    st = session.get(f"{self.url}/v1/jobs/{seq_id}", timeout=30).json()
                except (requests.RequestException, ValueError):
                    st = {}
                if st.get("status") in ("succeeded", "failed", "cancelled", None):
                    break
                self.stop.wait(0.5)

    def _waves(self) -> None:
        """One client starting WAVE_SIZE waiting /v1/generate requests every WAVE_EVERY_S."""
        while not self.stop.is_set():
            for _ in range(WAVE_SIZE):
                t = threading.Thread(target=self._one_generate, daemon=True)
                t.start()
                self.threads.append(t)
            self.stop.wait(WAVE_EVERY_S)

    def _one_generate(self) -> None:
        with _session(KEY_A) as session:
            self._post(session, "/v1/generate", {"prompt": "Tell a story about the sea.",
                                                 "max_tokens": self.wave_tokens,
                                                 "ignore_eos": True})

    def finish(self, timeout_s: float = 120.0) -> None:
        """Stops sending, cancels key a's unfinished jobs (which ends its waiting requests) until
        none is left, and waits for its clients to return."""
        self.stop.set()
        cancel_unfinished(self.url, KEY_A, timeout_s)
        deadline = time.monotonic() + timeout_s
        for t in list(self.threads):
            t.join(max(0.1, deadline - time.monotonic()))


def cancel_unfinished(url: str, key: str, timeout_s: float) -> None:
    """Cancels the key's queued and running jobs until it has none (requests still arriving
    may add some after a first pass)."""
    deadline = time.monotonic() + timeout_s
    with _session(key) as s:
        while time.monotonic() < deadline:
            ids = [seq_id for status in ("queued", "running")
                   for seq_id in _listed(s, url, status, deadline)]
            if not ids:
                return
            for seq_id in ids:
                s.delete(f"{url}/v1/jobs/{seq_id}", timeout=30)
            time.sleep(0.5)


def _listed(s: requests.Session, url: str, status: str, deadline: float) -> list[str]:
    """The ids of the key's jobs in this status, every page (a page may be empty and still
    have more after it: the listing reads a bounded number of entries per request)."""
    ids, after = [], None
    while time.monotonic() < deadline:
        r = s.get(f"{url}/v1/jobs", params={"status": status, "limit": 100,
                                            **({"after": after} if after else {})}, timeout=30)
        if not r.ok:
            break
        page = r.json()
        ids += [j["id"] for j in page.get("data", [])]
        if not page.get("has_more") or not page.get("last_id"):
            break
        after = page["last_id"]
    return ids


@dataclass
class Probe:
    """Key b's requests during one row: latencies of the answered ones, and its errors."""

    latencies: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)


def probe(url: str, seconds: float) -> Probe:
    """Key b's 16-token chat requests, one after another, for `seconds` (at least one; the
    last one started in time is waited for)."""
    out = Probe()
    end = time.monotonic() + seconds
    with _session(KEY_B) as s:
        while not out.latencies and not out.errors or time.monotonic() < end:
            t = time.perf_counter()
            try:
                r = s.post(f"{url}/v1/chat/completions", json=_chat(PROBE_TOKENS), timeout=600)
            except requests.RequestException as exc:
                out.errors[type(exc).__name__] += 1
                continue
            if r.status_code == 200:
                out.latencies.append(time.perf_counter() - t)
            else:
                code = (r.json().get("error") or {}).get("code") if r.headers.get(
                    "Content-Type", "").startswith("application/json") else None
                out.errors[f"{r.status_code} {code or ''}".strip()] += 1
    return out


def attacks_phase(stack, seconds: float = 60.0, rows=ROWS, progress=print,
                  tokens: int | None = None) -> dict:
    """Each row in turn on the stack (started with stack_env() and a delivery worker);
    `tokens`: key a's output tokens instead of the issue's (256 a flood, 200 a wave)."""
    tarpit = SilentReceiver()
    ramp = min(10.0, seconds / 4)
    measured = []
    try:
        probe(stack.url, 0.0)   # warm-up: one request
        for kind in rows:
            attacker = Attacker(stack.url, kind, tarpit.url + "/hook", tokens)
            attacker.start()
            if kind != "alone":
                attacker.stop.wait(ramp)
            got = probe(stack.url, seconds)
            attacker.finish()
            row = {"kind": kind, "latencies": got.latencies, "errors": dict(got.errors),
                   "a_answers": dict(attacker.answers)}
            measured.append(row)
            p50 = pct(got.latencies, 50)
            progress(f"attacks: {kind}: b p50 {p50} s over {len(got.latencies)} requests, "
                     f"b errors {dict(got.errors) or 0}, a answered {dict(attacker.answers)}")
    finally:
        tarpit.stop()
    return summarize(measured, seconds)


# --- the report (no stack: tests/unit/test_bench_attacks.py) ---------------------------------
def summarize(measured: list[dict], seconds: float) -> dict:
    """Per row: b's p50 and p90, x alone and x the control, b's errors, a's answers, and
    whether a's requests were refused up front (every one a 400)."""
    p50 = {m["kind"]: pct(m["latencies"], 50) for m in measured}
    alone, control = p50.get("alone"), p50.get("control")
    rows = []
    for m in measured:
        a = m["a_answers"]
        sent = sum(a.values())
        rows.append({"kind": m["kind"], "label": LABELS.get(m["kind"], m["kind"]),
                     "b_requests": len(m["latencies"]) + sum(m["errors"].values()),
                     "b_p50_s": p50[m["kind"]], "b_p90_s": pct(m["latencies"], 90),
                     "x_alone": _ratio(p50[m["kind"]], alone),
                     "x_control": _ratio(p50[m["kind"]], control),
                     "b_errors": sum(m["errors"].values()), "b_error_kinds": m["errors"],
                     "a_answers": a,
                     "refused_up_front": bool(sent) and a.get("400", 0) == sent})
    return {"seconds": seconds, "rows": rows}


def _ratio(a, b):
    return round(a / b, 2) if a is not None and b else None


def attack_targets(attacks: dict | None) -> list[dict]:
    """Issue 48's bar per attack row: b's p50 within CONTROL_BAR x the control's, and no
    error for b."""
    if not attacks:
        return []
    out = []
    for row in attacks["rows"]:
        if row["kind"] in ("alone", "control"):
            continue
        v = row["x_control"]
        out.append({"name": f"attacks: {row['kind']}: key b p50 <= {CONTROL_BAR} x the flood "
                            "control, no error for b",
                    "value": v, "met": None if v is None else (v <= CONTROL_BAR
                                                               and not row["b_errors"])})
    return out


def format_attacks(attacks: dict | None) -> list[str]:
    """The phase's table of the summary."""
    if not attacks:
        return []
    lines = [f"Attacks from key a, key b's {PROBE_TOKENS}-token chat requests "
             f"({attacks['seconds']:g} s each):",
             f"  {'key a sends':<48} {'b p50':>7} {'x alone':>7} {'x ctrl':>6} {'b n':>4} "
             f"{'b err':>5}  key a answered"]
    for r in attacks["rows"]:
        p50 = "-" if r["b_p50_s"] is None else f"{r['b_p50_s']:.2f}s"
        answered = "refused up front (400)" if r["refused_up_front"] else (
            ", ".join(f"{k}: {v}" for k, v in sorted(r["a_answers"].items())) or "-")
        lines.append(f"  {r['label']:<48} {p50:>7} {_fmt(r['x_alone']):>7} "
                     f"{_fmt(r['x_control']):>6} {r['b_requests']:>4} {r['b_errors']:>5}  "
                     f"{answered}")
    return lines


def _fmt(v) -> str:
    return "-" if v is None else f"{v:g}"
