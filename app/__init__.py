"""The llmq API: create_app(settings) builds the Flask app with its clients in app.extensions."""
from __future__ import annotations

from flask import Flask

from common.settings import Settings


def create_app(settings: Settings | None = None, *, redis_client=None, celery=None) -> Flask:
    """Builds the app: settings from LLMQ_* (or given), one Redis client, one Celery client."""
    from celery import Celery

    from common.llm_engine import LLMEngine
    from common.store import SequenceStore

    from .api_server import bp, health_store, register_error_handlers
    from . import (batches_api, files_api, idempotency, jobs_list_api, metrics, openapi,
                   responses_api, tokenize_api)
    from .openai_api import bp as openai_bp

    settings = settings or Settings.from_env()
    app = Flask(__name__)
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
                              "health_store": health_store(settings, redis_client)}
    app.register_blueprint(bp)
    idempotency.init_app(app)   # after bp: its authentication names the owner first
    app.register_blueprint(openai_bp)
    for feature in (jobs_list_api, files_api, batches_api, responses_api, tokenize_api):
        feature.init_app(app)
    metrics.init_app(app)
    openapi.init_app(app)

    @app.get("/")
    def playground():
        return app.send_static_file("playground.html")
    register_error_handlers(app)
    return app
