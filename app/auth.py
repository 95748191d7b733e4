"""Who is calling: API keys on every route but the open ones, the metrics keys, the owner id a
key's records carry, and, without keys, the local-names guard of a loopback bind."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from urllib.parse import urlsplit

from flask import Flask, current_app, g, request

from .context import settings
from .errors import APIError

OPEN_PATHS = {"/health", "/healthz", "/readyz", "/"}   # and /static/: the playground page


def init_app(app: Flask) -> None:
    app.before_request(authenticate)


def authenticate():
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
    if request.path in OPEN_PATHS or request.path.startswith("/static/"):
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
    if "*" in s.allowed_hosts or not _is_loopback(s.host) or request.path in OPEN_PATHS:
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
