"""Structured logs: one JSON object per line, carrying seq_id wherever a sequence is involved,
so `grep <seq_id>` over the API, worker and model-process logs tells one request's story."""
from __future__ import annotations

import json
import logging
import os
import sys
import time

_STD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as JSON; `extra={...}` fields (seq_id, seq_ids, ...) become keys."""

    def __init__(self, component: str):
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
               "level": record.levelname.lower(), "component": self.component,
               "pid": record.process, "logger": record.name, "msg": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _STD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(component: str, level: str | None = None, stream=None) -> None:
    """Routes the root logger through one JSON handler (idempotent)."""
    root = logging.getLogger()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(component))
    root.handlers = [handler]
    # (upper-cased: Celery's --loglevel takes "debug", and the same variable feeds both)
    root.setLevel((level or os.environ.get("LLMQ_LOG_LEVEL", "INFO")).upper())


def use_json(handlers, component: str) -> None:
    """Puts the JSON formatter on existing handlers (Celery sets up its own)."""
    for h in handlers:
        h.setFormatter(JsonFormatter(component))
