"""The API server: HTTP routes for jobs, generation and streams, and JSON errors."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import time
from typing import Any
from urllib.parse import urlsplit

import redis
from flask import Blueprint, Flask, Response, current_app, g, jsonify, request, stream_with_context
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

from common.llm_engine import Overloaded, TooLarge
from common.protocol import EVENT_DONE, SamplingParams
from common.webhook_guard import WebhookURLError
from common.webhook_store import owner_key, secret_of
from common.store import SequenceStore, is_seq_id, valid_stream_id

from . import submit_hooks
from .errors import APIError, error_response, failure_of
from .limits import check_limits
from .schemas import JobRequest, SamplingFields, ToolFields
from .waiting import WaitTimedOut, wait_or_cancel

bp = Blueprint("api", __name__)

_OPEN_PATHS = {"/health", "/healthz", "/readyz", "/"}   # and /static/: the playground page


def engine():
    return current_app.extensions["llmq"]["engine"]


def settings():
    return current_app.extensions["llmq"]["settings"]


# --- auth -------------------------------------------------------------------------------------
@bp.before_app_request
def _authenticate():
    g.owner, g.has_key, g.metrics_key = "", False, False
    s = settings()
    if not s.api_keys:
        _refuse_foreign_names()
        return None
    header = request.headers.get("Authorization", "")
    given = header[7:].strip() if header.lower().startswith("bearer ") else ""
    # Compare against every key in constant time, so timing tells nothing about which matched.
    g.has_key = bool(given) and _any_matches(given, s.api_keys)
    g.metrics_key = bool(given) and _any_matches(given, s.metrics_keys)
    if request.path in _OPEN_PATHS or request.path.startswith("/static/"):
        return None   # open; a metrics key only shows more (no Redis round trip for the owner)
    if request.path == "/metrics":
        if g.metrics_key:
            return None
        if g.has_key:   # the figures sum every key's traffic: one tenant would read the others'
            raise APIError(403, "this key may not read /metrics: it shows every key's traffic; "
                                "the server's scraper uses a key in LLMQ_METRICS_KEYS",
                           "permission_error")
    if not g.has_key:
        raise APIError(401, "missing or invalid API key", "authentication_error",
                       {"WWW-Authenticate": "Bearer"})
    g.owner = owner_id(given)
    return None


def _any_matches(given: str, keys: tuple[str, ...]) -> bool:
    return any([hmac.compare_digest(given.encode(), k.encode()) for k in keys])


_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def _refuse_foreign_names() -> None:
    """Without keys, a loopback bind is the only protection, and a browser on this machine can
    get around it: a page whose name re-resolves to 127.0.0.1 (DNS rebinding) is same-origin
    with the API and reads its jobs and files, and a cross-site form posts jobs without a
    preflight. Both carry a foreign name (Host, Origin), which a local client never does.
    A non-loopback LLMQ_HOST without keys is the operator's choice of an open API."""
    s = settings()
    if "*" in s.allowed_hosts or not _is_loopback(s.host) or request.path in _OPEN_PATHS:
        return
    names = {"Host": request.host}
    if origin := request.headers.get("Origin"):
        names["Origin"] = urlsplit(origin).netloc or origin   # ("null" from sandboxed pages)
    for header, value in names.items():
        name = urlsplit(f"//{value}").hostname or ""
        if name not in _LOOPBACK_NAMES and not name.endswith(".localhost") \
                and name not in s.allowed_hosts:
            raise APIError(403, f"this server has no API keys and answers only local names; "
                           f"{header} {value[:100]!r} is not one (set LLMQ_API_KEYS, or list "
                           "the name in LLMQ_ALLOWED_HOSTS)", "permission_error",
                           code="host_not_allowed")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def owner_id(key: str) -> str:
    """The name a key's records, rate windows and log lines carry: HMAC-SHA256 under the
    server's secret (LLMQ_OWNER_SECRET, else one made once in Redis), so a leaked log or record
    cannot be checked against guessed keys offline."""
    secret = settings().owner_secret
    if not secret:
        # Read again now and then: a Redis that lost it gets this one back (SET NX), and every
        # API replica converges on the one Redis holds.
        ext, now = current_app.extensions["llmq"], time.monotonic()
        cached, read_at = ext.get("owner_secret", ("", -1e9))
        if now - read_at > 30:
            cached = ext["store"].owner_secret(cached or None)
            ext["owner_secret"] = (cached, now)
        secret = cached
    return hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()[:32]


