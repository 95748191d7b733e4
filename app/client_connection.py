"""Telling whether the HTTP client is still there, from inside a WSGI request."""
from __future__ import annotations

import select
import socket

from flask import request


def connection_socket(environ: dict) -> socket.socket | None:
    """The request's client socket: gunicorn and werkzeug expose it in the WSGI environ."""
    return environ.get("gunicorn.socket") or environ.get("werkzeug.socket")


def client_gone() -> bool:
    """True once the client closed its connection: a readable socket that reads zero bytes
    (peeking) has been closed."""
    sock = connection_socket(request.environ)
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (OSError, ValueError):
        return True
