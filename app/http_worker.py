"""The gunicorn worker the API runs under (`--worker-class app.http_worker.ThreadWorker`):
gunicorn's gthread worker, plus deadlines on reading a request's headers and its body, the app's
`Connection: close` honoured, a client that stops reading its response dropped quietly, and JSON
bodies for the errors gunicorn answers before the app sees a request."""
from __future__ import annotations

import json
import socket
import ssl
import struct
import threading
import time

from gunicorn.http import errors
from gunicorn.workers.gthread import ThreadWorker as GThreadWorker

from common.settings import Settings

# A body must arrive at least this fast (after LLMQ_HEADER_TIMEOUT's allowance): a 2 MB JSON
# body gets ~40 s, a 32 MB batch file ~9 minutes.
MIN_BODY_BYTES_PER_S = 64 * 1024


class _WatchedBody:
    """A request body that calls `done` once it has been read to its end (its length, or the
    end of a chunked body): the body's deadline then ends."""

    def __init__(self, body, length: int | None, done):
        self._body, self._left, self._done = body, length, done

    def _seen(self, data: bytes, asked) -> bytes:
        if self._left is not None:
            self._left -= len(data)
        if not data and asked != 0 or self._left is not None and self._left <= 0:
            self._done()
        return data

    def read(self, size=None):
        return self._seen(self._body.read(size), size)

    def readline(self, size=None):
        return self._seen(self._body.readline(size), size)

    def readlines(self, size=None):
        lines = self._body.readlines(size)
        self._seen(b"".join(lines), None)
        return lines

    def __iter__(self):
        return self

    def __next__(self):
        line = self.readline()
        if not line:
            raise StopIteration
        return line


def _reset(sock) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass   # closed already


# Errors gunicorn's parser raises, answered in the API's one error shape.
_PARSE_ERRORS = {
    errors.LimitRequestLine: (414, "URI Too Long"),
    errors.LimitRequestHeaders: (431, "Request Header Fields Too Large"),
    errors.InvalidRequestLine: (400, "Bad Request"),
    errors.InvalidRequestMethod: (400, "Bad Request"),
    errors.InvalidHTTPVersion: (400, "Bad Request"),
    errors.InvalidHeader: (400, "Bad Request"),
    errors.InvalidHeaderName: (400, "Bad Request"),
}


def _closing_when_told(app):
    """The WSGI app, whose `Connection: close` closes the connection after its answer: gunicorn
    drops the header as hop-by-hop and would keep the connection, reading an unread body to
    its end (or 64 kB of it) to find the next request. A request refused before its body was
    read (app/key_budget.py) need not be read at all."""
    def wsgi(environ, start_response):
        def start(status, headers, exc_info=None):
            if any(n.lower() == "connection" and v.strip().lower() == "close"
                   for n, v in headers):
                answer = getattr(start_response, "__self__", None)   # gunicorn's Response
                if hasattr(answer, "force_close"):
                    answer.force_close()
            return start_response(status, headers, exc_info)
        return app(environ, start)
    return wsgi


class ThreadWorker(GThreadWorker):
    """gthread, where a client gets LLMQ_HEADER_TIMEOUT seconds to send its request line and
    headers, and then its body at MIN_BODY_BYTES_PER_S: one that trickles either (a slowloris)
    loses its connection instead of holding one of the process's threads for as long as it
    likes; where the app's `Connection: close` closes the connection; and where one that stops
    reading its response is dropped with a warning, not a traceback."""

    def load_wsgi(self):
        super().load_wsgi()
        self.wsgi = _closing_when_told(self.wsgi)

    def init_process(self):
        s = Settings.from_env()
        self.header_timeout_s = s.header_timeout_s
        self.max_body_bytes = max(s.max_body_bytes, s.file_max_bytes)
        self._reading: dict = {}   # connection -> when its headers must be in
        self._reading_lock = threading.Lock()
        threading.Thread(target=self._enforce_header_deadlines, name="llmq-header-deadline",
                         daemon=True).start()
        super().init_process()

    def handle(self, conn):
        with self._reading_lock:
            self._reading[conn] = time.monotonic() + self.header_timeout_s
        try:
            return super().handle(conn)
        finally:
            with self._reading_lock:
                self._reading.pop(conn, None)

    def handle_request(self, req, conn):
        # The headers are in. A body gets a deadline by its size, until the app has read it to
        # its end: it was the app's from here on, and one trickled in held the thread for ever
        # (the app reads the body before it answers, with keys too).
        length = next((int(v) for n, v in req.headers if n == "CONTENT-LENGTH"), None)
        chunked = any(n == "TRANSFER-ENCODING" for n, _ in req.headers)
        done = lambda: self._stop_watching(conn)   # noqa: E731
        if length or chunked:
            size = length if length else self.max_body_bytes
            with self._reading_lock:
                self._reading[conn] = (time.monotonic() + self.header_timeout_s
                                       + size / MIN_BODY_BYTES_PER_S)
            req.body = _WatchedBody(req.body, length, done)
        else:
            done()
        try:
            return super().handle_request(req, conn)
        except (BlockingIOError, ssl.SSLWantWriteError):
            # A write moved no byte for LLMQ_WRITE_TIMEOUT (the socket's SO_SNDTIMEO, set by
            # app/write_timeout.py; over TLS, OpenSSL's want-write): the client stopped
            # reading. The response is closed already (a stream's clean-up ran); the
            # connection is reset rather than closed, so the kernel does not keep what the
            # client never read.
            self.log.warning("dropped a client that stopped reading its response: %s %s",
                             req.method, req.path)
            _reset(conn.sock)
            return False
        finally:
            done()

    def _stop_watching(self, conn) -> None:
        with self._reading_lock:
            self._reading.pop(conn, None)

    def _enforce_header_deadlines(self) -> None:
        """Shuts the reading side of connections past their deadline: the parser sees the end
        of the stream and gunicorn drops the connection as a client that went away."""
        interval = min(1.0, self.header_timeout_s / 4)
        while True:
            time.sleep(interval)
            now = time.monotonic()
            with self._reading_lock:
                late = [c for c, deadline in self._reading.items() if deadline < now]
                for c in late:
                    del self._reading[c]
            for conn in late:
                try:
                    conn.sock.shutdown(socket.SHUT_RD)
                except OSError:
                    pass   # already closed

    def handle_error(self, req, client, addr, exc):
        status = next((v for t, v in _PARSE_ERRORS.items() if isinstance(exc, t)), None)
        if status is None:
            return super().handle_error(req, client, addr, exc)
        self.log.warning("invalid request from %s: %s", addr[0] if addr else "?", exc)
        code, reason = status
        body = json.dumps({"error": {"message": f"{reason}: {exc}", "type":
                                     "invalid_request_error", "param": None, "code": None}})
        head = (f"HTTP/1.1 {code} {reason}\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        try:
            client.sendall((head + body).encode())
        except OSError:
            pass
        return None