def authenticated() -> bool:
    """Whether this request may see service details (the workers and their counters, which
    reveal every key's load): a metrics key, or no keys configured."""
    return g.get("metrics_key", False) or not settings().api_keys


# --- parsing ----------------------------------------------------------------------------------
def _no_constant(name: str):
    raise APIError(400, f"request body is not valid JSON: {name} is not a JSON number")


def parse_json_body() -> dict:
    """The request body as a JSON object, or a 400 (415 for another media type) that says why
    not."""
    mimetype = request.mimetype
    if mimetype and mimetype != "application/json" and not mimetype.endswith("+json"):
        # As vLLM (FastAPI) refuses it. A cross-site form can post text/plain without a
        # preflight: to a server without keys beyond loopback it would queue jobs.
        raise APIError(415, f"request body must be JSON (Content-Type: application/json), "
                            f"not {mimetype[:100]}", code="unsupported_media_type")
    raw = request.get_data(cache=False)
    try:
        body = json.loads(raw or b"null", parse_constant=_no_constant)
        # Lone surrogates (\ud800) parse but cannot be stored or tokenized.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):   # over Python's 4300 digits
            raise APIError(400, "request body has a number too long") from None
        raise APIError(400, "request body is not valid JSON (UTF-8)") from None
    except UnicodeError:
        raise APIError(400, "request body is not valid JSON (UTF-8)") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def parse_job_request() -> JobRequest:
    body = parse_json_body()
    try:
        req = JobRequest.model_validate(body)
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]   # the field, as the OpenAI routes name it
        raise APIError(400, _describe(exc), param=str(loc[0]) if loc else None) from None
    return req   # the limits (lengths, counts, the context) are submit()'s check_limits


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def inputs_of(req: JobRequest) -> list[dict[str, Any]]:
    if req.prompts is not None:
        return [{"prompt": p} for p in req.prompts]
    if req.messages is not None:
        return [chat_input(req, [m.model_dump() for m in req.messages])]
    return [{"prompt": req.prompt}]


def chat_input(req: ToolFields, messages: list[dict]) -> dict[str, Any]:
    """The sequence input of a request's chat messages (the OpenAI route, a batch line,
    /v1/jobs), rendered for the model's chat template; a 400 when the tools' grammar cannot
    compile."""
    counter = engine().prompt_counter.get()
    inp = req.chat_input(messages, counter.template_source if counter else None,
                         settings().template_kwargs())
    if error := req.tools_error():
        raise APIError(400, f"cannot compile the tools' parameters: {error}", param="tools")
    return inp


def owned_params(req: SamplingFields, default_max_tokens: int,
                 max_tokens: int | None = None) -> SamplingParams:
    """The request's sampling parameters as the caller's: every route that queues work (a
    batch line too) builds them here. Cached prefixes are shared only within a key
    (cached_tokens would otherwise tell one key what another sent), so the key is put in front
    of the cache salt; the request's own salt still splits a key's cache further."""
    params = req.sampling_params(default_max_tokens, max_tokens)
    if g.owner and not settings().share_prefix_cache:
        params.cache_salt = g.owner + ("/" + params.cache_salt if params.cache_salt else "")
    return params


