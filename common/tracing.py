"""OpenTelemetry traces of one request across the router, the decode worker, the prefill worker and the
KV transfer, exported over OTLP/gRPC.

Off unless an OTLP endpoint is configured with the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER=otlp`); `OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none` keep it off. Off, nothing is imported and each call site tests one `None`.
On, the SDK reads the rest itself: `OTEL_TRACES_SAMPLER` / `_ARG` (default: parent-based, always on),
`OTEL_EXPORTER_OTLP_HEADERS`, `_INSECURE`, `_TIMEOUT`, `OTEL_BSP_*` (the batch processor: spans leave on
a background thread), `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` (the service name defaults to
the process's: splitfire-router, splitfire-decode, ...).

The context travels as a W3C `traceparent`: from the client's HTTP header into the router, and from the
router to the decode worker and on to the prefill worker in the request message itself
(`GenerateRequest.traceparent`, `PrefillRequest.traceparent`) — the router reaches a worker over gRPC, an
HTTP frame stream or one multiplexed connection for many requests, and only the message is common to all.

Each process holds its own `Tracing` (its own tracer provider, never the global one).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("splitfire.tracing")

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for traces (see the module's docstring)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    if exporter not in ("", "otlp"):
        raise ValueError(f"OTEL_TRACES_EXPORTER={exporter!r} is not supported: splitfire exports traces over OTLP "
                         "(otlp) or not at all (none)")
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    if protocol.strip().lower() != "grpc":
        raise ValueError(f"OTLP protocol {protocol!r} is not supported: splitfire exports OTLP over gRPC (set "
                         "OTEL_EXPORTER_OTLP_PROTOCOL=grpc, and the collector's gRPC port, usually 4317)")
    return exporter == "otlp" or any(env.get(v) for v in _ENDPOINT_VARS)


def wall_ns(perf_s: float) -> int:
    """A `time.perf_counter()` reading as Unix-epoch nanoseconds (a span's start or end)."""
    return time.time_ns() - int((time.perf_counter() - perf_s) * 1e9)


class Tracing:
    """One process's tracer. `span` starts a span (ended by the caller, with `end`), `child_context` is
    what a span passes to the work below it, `traceparent` the header form of a span's context."""

    def __init__(self, service: str):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
        self.provider = TracerProvider(resource=Resource.create(attrs))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer = self.provider.get_tracer("splitfire")
        self.propagator = TraceContextTextMapPropagator()
        self.kinds = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}
        self._in_context = set_span_in_context
        self.service = service

    @classmethod
    def from_env(cls, service: str) -> Tracing | None:
        """A tracer when the environment asks for one (`wanted`), else None. A bad setting fails here, at start."""
        if not wanted():
            return None
        t = cls(service)
        log.info("event=tracing_on service=%s endpoint=%s sampler=%s", service,
                 next((os.environ[v] for v in _ENDPOINT_VARS if os.environ.get(v)), "default"),
                 os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on"))
        return t

    def extract(self, traceparent: str | None, tracestate: str | None = None) -> Any:
        """The context a `traceparent` (and `tracestate`) names; an empty or malformed one starts a new trace."""
        if not traceparent:
            return None
        carrier = {"traceparent": traceparent}
        if tracestate:
            carrier["tracestate"] = tracestate
        return self.propagator.extract(carrier)

    def span(self, name: str, parent: Any = None, kind: str = "internal", attributes: Mapping[str, Any] | None = None,
             start_s: float | None = None) -> Any:
        """Start a span under `parent` (a span, a context from `extract`, or None: a new trace). `start_s`: a
        `perf_counter()` reading when the span began before now."""
        ctx = self._in_context(parent) if parent is not None and hasattr(parent, "get_span_context") else parent
        return self.tracer.start_span(name, context=ctx, kind=self.kinds[kind], attributes=attributes,
                                      start_time=None if start_s is None else wall_ns(start_s))

    def traceparent(self, span: Any) -> str:
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self._in_context(span))
        return carrier.get("traceparent", "")

    def shutdown(self) -> None:
        """Export what is still queued and stop (a process's exit)."""
        self.provider.shutdown()


def end(span: Any, end_s: float | None = None, error: str | None = None, **attributes: Any) -> None:
    """End `span` (at a `perf_counter()` reading, or now) with more attributes; `error` marks it failed."""
    if attributes:
        span.set_attributes({k if k.startswith(("splitfire.", "http.", "rpc.")) else f"splitfire.{k}": v
                             for k, v in attributes.items() if v is not None})
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=None if end_s is None else wall_ns(end_s))
