"""Prometheus metrics and optional OpenTelemetry spans: requests, their latency, time waiting for a replica,
the size of each run's batch, and time per stage.

Each server has its own registry, so several can live in one process (tests, benchmarks). Spans go to
whatever tracer provider the process has configured; without one, OpenTelemetry's API does nothing.
`configure_tracing` sets one up from `OTEL_TRACES_EXPORTER` (`console`, `otlp`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

from ..foundation.errors import UhopError

log = logging.getLogger(__name__)

# Latency buckets from 0.1 ms to 10 s: stages of small models take well under a millisecond.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """Request counts by status, request latency, queueing, batch sizes, stage latency and stage errors, for one
    served model."""

    def __init__(self, model: str):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.model = model
        self.registry = CollectorRegistry()
        self.requests = Counter("uhop_requests", "Infer requests answered, by HTTP status.",
                                ["model", "code"], registry=self.registry)
        self.latency = Histogram("uhop_request_seconds", "Time to answer an infer request.",
                                 ["model"], buckets=BUCKETS, registry=self.registry)
        self.stage_latency = Histogram("uhop_stage_seconds", "Time a stage spends running, on its provider.",
                                       ["model", "stage", "provider"], buckets=BUCKETS, registry=self.registry)
        self.queue = Histogram("uhop_queue_seconds", "Time a request waits before its run starts.",
                               ["model"], buckets=BUCKETS, registry=self.registry)
        self.batch = Histogram("uhop_batch_size", "Requests answered by one run of the model.",
                               ["model"], buckets=BATCH_BUCKETS, registry=self.registry)
        self.stage_errors = Counter("uhop_stage_errors", "Stage runs that failed.",
                                    ["model", "stage", "provider"], registry=self.registry)

    def request(self, code: int, seconds: float | None = None) -> None:
        self.requests.labels(self.model, str(code)).inc()
        if seconds is not None:
            self.latency.labels(self.model).observe(seconds)

    def run(self, waited: list[float]) -> None:
        """Record one run of the model for requests that waited `waited` seconds each."""
        self.batch.labels(self.model).observe(len(waited))
        for seconds in waited:
            self.queue.labels(self.model).observe(seconds)

    def stage(self, index: int, provider: str, seconds: float | None) -> None:
        """Record one stage run; `seconds` None means it failed."""
        labels = (self.model, str(index), provider)
        if seconds is None:
            self.stage_errors.labels(*labels).inc()
        else:
            self.stage_latency.labels(*labels).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


@contextlib.contextmanager
def span(name: str, carrier: Mapping[str, str] | None = None, **attributes) -> Iterator[None]:
    """An OpenTelemetry span when the API is installed (a no-op unless a tracer provider is configured);
    `carrier` (request headers) continues the caller's trace when it holds a `traceparent`."""
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        yield
        return
    context = propagate.extract(carrier) if carrier is not None else None
    with trace.get_tracer("uhop_onnx.serve").start_as_current_span(name, context=context, attributes=attributes):
        yield


def configure_tracing() -> bool:
    """Install an SDK tracer provider exporting to `OTEL_TRACES_EXPORTER`; False when none is asked for."""
    wanted = [e.strip() for e in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip() not in ("", "none")]
    if not wanted:
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                                        "uhop-onnx")}))
    for name in wanted:
        if name == "console":
            exporter = ConsoleSpanExporter()
        elif name == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                raise UhopError("OTEL_TRACES_EXPORTER=otlp needs: pip install opentelemetry-exporter-otlp") from None
            exporter = OTLPSpanExporter()
        else:
            raise UhopError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r}; valid: console, otlp, none")
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing to %s", ", ".join(wanted))
    return True
