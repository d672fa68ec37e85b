"""Prometheus metrics of ``mmpipe serve`` (``GET /metrics``, text exposition format).

One :class:`ServeMetrics` per engine, on its own ``CollectorRegistry`` (not the process-global
default one), so that several engines in one process (tests) never share or clash on series.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Stage times span a tiny model's milliseconds to a large DiT's minutes.
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class ServeMetrics:
    """Per-stage queue time, run time and batch size; requests by final status; bytes per edge;
    restarts of the serving groups."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.stage_queue = Histogram(
            "mmpipe_serve_stage_queue_seconds",
            "Time a request waited in a stage's input queue before its batch ran.",
            ["stage"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.stage_run = Histogram(
            "mmpipe_serve_stage_run_seconds",
            "Time one batch took to run through a stage.",
            ["stage"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.stage_batch = Histogram(
            "mmpipe_serve_stage_batch_size",
            "Requests run together as one batch by a stage.",
            ["stage"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.requests = Counter("mmpipe_serve_requests", "Requests by how they ended.", ["status"], registry=r)
        self.edge = Counter(
            "mmpipe_serve_edge_bytes", "Bytes sent between device groups, per graph edge.", ["edge"], registry=r
        )
        self.queue_depth = Gauge("mmpipe_serve_queue_depth", "Unfinished requests the engine holds.", registry=r)
        self.restarts = Counter(
            "mmpipe_serve_worker_restarts", "Restarts of the serving groups after one died or failed.", registry=r
        )

    def observe_stage(self, stage: str, queue_s: float, run_s: float, batch_size: int) -> None:
        """Record one batch of ``batch_size`` requests run by ``stage`` (``queue_s``: the batch's wait)."""
        self.stage_queue.labels(stage).observe(queue_s)
        self.stage_run.labels(stage).observe(run_s)
        self.stage_batch.labels(stage).observe(batch_size)

    def request_finished(self, status: str) -> None:
        """Count a request by how it ended: completed, failed, cancelled, or refused (``rejected``: the
        queue was full; ``invalid``: the HTTP front end refused its fields)."""
        self.requests.labels(status).inc()

    def edge_bytes(self, edge: str, nbytes: int) -> None:
        """Add ``nbytes`` moved across ``edge`` (e.g. ``"text->denoise"``)."""
        self.edge.labels(edge).inc(nbytes)

    def set_queue_depth(self, n: int) -> None:
        """The number of unfinished requests now."""
        self.queue_depth.set(n)

    def worker_restarted(self) -> None:
        """Count one restart of the serving groups."""
        self.restarts.inc()

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every metric and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
