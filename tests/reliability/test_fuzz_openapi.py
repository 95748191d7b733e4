"""Fuzzing the HTTP API from its own OpenAPI document (schemathesis, bounded and derandomized).

The app is the real one (create_app) over fakeredis, with a Celery stand-in whose send_task
finishes each sequence at once the way a worker would (an atomic finish: record, done event),
so the routes that wait for a result (/v1/generate, /v1/completions, /v1/chat/completions)
answer immediately too. Streaming requests (text/event-stream) are not JSON and are left out:
the /stream route is excluded and cases that ask for "stream": true are not sent.

Checks on every generated request: no 5xx, a status code the document declares, its
content type, and a body that conforms to the declared response schema.
"""
from __future__ import annotations

import fakeredis
import schemathesis
from hypothesis import HealthCheck, settings as hsettings
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               response_schema_conformance,
                                               status_code_conformance)
from schemathesis.checks import not_a_server_error

from common.protocol import FinishReason
from common.settings import Settings
from common.store import SequenceStore

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


class InstantWorker:
    """Stands in for Celery: every sent sequence is finished at once, as a worker finishes it."""

    def __init__(self):
        self.store: SequenceStore | None = None
        self.sent: list[str] = []

    def send_task(self, name, args=(), **_kw):
        seq_id = args[0]
        self.sent.append(seq_id)
        self.store.finish(seq_id, FinishReason.LENGTH, text="ok", completion_tokens=1)


def build_app():
    from app import create_app

    client = fakeredis.FakeRedis(decode_responses=True)
    worker = InstantWorker()
    settings = Settings.from_env(redis_url="redis://fake/0", model="tiny-test-model",
                                 wait_timeout_s=5.0, sse_keepalive_s=0.2, api_keys=(),
                                 worker_stale_s=3600.0)
    app = create_app(settings, redis_client=client, celery=worker)
    worker.store = app.extensions["llmq"]["store"]
    # A live worker with its model loaded, so /readyz has something to report (its 503 is
    # the stuck-engine test's business).
    worker.store.heartbeat("fuzz@test", {"model": "tiny-test-model", "model_loaded": 1},
                           ttl_s=3600)
    return app, worker


def load_schema(app):
    # Streams are text/event-stream, not JSON; /metrics is Prometheus text and / the HTML
    # playground (neither documents a response).
    return schemathesis.openapi.from_wsgi("/openapi.json", app).exclude(
        path_regex=r"/stream$").exclude(path=["/metrics", "/"])


# Built at import (schemathesis.pytest.from_fixture needs pytest internals that pytest 9 no
# longer has); fakeredis in memory, no process, no port.
APP, WORKER = build_app()
schema = load_schema(APP)


def _asks_for_a_stream(case) -> bool:
    return isinstance(case.body, dict) and bool(case.body.get("stream"))


@schema.parametrize()
@hsettings(max_examples=30, derandomize=True, deadline=None, database=None,
           suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_openapi_document(case):
    if _asks_for_a_stream(case):
        return   # an SSE response, checked by the streaming tests
    case.call_and_validate(checks=CHECKS)


def test_the_fuzzed_operations_cover_the_json_api():
    """The fuzz test above must not silently shrink to nothing: it covers these operations,
    and a valid request through the stand-in worker gets its result (not a wait, not a 5xx)."""
    app, worker = build_app()
    r = app.test_client().post("/v1/generate", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.get_data(as_text=True)
    assert r.get_json()["status"] == "succeeded" and worker.sent == [r.get_json()["id"]]
    loaded = load_schema(app)
    ops = {f"{op.ok().method.upper()} {op.ok().path}" for op in loaded.get_all_operations()}
    for expected in ("POST /v1/jobs", "GET /v1/jobs/{seq_id}", "DELETE /v1/jobs/{seq_id}",
                     "POST /v1/generate", "GET /healthz", "GET /readyz",
                     "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"):
        assert expected in ops, sorted(ops)
