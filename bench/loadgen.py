"""Load generators: one streaming request (SSE), closed-loop clients and open-loop arrivals.

llmq's own requests are POST /v1/generate with "stream": true; the client timestamps each
`event: token` as its HTTP chunk arrives, and reads the usage from the final `event: done`.
The peers table sends every system (llmq and its peers) the same streaming POST
/v1/completions instead (stream_completion), timed per chunk as vLLM's benchmark client does.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import requests

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 300.0   # the longest silence tolerated on one stream


@dataclass
class RequestResult:
    start: float                          # perf_counter when the request was sent
    first_token: float | None = None      # the first token event (text or not)
    first_text: float | None = None       # the first one with text
    end: float | None = None
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    expected_tokens: int = 0
    status: str = ""
    error: str | None = None
    seq_id: str | None = None
    finish_reason: str | None = None      # the OpenAI routes' last one

    @property
    def ok(self) -> bool:
        return (self.error is None and self.status == "succeeded"
                and (not self.expected_tokens or self.completion_tokens == self.expected_tokens))

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def ttft_text(self) -> float | None:
        return None if self.first_text is None else self.first_text - self.start

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start

    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def describe_failure(self) -> str:
        if self.error:
            return self.error
        if self.status != "succeeded":
            return f"status {self.status or 'unknown'}"
        return f"{self.completion_tokens} tokens, expected {self.expected_tokens}"


class Inflight:
    """The sequences whose streams are open, so that a time limit can cancel them."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ids: set[str] = set()
        self.cancelled = 0
        # After it, a client that cancels by closing its stream (stream_completion) does so.
        self.deadline: float | None = None

    def add(self, seq_id: str | None) -> None:
        if seq_id:
            with self.lock:
                self.ids.add(seq_id)

    def discard(self, seq_id: str | None) -> None:
        with self.lock:
            self.ids.discard(seq_id)

    def cancel_all(self, url: str) -> None:
        with self.lock:
            ids = list(self.ids)
        with requests.Session() as s:
            for seq_id in ids:
                try:
                    s.delete(f"{url}/v1/jobs/{seq_id}", timeout=10)
                    self.cancelled += 1
                except requests.RequestException:
                    pass


def _watchdog(url: str, inflight: Inflight, hard_deadline: float | None, finished: threading.Event):
    """After the hard deadline, cancels whatever is still running (DELETE /v1/jobs/<id>)."""
    if hard_deadline is None:
        return None

    def run():
        while not finished.wait(0.5):
            if time.perf_counter() > hard_deadline:
                inflight.cancel_all(url)
                finished.wait(5)   # once more for streams that were not open yet
                if not finished.is_set():
                    inflight.cancel_all(url)
                return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def payload(prompt: str, n: int) -> dict:
    """A /v1/generate request for exactly n tokens, greedy (the uniform served levels')."""
    return {"prompt": prompt, "stream": True, "max_tokens": n, "min_tokens": n,
            "ignore_eos": True, "temperature": 0}


def stream_generate(session: requests.Session, url: str, payload: dict,
                    start: float | None = None, inflight: Inflight | None = None) -> RequestResult:
    """Sends one streaming request and reads its SSE to the end."""
    res = RequestResult(start=time.perf_counter() if start is None else start,
                        expected_tokens=int(payload.get("max_tokens") or 0))
    try:
        with session.post(f"{url}/v1/generate", json=payload, stream=True,
                          timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S)) as resp:
            res.seq_id = resp.headers.get("X-Request-Id")
            if inflight is not None:
                inflight.add(res.seq_id)
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                res.end = time.perf_counter()
                return res
            buf = b""
            done = False
            # chunk_size=None: each HTTP chunk as it arrives (one or more SSE events).
            for chunk in resp.iter_content(chunk_size=None):
                now = time.perf_counter()
                buf += chunk
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    kind, data = _parse_event(block)
                    if kind == "token":
                        if res.first_token is None:
                            res.first_token = now
                        if res.first_text is None and json.loads(data or "{}").get("text"):
                            res.first_text = now
                        res.token_times.append(now)
                    elif kind == "reset":   # redelivered: the stream starts over
                        res.token_times.clear()
                    elif kind == "done":
                        job = json.loads(data or "{}")
                        res.status = job.get("status") or ""
                        usage = job.get("usage") or {}
                        res.completion_tokens = int(usage.get("completion_tokens") or 0)
                        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        if job.get("error"):
                            res.error = str(job["error"].get("message"))
                        done = True
                if done:
                    break
            res.end = time.perf_counter()
            if not done and res.error is None:
                res.error = "stream ended without a done event"
    except requests.RequestException as exc:
        res.end = time.perf_counter()
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if inflight is not None:
            inflight.discard(res.seq_id)
    return res