def submit(inputs: list[dict[str, Any]], req: SamplingFields,
           default_max_tokens: int | None = None, max_tokens: int | None = None,
           max_tokens_param: str = "max_tokens", n: int = 1) -> list[dict]:
    """Checks the request's limits and webhook, then queues one sequence per input with its
    sampling and queueing fields, owned by the caller (every submitting route, OpenAI's
    included, comes through here). `max_tokens` overrides the field (OpenAI's
    max_completion_tokens); with n > 1, n sequences per input, each with its own seed
    (input-major order)."""
    s, eng = settings(), engine()
    default_max_tokens = default_max_tokens or s.default_max_tokens
    check_limits(s, req, inputs, max_tokens=max_tokens or req.max_tokens,
                 default_max_tokens=default_max_tokens, counter=eng.prompt_counter.get(),
                 context_len=eng.context_length(), max_tokens_param=max_tokens_param)
    hook = checked_webhook(req)
    params = owned_params(req, default_max_tokens, max_tokens)
    if n > 1:
        inputs = [{**inp, "params": p} for inp in inputs for p in params.copies(n)]
    if getattr(req, "stream", False):
        take_stream_slot()
    # Indexed and hooked before the messages go: a failure there is a 503 with nothing queued
    # (after them, the 503 came for jobs that ran anyway, and a retry ran them twice).
    ext, owner = current_app.extensions["llmq"], g.owner
    return eng.submit(inputs, params, owner, req.timeout, req.priority,
                      before_queue=lambda jobs: submit_hooks.index_and_hook(ext, owner, jobs, hook),
                      unqueue=lambda ids: submit_hooks.unindex_and_unhook(ext, owner, ids, hook))


def checked_webhook(req) -> tuple[str, list[str]] | None:
    """The request's webhook (url, events), or None; a 400 when it is not allowed."""
    try:
        return submit_hooks.checked_webhook(req, settings())
    except WebhookURLError as exc:
        raise APIError(400, str(exc), param="webhook") from None


def find_job(seq_id: str) -> dict:
    # Checked by shape before it becomes part of a Redis key name ("<id>:events" names a
    # stream): a malformed id is unknown like any other.
    job = engine().get(seq_id, g.owner) if is_seq_id(seq_id) else None
    if job is None:
        raise APIError(404, f"no job with id {seq_id!r}", "not_found_error")
    return job


# --- routes -----------------------------------------------------------------------------------
@bp.post("/v1/jobs")
def create_jobs():
    req = parse_job_request()
    if req.stream:   # it answered 202 anyway, after taking one of the key's stream slots
        raise APIError(400, "/v1/jobs answers at once and does not stream: use /v1/generate "
                            "with 'stream', or follow a job at /v1/jobs/<id>/stream",
                       param="stream")
    return accepted(req, submit(inputs_of(req), req))


def accepted(req: JobRequest, jobs: list[dict]):
    """202 with the jobs as they stand: a list for `prompts`, else the one job and its URL."""
    if req.prompts is not None:
        return jsonify({"object": "list", "jobs": jobs}), 202
    return jsonify(jobs[0]), 202, {"Location": f"/v1/jobs/{jobs[0]['id']}"}


@bp.get("/v1/jobs/<seq_id>")
def get_job(seq_id: str):
    return jsonify(find_job(seq_id))


@bp.delete("/v1/jobs/<seq_id>")
def cancel_job(seq_id: str):
    find_job(seq_id)
    return jsonify(engine().cancel(seq_id, g.owner))


@bp.get("/v1/jobs/<seq_id>/stream")
def stream_job(seq_id: str):
    find_job(seq_id)
    last = request.headers.get("Last-Event-ID") or request.args.get("last_event_id") or "0-0"
    if not valid_stream_id(last):
        raise APIError(400, "Last-Event-ID must be a stream id like 1700000000000-0",
                       param="last_event_id")
    if engine().is_over(seq_id, last):
        # Resumed at (or past) the done event, as EventSource does after the server closed:
        # nothing will follow, and 204 is what tells EventSource to stop reconnecting.
        return Response(status=204, headers={"X-Request-Id": seq_id})
    take_stream_slot()
    return sse_response(seq_id, last)


