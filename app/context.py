"""The app's clients, as the routes reach them: the settings and the LLM engine (the API's
side of the queue: submit, read, cancel), kept in app.extensions by create_app."""
from __future__ import annotations

from flask import current_app


def engine():
    return current_app.extensions["llmq"]["engine"]


def settings():
    return current_app.extensions["llmq"]["settings"]
