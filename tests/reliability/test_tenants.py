"""Tenants cannot hurt or read each other (docs/security.md), through real HTTP against a real
redis-server, and a real worker where the property is about running sequences."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

import psutil
import pytest

from common.protocol import EVENT_TOKEN
from common.store import owner_streams_key
from common.store.events import append_event
from support import wait_until

from .factories import FINISHED, record

pytestmark = pytest.mark.integration

KEYS = ("key-a", "key-b")


# --- health without secrets -------------------------------------------------------------------
def test_health_routes_are_bare_and_fail_fast_when_redis_hangs(world):
    api = world.api(api_keys=KEYS, metrics_keys=("scraper",), health_timeout_s=1.0)
    r = world.client()
    r.zadd("llmq:workers", {"w1@private-host": time.time()})
    r.hset("llmq:worker:w1@private-host", mapping={"model_loaded": 1, "prefill_tokens": 16})
    resp = api.request("GET", "/health")
    assert resp.status_code == 200 and resp.content == b""
    assert api.request("GET", "/readyz").json() == {"status": "ready"}
    assert api.with_key("key-a").request("GET", "/readyz").json() == {"status": "ready"}
    assert "private-host" in api.with_key("scraper").request("GET", "/readyz").text
    world.redis_server.proc.send_signal(signal.SIGSTOP)   # frozen: accepts, never answers
    try:
        for path in ("/health", "/readyz"):
            resp = api.request("GET", path, timeout=15)   # answers: it does not wait 30 s+
            assert resp.status_code == 503, (path, resp.text)
        assert api.request("GET", "/readyz", timeout=15).json() == {"status": "unavailable"}
        assert api.request("GET", "/healthz", timeout=15).status_code == 200
    finally:
        world.redis_server.proc.send_signal(signal.SIGCONT)
    world.redis_server.stop()                               # down: no error text either
    resp = api.request("GET", "/readyz", timeout=15)
    assert resp.status_code == 503 and resp.json() == {"status": "unavailable"}


# --- strict ids ---------------------------------------------------------------------------------
def test_bad_ids_and_stream_positions_are_json_4xx_not_503(world):
    api = world.api(api_keys=KEYS).with_key("key-a")
    job = api.submit(prompt="Hello", max_tokens=4)
    jid = job["id"]
    for method, path in [("GET", f"/v1/jobs/{jid}:events"), ("DELETE", f"/v1/jobs/{jid}:events"),
                         ("GET", f"/v1/jobs/{jid}:events/stream"),
                         ("GET", f"/v1/jobs/{jid[:-1]}%0A"), ("GET", "/v1/jobs/llmq:workers")]:
        resp = api.request(method, path)
        assert resp.status_code == 404, (method, path, resp.status_code, resp.text)
        assert resp.json()["error"]["type"] == "not_found_error"
    for query in ("last_event_id=1-0%0A", "last_event_id=" + "1" * 23 + "-0",
                  f"last_event_id={2**64}-0"):
        resp = api.request("GET", f"/v1/jobs/{jid}/stream?{query}")
        assert resp.status_code == 400, (query, resp.status_code, resp.text)
        assert resp.json()["error"]["param"] == "last_event_id"
    assert api.job(jid)["status"] == "queued"               # nothing else was touched


# --- per-key stream cap -------------------------------------------------------------------------
def test_a_key_holds_at_most_its_streams_and_gets_them_back_on_close(world):
    base = world.api(api_keys=KEYS, key_max_streams=2)
    a, b = base.with_key("key-a"), base.with_key("key-b")
    jid = a.submit(prompt="Hello", max_tokens=4)["id"]     # no worker: it stays queued
    held = [a.request("GET", f"/v1/jobs/{jid}/stream", stream=True) for _ in range(2)]
    try:
        assert [h.status_code for h in held] == [200, 200]
        refused = a.request("GET", f"/v1/jobs/{jid}/stream")
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "too_many_streams"
        assert "Retry-After" in refused.headers
        refused = a.request("POST", "/v1/generate", json={"prompt": "x", "stream": True})
        assert refused.status_code == 429 and len(records(world)) == 1   # no job made for it
        other = b.submit(prompt="Hi", max_tokens=4)["id"]
        with b.request("GET", f"/v1/jobs/{other}/stream", stream=True) as resp:
            assert resp.status_code == 200                 # b's streams are b's own
    finally:
        held[0].close()
    # The server notices the hang-up at its next keep-alive (1 s here) and frees the slot.
    owner = record(world.client(), jid)["owner"]
    wait_until(lambda: world.client().zcard(owner_streams_key(owner)) == 1, 15,
               "the closed stream's slot to come back")
    with a.request("GET", f"/v1/jobs/{jid}/stream", stream=True) as resp:
        assert resp.status_code == 200
    held[1].close()


def test_a_streams_slot_lasts_as_long_as_its_stream(world):
    """A slot's lease is renewed for as long as its stream lives, past its first lease and the
    slot set's first expiry: a lapsed slot would let the key open more streams than its cap."""
    base = world.api(api_keys=KEYS, key_max_streams=1)
    a = base.with_key("key-a")
    r = world.client()
    jid = a.submit(prompt="Hello", max_tokens=4)["id"]     # no worker: it stays queued
    slots = owner_streams_key(record(r, jid)["owner"])
    with a.request("GET", f"/v1/jobs/{jid}/stream", stream=True) as held:
        assert held.status_code == 200
        first_end = r.zrange(slots, 0, -1, withscores=True)[0][1]
        # The lease as first taken has run out, and the set's first expiry has passed.
        wait_until(lambda: time.time() > first_end + 2, first_end - time.time() + 10,
                   "the slot's first lease to end", interval=0.2)
        assert r.zcount(slots, time.time(), "+inf") == 1, r.zrange(slots, 0, -1, withscores=True)
        refused = a.request("GET", f"/v1/jobs/{jid}/stream")
        assert refused.status_code == 429, refused.text
    wait_until(lambda: r.zcard(slots) == 0, 15, "the closed stream's slot to come back")


