"""Run sequences' figures, written by the workers and read for GET /metrics."""
from __future__ import annotations

from typing import Any

from ..metrics import read_snapshot, record_finished
from .base import StorePart


class MetricsStore(StorePart):
    """Records and reads the figures common/metrics.py keeps in Redis."""

    def metrics_snapshot(self) -> dict[str, Any]:
        """Every worker's figures as GET /metrics shows them (common/metrics.read_snapshot)."""
        return read_snapshot(self.r)

    def record_metrics(self, observations: list[dict[str, Any]]) -> None:
        """Run sequences' figures (common/metrics.record_finished's arguments), one round trip."""
        if not observations:
            return
        pipe = self.r.pipeline(transaction=False)
        for obs in observations:
            record_finished(pipe, **obs)
        pipe.execute()
