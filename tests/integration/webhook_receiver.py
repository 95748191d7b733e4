"""A webhook receiver on loopback that verifies Standard Webhooks signatures on its own (it
shares no code with llmq's signer) and records what arrived."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.attacks import SilentReceiver  # noqa: F401 - the webhook tests' silent receiver


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


@dataclass
class Delivery:
    """One POST as received: headers, body, and whether its signature checked out."""

    path: str
    webhook_id: str
    timestamp: str
    signature_ok: bool
    body: dict
    raw: bytes = b""                                   # as sent (for an SDK's own check)
    headers: dict = field(default_factory=dict)


class WebhookReceiver:
    """Answers `fail_first` POSTs per webhook id with 500, then 200."""

    def __init__(self, secret: str, fail_first: int = 0):
        self.key = base64.b64decode(secret.removeprefix("whsec_"))
        self.fail_first = fail_first
        self.deliveries: list[Delivery] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver._record(self.path, self.headers, raw)
                with receiver.lock:
                    seen = sum(d.webhook_id == self.headers.get("webhook-id")
                               for d in receiver.deliveries)
                self.send_response(500 if seen <= receiver.fail_first else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _record(self, path: str, headers, raw: bytes) -> None:
        msg_id, stamp = headers.get("webhook-id", ""), headers.get("webhook-timestamp", "")
        expected = base64.b64encode(hmac.new(self.key, f"{msg_id}.{stamp}.".encode() + raw,
                                             hashlib.sha256).digest()).decode()
        given = [s.split(",", 1)[1] for s in headers.get("webhook-signature", "").split()
                 if s.startswith("v1,")]
        ok = any(hmac.compare_digest(expected, g) for g in given)
        with self.lock:
            self.deliveries.append(Delivery(path, msg_id, stamp, ok, json.loads(raw), raw,
                                            dict(headers.items())))

    def of_type(self, event_type: str) -> list[Delivery]:
        with self.lock:
            return [d for d in self.deliveries if d.body.get("type") == event_type]

    def stop(self) -> None:
        self.server.shutdown()