def records(world) -> list[str]:
    return [k for k in world.client().scan_iter("llmq:seq:*") if not k.endswith(":events")]


# --- with a worker: accounting, the prefix cache, fair share ---------------------------------
def test_token_quota_settles_to_real_counts_and_keys_never_share_cached_prefixes(world):
    world.worker()
    base = world.api(api_keys=KEYS, rate_limit_tpm=100_000)
    a, b = base.with_key("key-a"), base.with_key("key-b")
    r = world.client()
    prompt = "You are a helpful assistant. " * 8          # several prefix-cache blocks
    first = a.wait_job(a.submit(prompt=prompt, max_tokens=8, ignore_eos=True)["id"])
    rec = record(r, first["id"])
    window = r.hgetall(rec["rate_key"])
    # Charged prompt + completion as the worker counted them, not the reservation.
    assert int(window["tokens"]) == first["usage"]["total_tokens"], (window, first["usage"])
    assert int(rec["reserved_tokens"]) > first["usage"]["total_tokens"]
    # Key b sends the same prompt: nothing of a's is reused, so b learns nothing from it.
    other = b.wait_job(b.submit(prompt=prompt, max_tokens=8, ignore_eos=True)["id"])
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, other["usage"]
    again = a.wait_job(a.submit(prompt=prompt, max_tokens=8, ignore_eos=True)["id"])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]


