"""A deadline on writing a response: a client that stops reading loses its connection instead
of holding one of the API's threads."""
from __future__ import annotations

import socket
import struct

from .client_connection import connection_socket


class WriteTimeout:
    """WSGI middleware that gives each request's socket a send timeout (SO_SNDTIMEO) of
    LLMQ_WRITE_TIMEOUT. A client that stops reading (a big answer, or an SSE stream) fills its
    window and the socket's send buffer, and a write then blocks; past the timeout without a
    byte moving, the write fails, so the server (gunicorn's gthread worker, werkzeug's) drops
    the connection and closes the response: a stream's clean-up runs as for a hang-up, its
    slot is let go and the thread is free. SO_SNDTIMEO and not socket.settimeout: it leaves
    reads alone (the body has its own deadline, app/http_worker.py), and each send that moves
    bytes starts it again (as nginx's send_timeout), where settimeout bounds a whole sendall,
    which would cut off an honest slow client downloading a large answer."""

    def __init__(self, app, timeout_s: float):
        self.app = app
        seconds = int(timeout_s)
        micros = max(int((timeout_s - seconds) * 1e6), 0 if seconds else 1)   # 0 0: no timeout
        self._timeval = struct.pack("ll", seconds, micros)

    def __call__(self, environ, start_response):
        sock = connection_socket(environ)
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, self._timeval)
            except OSError:
                pass   # the client is gone already: the first write says so
        return self.app(environ, start_response)
