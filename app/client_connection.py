"""Telling whether the HTTP client is still there, from inside a WSGI request."""
from __future__ import annotations

import select
import socket

from flask import request


def client_gone() -> bool:
    """True once the client closed its connection. gunicorn and werkzeug expose the socket in
    the WSGI environ; a readable socket that reads zero bytes (peeking) has been closed."""
    sock = request.environ.get("gunicorn.socket") or request.environ.get("werkzeug.socket")
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (OSError, ValueError):
        return True