def test_a_flooding_key_does_not_starve_another(world):
    """Key b sends 3 x 64 prompts with long outputs; key a's one job takes a slot from b at
    once (b's newest running sequence is preempted: a does not wait for b's sequences to end),
    and every sequence of b still completes."""
    seqs, tokens = 8, 48
    # Steps of >= 50 ms: b's first wave of 48 tokens lasts >= 2.4 s on any machine, so a's job
    # arrives at a full batch (on a fast CPU the wave could end first and free slots for it).
    worker = world.worker(LLMQ_MAX_NUM_SEQS=str(seqs), LLMQ_TASK_THREADS=str(seqs + 2),
                          min_step_s=0.05)
    base = world.api(api_keys=KEYS, max_num_seqs=seqs)
    a, b = base.with_key("key-a"), base.with_key("key-b")
    r = world.client()
    flood = []
    for i in range(3):
        flood += [j["id"] for j in b.submit_many([f"Story {i}-{k}:" for k in range(64)],
                                                 max_tokens=tokens, ignore_eos=True)]
    # The scheduler's batch is full of b's first wave (the worker's heartbeat counts the batch;
    # records say `running` from the start script on, so they also count b's sequences still
    # waiting in the engine for a slot).
    wait_until(lambda: engine_stats(r, worker.hostname) == (seqs, 0), 60,
               "b's first wave to fill the batch", interval=0.05)
    preempted_before = preemptions(r, worker.hostname)
    steps_before = steps(r, worker.hostname)
    job = a.submit(prompt="Hello", max_tokens=4, ignore_eos=True)
    wait_until(lambda: record(r, job["id"])["status"] != "queued", 30, "a's job to start",
               interval=0.05)
    steps_to_start = steps(r, worker.hostname) - steps_before
    done = a.wait_job(job["id"], 60)
    assert done["status"] == "succeeded", done
    unfinished = [s for s in flood if r.hget(f"llmq:seq:{s}", "status") not in FINISHED]
    print(f"a's job started after ~{steps_to_start} engine steps; b had {len(unfinished)} of "
          f"{len(flood)} sequences unfinished when it ended")
    # a took its slot from b (a fair-share preemption) while b's first wave still ran.
    assert preemptions(r, worker.hostname) > preempted_before
    assert len(unfinished) > len(flood) - seqs
    for seq_id in flood:
        job = b.wait_job(seq_id, 600)
        assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == tokens, job


def running(r, ids: list[str]) -> list[str]:
    return [i for i in ids if r.hget(f"llmq:seq:{i}", "status") == "running"]


def steps(r, hostname: str) -> int:
    return int(r.hget(f"llmq:worker:{hostname}", "num_steps") or 0)


def preemptions(r, hostname: str) -> int:
    return int(r.hget(f"llmq:worker:{hostname}", "num_preempted") or 0)


def engine_stats(r, hostname: str) -> tuple[int, int]:
    """(sequences in the scheduler's batch, sequences finished), from the worker's heartbeat."""
    h = r.hmget(f"llmq:worker:{hostname}", "running", "num_finished")
    return int(h[0] or 0), int(h[1] or 0)


# --- the HTTP server: header deadline, JSON for what gunicorn answers itself --------------------
@dataclass
class GunicornApi:
    port: int
    master: subprocess.Popen


@pytest.fixture
def gunicorn_api(world, tmp_path):
    """The API as `make api` runs it: gunicorn with app.http_worker.ThreadWorker."""
    import os
    import sys

    import requests

    from support import ROOT, free_port

    port = free_port()
    env = dict(os.environ, LLMQ_REDIS_URL=world.url, LLMQ_HEADER_TIMEOUT="1",
               LLMQ_WRITE_TIMEOUT="1", LLMQ_API_KEYS=",".join(KEYS))
    log = open(tmp_path / "gunicorn.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "--bind", f"127.0.0.1:{port}", "--worker-class",
         "app.http_worker.ThreadWorker", "--workers", "1", "--threads", "4", "--timeout", "0",
         "app.wsgi:application"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def up():
        assert proc.poll() is None, (tmp_path / "gunicorn.log").read_text()
        try:
            return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=2).ok
        except requests.RequestException:
            return False

    try:
        wait_until(up, 60, "gunicorn to answer")
        yield GunicornApi(port, proc)
    finally:
        proc.terminate()
        proc.wait(15)


def _raw(port: int, data: bytes, *, trickle_s: float = 0.0, sent: list | None = None) -> bytes:
    """Sends `data` (a byte at a time every trickle_s, if set) and reads until the server closes;
    `sent` gets how many bytes went out before the server hung up."""
    n = 0
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        try:
            for i in range(len(data)) if trickle_s else [None]:
                s.sendall(data if i is None else data[i:i + 1])
                n += len(data) if i is None else 1
                if trickle_s:
                    time.sleep(trickle_s)   # the slow client under test, not a synchronisation
        except OSError:
            pass   # the server hung up mid-send: what the deadline is for
        if sent is not None:
            sent.append(n)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


