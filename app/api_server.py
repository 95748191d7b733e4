"""The API server: create_app builds the Flask app from its parts, each in its own module.

auth (API keys, owners, the local-names guard), key_budget (what a key's refused requests and
grammar compiles cost it), streaming (the per-key caps on streams and waiting requests) and
write_timeout (a deadline on each response write) act on every request; the routes come in
blueprints: jobs_api (llmq's jobs), openai_api (OpenAI's completions, chat and models),
responses_api, batches_api and files_api (OpenAI's Batch API), jobs_list_api, tokenize_api,
health_api and metrics; errors renders every failure in one shape.
Every submitting route queues through submit.py.
"""
from __future__ import annotations

from flask import Flask

from common.settings import Settings


def create_app(settings: Settings | None = None, *, redis_client=None, celery=None) -> Flask:
    """Builds the app: settings from LLMQ_* (or given), one Redis client, one Celery client."""
    from celery import Celery

    from common.llm_engine import LLMEngine
    from common.store import SequenceStore

    from . import (auth, batches_api, errors, files_api, health_api, idempotency, jobs_api,
                   jobs_list_api, key_budget, metrics, openapi, responses_api, streaming,
                   tokenize_api)
    from .openai_api import bp as openai_bp
    from .write_timeout import WriteTimeout

    settings = settings or Settings.from_env()
    app = Flask(__name__)
    app.wsgi_app = WriteTimeout(app.wsgi_app, settings.write_timeout_s)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.ensure_ascii = False
    app.json.sort_keys = False
    store = SequenceStore.from_settings(settings, client=redis_client)
    if celery is None:
        from common.celery_config import celery_config

        celery = Celery("llmq-api")
        celery.conf.update(celery_config(settings))
    app.extensions["llmq"] = {"settings": settings, "store": store,
                              "engine": LLMEngine(settings, store, celery),
                              "health_store": health_api.health_store(settings, redis_client)}
    auth.init_app(app)
    key_budget.init_app(app)   # after auth (the owner), before anything reads the body
    streaming.init_app(app)
    idempotency.init_app(app)   # after auth: authentication names the owner first
    app.register_blueprint(jobs_api.bp)
    app.register_blueprint(health_api.bp)
    app.register_blueprint(openai_bp)
    for feature in (jobs_list_api, files_api, batches_api, responses_api, tokenize_api):
        feature.init_app(app)
    metrics.init_app(app)
    openapi.init_app(app)

    @app.get("/")
    def playground():
        return app.send_static_file("playground.html")
    errors.init_app(app)
    return app