def stream_completion(session: requests.Session, url: str, payload: dict,
                      start: float | None = None, inflight: Inflight | None = None,
                      path: str = "/v1/completions") -> RequestResult:
    """Sends one streaming POST /v1/completions (OpenAI's wire format, which llmq, vLLM and
    llama-server all serve; path="/v1/chat/completions" for the chat route) and reads it to
    `data: [DONE]`. Each chunk with text (a chat delta with content, reasoning or tool calls)
    is a token event; the usage chunk (stream_options.include_usage) gives the counts, else the
    chunks are counted. Past inflight.deadline it closes the stream: every server aborts on
    disconnect."""
    res = RequestResult(start=time.perf_counter() if start is None else start,
                        expected_tokens=int(payload.get("max_tokens") or 0))
    chunks = 0
    try:
        with session.post(f"{url}{path}", json=payload, stream=True,
                          timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S)) as resp:
            # llmq's id: the watchdog cancels a stream that sends nothing until its end (an
            # answer with tools is held so) by it.
            res.seq_id = resp.headers.get("X-Request-Id")
            if inflight is not None:
                inflight.add(res.seq_id)
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                res.end = time.perf_counter()
                return res
            buf, finish = b"", None
            for chunk in resp.iter_content(chunk_size=None):
                now = time.perf_counter()
                buf = (buf + chunk).replace(b"\r\n", b"\n")   # SSE allows either line end
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    _, data = _parse_event(block)
                    if data == "[DONE]":
                        res.status = "succeeded" if finish else "stream ended without a finish reason"
                        res.completion_tokens = res.completion_tokens or chunks
                        continue
                    if not data:
                        continue
                    body = json.loads(data)
                    if body.get("error"):
                        res.error = str(body["error"])[:300]
                    usage = body.get("usage") or {}
                    if usage.get("completion_tokens") is not None:
                        res.completion_tokens = int(usage["completion_tokens"])
                        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    for choice in body.get("choices") or []:
                        finish = res.finish_reason = choice.get("finish_reason") or finish
                        if choice.get("text") or _delta_has_text(choice.get("delta")):
                            chunks += 1
                            if res.first_token is None:
                                res.first_token = res.first_text = now
                            res.token_times.append(now)
                if res.status:
                    break
                if inflight is not None and inflight.deadline and now > inflight.deadline:
                    res.status = "cancelled"
                    res.completion_tokens = chunks
                    inflight.cancelled += 1
                    break
            res.end = time.perf_counter()
            if not res.status and res.error is None:
                res.error = "stream ended without data: [DONE]"
    except (requests.RequestException, ValueError) as exc:
        res.end = time.perf_counter()
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if inflight is not None:
            inflight.discard(res.seq_id)
    return res


def _delta_has_text(delta: dict | None) -> bool:
    return bool(delta) and any(delta.get(k) for k in ("content", "reasoning_content",
                                                       "tool_calls"))


def _parse_event(block: bytes) -> tuple[str, str]:
    kind, data = "message", []
    for line in block.decode("utf-8", "replace").split("\n"):
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    return kind, "\n".join(data)


def closed_loop(url: str, concurrency: int, payloads: list[dict],
                max_duration_s: float | None = None,
                hard_limit_s: float | None = None,
                send=stream_generate) -> tuple[list[RequestResult], float, bool]:
    """`concurrency` clients; each sends the next payload as soon as its previous request ended
    (send: stream_generate, or stream_completion for the OpenAI route).
    After max_duration_s no new request starts; after hard_limit_s the running ones are
    cancelled. Returns (results, wall seconds from the common start to the last end, cut)."""
    inflight, finished = Inflight(), threading.Event()
    lock = threading.Lock()
    next_index = [0]
    results: list[RequestResult] = []
    truncated = [False]
    barrier = threading.Barrier(concurrency + 1)
    t0 = [0.0]

    def client():
        session = requests.Session()
        try:
            barrier.wait()
            while True:
                with lock:
                    i = next_index[0]
                    if i >= len(payloads):
                        return
                    if max_duration_s is not None and time.perf_counter() - t0[0] > max_duration_s:
                        truncated[0] = True
                        return
                    next_index[0] += 1
                r = send(session, url, payloads[i], inflight=inflight)
                with lock:
                    results.append(r)
        finally:
            session.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    t0[0] = time.perf_counter()
    inflight.deadline = t0[0] + hard_limit_s if hard_limit_s else None
    barrier.wait()
    _watchdog(url, inflight, t0[0] + hard_limit_s if hard_limit_s else None, finished)
    for t in threads:
        t.join()
    finished.set()
    end = max((r.end for r in results if r.end is not None), default=time.perf_counter())
    return results, end - t0[0], truncated[0] or inflight.cancelled > 0


def open_loop(url: str, arrivals: list[tuple[float, dict]],
              hard_limit_s: float | None = None) -> tuple[list[RequestResult], float, bool]:
    """Sends each payload at its arrival offset (seconds), whatever is still running (Poisson
    arrivals: open loop). Latency counts from the scheduled arrival. After hard_limit_s the
    running requests are cancelled and no new one is sent. Returns (results, wall, cut)."""
    results: list[RequestResult | None] = [None] * len(arrivals)
    inflight, finished = Inflight(), threading.Event()
    cut = False

    def one(i: int, at: float, payload: dict):
        session = requests.Session()
        try:
            results[i] = stream_generate(session, url, payload, start=at, inflight=inflight)
        finally:
            session.close()

    threads = []
    t0 = time.perf_counter() + 0.05
    _watchdog(url, inflight, t0 + hard_limit_s if hard_limit_s else None, finished)
    for i, (offset, payload) in enumerate(arrivals):
        at = t0 + offset
        if hard_limit_s and offset > hard_limit_s:
            cut = True
            break
        delay = at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(i, at, payload), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    finished.set()
    done = [r for r in results if r is not None]
    end = max((r.end for r in done if r.end is not None), default=time.perf_counter())
    return done, end - t0, cut or inflight.cancelled > 0