def test_headers_must_arrive_in_time_and_parse_errors_are_json(gunicorn_api):
    port = gunicorn_api.port
    # Headers that never end: the connection is closed (recv sees the end) well before 15 s.
    assert _raw(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n") == b""
    # A slowloris trickling a long header a byte at a time is cut off too.
    # (A per-read timeout, which each byte restarts, would take all 71 bytes in ~7 s.)
    slow, sent = b"GET /healthz HTTP/1.1\r\nX-Pad: " + b"a" * 40, []
    assert b"200 OK" not in _raw(port, slow, trickle_s=0.1, sent=sent)
    assert sent[0] < len(slow) - 20, sent
    for data, status in [(b"GET /" + b"x" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
                         (b"GET /healthz HTTP/1.1\r\n" + b"".join(
                             b"X-H%d: v\r\n" % i for i in range(200)) + b"\r\n", 431)]:
        head, _, body = _raw(port, data).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d" % status), head
        assert b"Content-Type: application/json" in head
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert b"200 OK" in _raw(port, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")


def test_a_key_past_its_refusals_is_answered_unread_and_its_connection_closed(gunicorn_api):
    """Past LLMQ_KEY_MAX_REFUSALS (30) bad bodies in a minute, a 1.4 MB body of that key is
    answered 429 from its headers: the server closes the connection without waiting for the
    rest of the body (which it would otherwise wait ~20 s for, at 64 kB/s, past _raw's 15 s)."""
    import requests

    port = gunicorn_api.port
    with requests.Session() as s:
        s.headers["Authorization"] = f"Bearer {KEYS[0]}"
        for _ in range(30):
            r = s.post(f"http://127.0.0.1:{port}/v1/jobs",
                       json={"prompt": "x", "stop_token_ids": list(range(65))})
            assert r.status_code == 400, r.text
    head = (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS[0].encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 1400000\r\n\r\n")
    answer = _raw(port, head + b'{"prompt": "x", "stop_token_ids": [' + b"1, " * 300)
    head_out, _, body = answer.partition(b"\r\n\r\n")
    assert head_out.startswith(b"HTTP/1.1 429"), answer[:300]
    assert b"Connection: close" in head_out and b"Retry-After: " in head_out
    assert json.loads(body)["error"]["code"] == "too_many_invalid_requests"
    # As an OpenAI client sees it: a RateLimitError naming the code, not a dropped connection.
    import openai

    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEYS[0], max_retries=0)
    with pytest.raises(openai.RateLimitError) as err:
        sdk.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}],
                                    logit_bias={str(i): 1 for i in range(400)})
    assert err.value.code == "too_many_invalid_requests"
    assert err.value.response.headers["Retry-After"]
    # The other key's bodies are still read and served.
    r = requests.post(f"http://127.0.0.1:{port}/v1/jobs", json={"prompt": "x", "max_tokens": 1},
                      headers={"Authorization": f"Bearer {KEYS[1]}"})
    assert r.status_code == 202, r.text