@bp.post("/v1/generate")
def generate():
    req = parse_job_request()
    if req.stream and req.prompts is not None:
        raise APIError(400, "'stream' works with one prompt; use /v1/jobs for a batch")
    jobs = submit(inputs_of(req), req)
    if req.stream:
        # The stream holds the id and can be resumed (/v1/jobs/<id>/stream, Last-Event-ID):
        # a client that hangs up does not cancel it; it runs to its end like any job.
        return sse_response(jobs[0]["id"], "0-0")
    try:
        results = wait_or_cancel([j["id"] for j in jobs], cancel_on_timeout=False)
    except WaitTimedOut:
        # Still running after LLMQ_WAIT_TIMEOUT: their ids let the caller follow them; they
        # run on.
        return accepted(req, [find_job(j["id"]) for j in jobs])
    failures = [failure_of(r) for r in results]
    if all(failures):
        # Nothing came of the request: the first failure's status and error, with the records
        err = failures[0]
        extra = {"results": results} if req.prompts is not None else {"job": results[0]}
        return error_response(err.status, err.message, err.type, param=err.param,
                              code=err.code, **extra)
    if req.prompts is not None:
        return jsonify({"object": "list", "results": results})
    return jsonify(results[0])


@bp.get("/v1/webhooks/secret")
def webhook_secret():
    """The key that signs this API key's webhook events (its own: no other key's events verify
    with it), written as Standard Webhooks' libraries take it."""
    s = settings()
    if not s.webhook_secret:
        raise APIError(404, "webhooks are not enabled on this server (LLMQ_WEBHOOK_SECRET)",
                       "not_found_error", code="webhooks_disabled")
    return jsonify({"object": "webhook_secret",
                    "secret": secret_of(owner_key(s.webhook_key(), g.owner))})


# --- health -----------------------------------------------------------------------------------
# Open to anyone, so they say only ready or not: no counters (a request's size could be read off
# them), worker names, hosts or error text. An authenticated caller also gets the workers. Their
# Redis round trips give up after LLMQ_HEALTH_TIMEOUT, so a hung Redis is a fast 503.
@bp.get("/health")
def health():
    """vLLM's route (its benchmark client polls it): 200 with an empty body when ready."""
    ready, _workers = _readiness()
    return Response(status=200 if ready else 503)


@bp.get("/healthz")
def healthz():
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz():
    ready, workers = _readiness()
    body: dict[str, Any] = {"status": "ready" if ready else "unavailable"}
    if authenticated():   # why, and who: only for a metrics key (or with no keys configured)
        if workers is None:
            body["reason"] = "redis unavailable"
        elif not ready:
            body["reason"] = "no worker with the model loaded"
        if workers is not None:
            body["workers"] = workers
    return jsonify(body), 200 if ready else 503


def _readiness() -> tuple[bool, list[dict] | None]:
    """(ready, the workers with the model loaded; None when Redis did not answer)."""
    ext = current_app.extensions["llmq"]
    try:
        workers = ext["health_store"].live_workers(settings().worker_stale_s)
    except redis.RedisError as exc:
        current_app.logger.warning("readiness: redis unavailable: %s", exc)
        return False, None
    loaded = [w for w in workers if w.get("model_loaded") == "1"]
    return bool(loaded), loaded


def health_store(s, client=None) -> SequenceStore:
    """A store whose Redis client gives up after LLMQ_HEALTH_TIMEOUT (the main one waits out
    long stream reads)."""
    client = client or redis.Redis.from_url(
        s.redis_url, decode_responses=True, socket_timeout=s.health_timeout_s,
        socket_connect_timeout=s.health_timeout_s, retry_on_timeout=False, max_connections=64)
    return SequenceStore(client)


# --- SSE --------------------------------------------------------------------------------------
def format_sse(entry_id: str, kind: str, data: dict) -> str:
    return f"id: {entry_id}\nevent: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse_response(seq_id: str, after: str) -> Response:
    eng, keepalive = engine(), settings().sse_keepalive_s

    def gen():
        yield "retry: 1000\n\n"
        for ev in eng.events(seq_id, after, keepalive_s=keepalive):
            if ev is None:
                yield ": keep-alive\n\n"
                continue
            yield format_sse(*ev)
            if ev[1] == EVENT_DONE:
                return

    return Response(stream_with_context(gen()), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                             "X-Request-Id": seq_id})


