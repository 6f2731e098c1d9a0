"""OpenTelemetry spans of a request, one trace across the processes it crosses.

The ingress opens the request's span at arrival and puts its W3C `traceparent` into the request's
timeline (engine/timeline.py), which travels to every worker in the GenerateRequest. Each process makes
its spans from the timeline's stamps once its part is done, with the stamps as start and end times: the
ingress its validation, tokenization and routing, a prefill worker its queue and compute, a decode worker
its KV transfer and decode. Spans go to an OTLP/HTTP collector, in batches, only when an endpoint is
configured (ClusterConfig.tracing, or OTEL_EXPORTER_OTLP_ENDPOINT); otherwise no tracer exists, no span is
made and every function here returns at its first line.
"""
from __future__ import annotations

import logging
import os

from engine.timeline import RequestTimeline

logger = logging.getLogger(__name__)

# How the pools hand the endpoint to their workers (runtime_env env_vars); "" means tracing is off.
OTLP_ENV, SERVICE_ENV = "TANDEM_OTLP_ENDPOINT", "TANDEM_OTEL_SERVICE_NAME"
EXPORT_DELAY_MS = 1000  # a batch of spans leaves at least this often
MAX_QUEUED_SPANS = 16384  # beyond this, between exports, the SDK drops spans (and logs that it does)

_tracer = None
_provider = None


def tracing_env(endpoint: str | None, service_name: str) -> dict[str, str]:
    """The environment that configures a worker's tracing like the cluster's."""
    return {OTLP_ENV: endpoint or "", SERVICE_ENV: service_name}


def configure_tracing(endpoint: str | None, service_name: str = "tandem", role: str = "ingress",
                      exporter=None) -> None:
    """Export this process's spans to `endpoint` (an OTLP/HTTP base URL), or to `exporter` (an SDK
    SpanExporter, e.g. in tests); with neither, tracing is off."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
        _tracer = _provider = None
    if not endpoint and exporter is None:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    provider = TracerProvider(resource=Resource.create({"service.name": service_name, "tandem.role": role}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        otlp = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
        provider.add_span_processor(BatchSpanProcessor(otlp, schedule_delay_millis=EXPORT_DELAY_MS,
                                                       max_queue_size=MAX_QUEUED_SPANS))
    _provider, _tracer = provider, provider.get_tracer("tandem")
    logger.info("tracing %s spans to %s", role, endpoint or type(exporter).__name__)


def configure_worker_tracing(role: str) -> None:
    """A worker's tracing, as its pool's environment says (tracing_env)."""
    configure_tracing(os.environ.get(OTLP_ENV), os.environ.get(SERVICE_ENV) or "tandem", role)


def enabled() -> bool:
    return _tracer is not None


def flush() -> None:
    """Export the spans made so far now (benchmarks, tests)."""
    if _provider is not None:
        _provider.force_flush()


def start_request_span(timeline: RequestTimeline):
    """At the ingress: the request's root span, started at its arrival; its context goes into the timeline.
    None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind, set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    span = _tracer.start_span("tandem.request", kind=SpanKind.SERVER, start_time=_ns(timeline.times["arrival"]),
                              attributes={"tandem.request_id": timeline.request_id})
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    timeline.traceparent = carrier.get("traceparent")
    return span


def end_request_span(span, timelines: list[RequestTimeline], error: str | None = None) -> None:
    """At the ingress, when the request ended: its validation, tokenization and routing spans, then the root."""
    if span is None:
        return
    for timeline in timelines:
        emit_spans(timeline, ("validation", "tokenization", "routing"), {"routing": {
            "tandem.prefill_worker": timeline.prefill_worker or "", "tandem.decode_worker": timeline.decode_worker or "",
            "tandem.prefill_path": timeline.prefill_path or "", "tandem.routing_reason": timeline.routing_reason or "",
            "tandem.prefill_overlap_blocks": timeline.prefill_overlap_blocks,
            "tandem.decode_overlap_blocks": timeline.decode_overlap_blocks}})
    if error is not None:
        from opentelemetry.trace import Status, StatusCode
        span.set_status(Status(StatusCode.ERROR, error))
    end = max((t.times.get("finished", 0.0) for t in timelines), default=0.0)
    span.end(end_time=_ns(end) if end else None)


def emit_spans(timeline: RequestTimeline, phases: tuple[str, ...], attributes: dict[str, dict] | None = None) -> None:
    """Spans of the named phases (engine/timeline.py PHASES) the request passed, children of its ingress
    span, with `attributes[phase]` on each (beside the request id); nothing when tracing is off here or the
    request carries no trace context."""
    if _tracer is None or not timeline.traceparent:
        return
    from engine.timeline import PHASES
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    parent = TraceContextTextMapPropagator().extract({"traceparent": timeline.traceparent})
    attributes = attributes or {}
    times = timeline.times
    for name, start, end in PHASES:
        if name in phases and start in times and end in times:
            span = _tracer.start_span(name, context=parent, start_time=_ns(times[start]),
                                      attributes={"tandem.request_id": timeline.request_id, **attributes.get(name, {})})
            span.end(end_time=_ns(max(times[end], times[start])))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
