"""GET /metrics: Prometheus text built from what every worker records in Redis."""
from __future__ import annotations

import math

from flask import Blueprint, Response, current_app
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from common.metrics import COUNTERS, HISTOGRAMS, SUCCESS_COUNTER

bp = Blueprint("metrics", __name__)
PREFIX = "llmq_"


class ServiceCollector:
    """A prometheus_client collector that reads the shared figures from Redis at scrape time."""

    def __init__(self, store, settings):
        self.store, self.settings = store, settings

    def collect(self):
        snap = self.store.metrics_snapshot()
        for name, (help_, _b) in HISTOGRAMS.items():
            buckets, total, count = snap["histograms"][name]
            fam = HistogramMetricFamily(PREFIX + name, help_)
            fam.add_metric([], [("+Inf" if math.isinf(le) else repr(le), c) for le, c in buckets],
                           total)
            yield fam
        for name, help_ in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name.removesuffix("_total"), help_,
                                      value=snap["counters"][name])
        fam = CounterMetricFamily(PREFIX + SUCCESS_COUNTER.removesuffix("_total"),
                                  "Finished sequences by finish reason.",
                                  labels=["finished_reason"])
        for reason, n in sorted(snap["success"].items()):
            fam.add_metric([reason], n)
        yield fam
        workers = self.store.live_workers(self.settings.worker_stale_s)
        models = self.settings.served_models()
        # (vLLM's label: a worker serves one model; one that names none serves the default)
        for name, key, help_ in (("num_requests_running", "running", "Sequences in a batch."),
                                 ("num_requests_waiting", "waiting",
                                  "Sequences a worker holds but has not batched yet.")):
            g = GaugeMetricFamily(PREFIX + name, help_, labels=["worker", "model_name"])
            for w in workers:
                g.add_metric([w["name"], w.get("model_name") or models[0].name],
                             float(w.get(key, 0) or 0))
            yield g
        yield GaugeMetricFamily(PREFIX + "workers_ready", "Workers whose engine is stepping.",
                                value=float(len(workers)))
        g = GaugeMetricFamily(PREFIX + "queue_depth",
                              "Sequences in the broker queue, not yet taken by a worker.",
                              labels=["model_name"])
        for m in models:
            g.add_metric([m.name], float(self.store.queue_depth(m.queue)))
        yield g


@bp.get("/metrics")
def metrics():
    registry = current_app.extensions["llmq"]["metrics_registry"]
    return Response(generate_latest(registry), mimetype="text/plain; version=0.0.4")


def init_app(app) -> None:
    ext = app.extensions["llmq"]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(ext["store"], ext["settings"]))
    ext["metrics_registry"] = registry
    app.register_blueprint(bp)
