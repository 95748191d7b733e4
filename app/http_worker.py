"""The gunicorn worker the API runs under (`--worker-class app.http_worker.ThreadWorker`):
gunicorn's gthread worker, plus a deadline on reading a request's headers and JSON bodies for
the errors gunicorn answers before the app sees a request."""
from __future__ import annotations

import json
import socket
import threading
import time

from gunicorn.http import errors
from gunicorn.workers.gthread import ThreadWorker as GThreadWorker

from common.settings import Settings

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


class ThreadWorker(GThreadWorker):
    """gthread, where a client gets LLMQ_HEADER_TIMEOUT seconds to send its request line and
    headers: one that trickles them (a slowloris) loses its connection instead of holding one
    of the process's threads for as long as it likes."""

    def init_process(self):
        self.header_timeout_s = Settings.from_env().header_timeout_s
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
        with self._reading_lock:   # headers are in: from here on the request is the app's
            self._reading.pop(conn, None)
        return super().handle_request(req, conn)

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
