"""The llmq API: create_app(settings) builds the Flask app (app/api_server.py)."""
from __future__ import annotations

from .api_server import create_app

__all__ = ["create_app"]