def test_a_body_must_arrive_in_time_too(gunicorn_api):
    """The deadline ended with the headers: a key holder announcing a body and never sending it
    held one of the API's threads for as long as it liked (all of them, with enough
    connections). 1 s + 20 kB at 64 kB/s: the server hangs up long before _raw's 15 s."""
    port = gunicorn_api.port
    head = (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS[0].encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 20000\r\n\r\n")
    cut = _raw(port, head + b'{"prompt": "')
    assert cut == b"" or cut.startswith(b"HTTP/1.1 400"), cut[:200]
    # A whole body, even a slow one within its allowance, is served (and keep-alive works).
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    ok = _raw(port, head.replace(b"20000", str(len(body)).encode()).replace(
        b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1) + body)
    assert ok.startswith(b"HTTP/1.1 202"), ok[:200]


def test_clients_that_stop_reading_free_their_threads_and_slots(world, gunicorn_api, tmp_path):
    """Clients that never read their streams: the writes fill the sockets and block. Past
    LLMQ_WRITE_TIMEOUT (1 s here) each is dropped, its slot given back and its thread freed:
    without the deadline all 4 of gunicorn's threads would stay stuck in their writes for good,
    and the API would answer nobody. Then a slot outlives no process: a killed API process's streams
    free themselves within a lease (15 s)."""
    import requests

    port, r = gunicorn_api.port, world.client()
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    resp = requests.post(f"{url}/v1/jobs", json={"prompt": "Hello", "max_tokens": 4},
                         headers=auth, timeout=15)
    jid = resp.json()["id"]                                # no worker: it stays queued
    slots = owner_streams_key(record(r, jid)["owner"])
    request = (f"GET /v1/jobs/{jid}/stream HTTP/1.1\r\nHost: x\r\n"
               f"Authorization: Bearer {KEYS[0]}\r\n\r\n").encode()
    readers = []
    try:
        for _ in range(4):                                 # one per gunicorn thread
            readers.append(_non_reader(port, request))
        wait_until(lambda: r.zcard(slots) == 4, 30, "the 4 streams to open")
        _flood(r, jid)
        sent = time.monotonic()
        wait_until(lambda: r.zcard(slots) == 0, 30, "the stuck streams' slots to come back")
        print(f"4 stuck streams dropped {time.monotonic() - sent:.1f} s after their events")
        assert requests.get(f"{url}/healthz", timeout=10).ok   # a thread answers again
        assert r.hget(f"llmq:seq:{jid}", "status") == "queued"   # a job's stream: no cancel
    finally:
        for s in readers:
            s.close()
    # A stream open when its API process is killed: its slot frees itself within a lease.
    stream = requests.get(f"{url}/v1/jobs/{jid}/stream", headers=auth, stream=True, timeout=15)
    assert stream.status_code == 200
    (worker,) = psutil.Process(gunicorn_api.master.pid).children()
    worker.kill()
    killed = time.monotonic()
    wait_until(lambda: r.zcount(slots, time.time(), "+inf") == 0, 25,
               "the dead process's slot to lapse", interval=0.2)
    print(f"the dead process's slot lapsed {time.monotonic() - killed:.1f} s after the kill")
    stream.close()
    log = (tmp_path / "gunicorn.log").read_text()
    assert "stopped reading" in log and "Socket error" not in log, log   # a warning each


def test_an_openai_stream_whose_client_stops_reading_is_cancelled(world):
    """As a client that hangs up: the write deadline drops the connection (under werkzeug, as
    the tests serve the app, here) and the OpenAI stream's request is cancelled."""
    from urllib.parse import urlparse

    base = world.api(api_keys=KEYS, write_timeout_s=1.0)
    a, r = base.with_key("key-a"), world.client()
    model = a.request("GET", "/v1/models").json()["data"][0]["id"]
    body = json.dumps({"model": model, "stream": True, "max_tokens": 16,
                       "messages": [{"role": "user", "content": "Hi"}]}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
               f"Authorization: Bearer {KEYS[0]}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with _non_reader(urlparse(base.url).port, request):
        (seq_id,) = wait_until(lambda: [k.removeprefix("llmq:seq:") for k in records(world)],
                               30, "the stream's sequence")
        slots = owner_streams_key(record(r, seq_id)["owner"])
        _flood(r, seq_id)
        wait_until(lambda: r.hget(f"llmq:seq:{seq_id}", "status") == "cancelled", 30,
                   "the stream's request to be cancelled")
        wait_until(lambda: r.zcard(slots) == 0, 15, "its slot to come back")


def _non_reader(port: int, request: bytes) -> socket.socket:
    """A client that sends `request` and never reads the answer (with a small window)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(request)
    return s


def _flood(r, seq_id: str) -> None:
    """32 MB of token events on the sequence's stream: far more than a socket takes, so the
    writes of a stream whose client does not read block."""
    pipe = r.pipeline()
    for _ in range(32):
        append_event(pipe, seq_id, EVENT_TOKEN, {"text": "x" * 2**20}, 20_000, 3600)
    pipe.execute()