# --- per-key stream cap ------------------------------------------------------------------------
class StreamSlot:
    """One of a key's LLMQ_KEY_MAX_STREAMS open streams. Taken before the route does anything
    (a streamed submission is refused before its job exists) and held by the response until it
    ends. Slots are leases in Redis, renewed as the stream runs, so those of an API process
    that died free themselves."""

    def __init__(self, store: SequenceStore, owner: str, token: str, lease_s: float):
        self.store, self.owner, self.token, self.lease_s = store, owner, token, lease_s

    def hold(self, chunks):
        """The response body, passed through; the slot lives until the body is closed (the
        stream ended or its client went away)."""
        renewed = time.monotonic()
        try:
            for chunk in chunks:
                if time.monotonic() - renewed > self.lease_s / 3:   # keep-alives come often
                    renewed = time.monotonic()
                    try:
                        self.store.renew_stream(self.owner, self.token, self.lease_s)
                    except redis.RedisError:
                        pass   # Redis is down: the stream itself says so, or rides it out
                yield chunk
        finally:
            if hasattr(chunks, "close"):
                chunks.close()   # the route's own clean-up (a hang-up cancels its job)
            self.close()

    def close(self) -> None:
        try:
            self.store.close_stream(self.owner, self.token)
        except redis.RedisError:
            pass   # the lease runs out by itself


def take_stream_slot() -> None:
    """Takes a stream slot for the caller's key (429 when it has LLMQ_KEY_MAX_STREAMS open);
    the response holds it. Keys only: without them there are no tenants to keep apart."""
    s = settings()
    if not (g.owner and s.key_max_streams) or "stream_slot" in g:
        return
    lease = 3 * s.sse_keepalive_s + 10   # a stream writes at least every keep-alive
    store = engine().store
    token = store.open_stream(g.owner, s.key_max_streams, lease)
    if token is None:
        raise APIError(429, f"this key has {s.key_max_streams} streams open "
                            "(LLMQ_KEY_MAX_STREAMS); close one first", "rate_limit_error",
                       {"Retry-After": "5"}, code="too_many_streams")
    g.stream_slot = StreamSlot(store, g.owner, token, lease)


@bp.after_app_request
def _hand_stream_slot_to_response(resp: Response) -> Response:
    slot = g.pop("stream_slot", None)
    if slot is None:
        return resp
    if resp.is_streamed and resp.mimetype == "text/event-stream":
        resp.response = slot.hold(resp.response)
        # A HEAD's body is never iterated, so hold()'s own close never runs; this does.
        resp.call_on_close(slot.close)
    else:
        slot.close()   # an error, or an answer that was not a stream after all
    return resp


# --- errors -----------------------------------------------------------------------------------
def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.headers, exc.param, exc.code)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error"}.get(exc.code, "invalid_request_error")
        return error_response(exc.code or 400, exc.description or exc.name, kind)

    @app.errorhandler(TooLarge)
    def _too_large(exc: TooLarge):
        return error_response(400, str(exc), "invalid_request_error", code="request_too_large")

    @app.errorhandler(Overloaded)
    def _overloaded(exc: Overloaded):
        return error_response(429, str(exc), "rate_limit_error",
                              {"Retry-After": str(exc.retry_after_s)}, code=exc.code)

    @app.errorhandler(redis.RedisError)
    def _redis_down(exc):
        current_app.logger.warning("redis unavailable: %s", exc)
        return error_response(503, "the queue is unavailable; retry shortly",
                              "service_unavailable", {"Retry-After": "2"})

    @app.errorhandler(Exception)
    def _unexpected(exc):
        # Celery's kombu wraps broker outages in its own errors.
        if type(exc).__module__.startswith(("kombu", "redis")) or isinstance(exc, ConnectionError):
            return _redis_down(exc)
        current_app.logger.exception("unhandled error")
        return error_response(500, "internal error", "server_error")
