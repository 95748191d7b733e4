"""A small Server-Sent Events reader for the integration tests (bytes in, events out).

It splits the raw body on newlines before decoding, so a multi-byte character that arrives in
two TCP chunks is never decoded half-way (which `iter_lines(decode_unicode=True)` can do).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator

import requests


@dataclass
class Event:
    event: str = "message"
    data: str = ""
    id: str | None = None

    @property
    def json(self):
        return json.loads(self.data)


@dataclass
class Stream:
    """What one SSE connection showed: its response, the events, and what else came."""

    response: requests.Response
    events: list[Event] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)
    retry: int | None = None

    @property
    def tokens(self) -> list[Event]:
        return [e for e in self.events if e.event == "token"]

    @property
    def texts(self) -> list[str]:
        return [e.json["text"] for e in self.tokens]

    @property
    def done(self) -> Event | None:
        return next((e for e in self.events if e.event == "done"), None)


def _lines(resp: requests.Response) -> Iterator[str]:
    buf = b""
    for chunk in resp.iter_content(chunk_size=None):
        buf += chunk
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line, buf = buf[:nl], buf[nl + 1:]
            if line.endswith(b"\r"):
                line = line[:-1]
            yield line.decode("utf-8")   # strict: a broken UTF-8 sequence fails the test
    if buf:
        yield buf.decode("utf-8")


def iter_events(resp: requests.Response, stream: Stream | None = None) -> Iterator[Event]:
    """Parses the body as SSE (WHATWG rules for the fields this server writes)."""
    ev, data, seen = Event(), [], False
    for line in _lines(resp):
        if line == "":
            if seen and data:
                ev.data = "\n".join(data)
                yield ev
            ev, data, seen = Event(), [], False
            continue
        if line.startswith(":"):
            if stream is not None:
                stream.comments.append(line[1:].strip())
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        seen = True
        if name == "event":
            ev.event = value
        elif name == "data":
            data.append(value)
        elif name == "id":
            ev.id = value
        elif name == "retry" and value.isdigit() and stream is not None:
            stream.retry = int(value)


def open_stream(url: str, last_event_id: str | None = None, timeout: float = 120.0,
                **kw) -> requests.Response:
    headers = dict(kw.pop("headers", {}) or {})
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    method = kw.pop("method", "GET")
    resp = requests.request(method, url, headers=headers, stream=True, timeout=timeout, **kw)
    return resp


def read_stream(url: str, last_event_id: str | None = None, timeout: float = 120.0,
                **kw) -> Stream:
    """Reads a whole SSE stream until its `done` event (or until the server closes it)."""
    resp = open_stream(url, last_event_id, timeout, **kw)
    out = Stream(resp)
    try:
        assert resp.status_code == 200, resp.text
        assert resp.headers["Content-Type"].startswith("text/event-stream"), resp.headers
        for ev in iter_events(resp, out):
            out.events.append(ev)
            if ev.event == "done":
                break
    finally:
        resp.close()
    return out
