"""OpenTelemetry traces: one span per request with children for admission,
queue, prefill and decode.

The spans are built when the request ends, from timestamps: the engine
stamps scheduled / first token / finished in its own process, so there is no
live span to start and stop around those phases. Building them afterwards
with explicit start and end times gives exact phase boundaries and costs
nothing on the hot path when tracing is off.

Enabled when an OTLP endpoint is configured (or a TracerProvider is passed,
as tests do with the SDK's InMemorySpanExporter). An incoming W3C
`traceparent` header makes the request span a child of the caller's span.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from stoker.engine.params import RequestTimes
from stoker.observe.logs import current_client_request_id

_propagator = TraceContextTextMapPropagator()


def _ns(t: float) -> int:
    return int(t * 1e9)


class RequestTracer:
    def __init__(
        self,
        otlp_endpoint: str | None = None,
        provider: TracerProvider | None = None,
        service_name: str = "stoker",
    ) -> None:
        self.provider = provider
        if provider is None and otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )

            # Our own provider, not the global one: the app may be embedded in
            # a process that already configured tracing differently.
            self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
            endpoint = otlp_endpoint.rstrip("/")
            if not endpoint.endswith("/v1/traces"):
                endpoint += "/v1/traces"
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("stoker") if self.provider is not None else None

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def record(
        self,
        *,
        request_id: str,
        headers: Mapping[str, str] | None,
        start: float,
        end: float,
        admitted_at: float | None = None,
        times: RequestTimes | None = None,
        attributes: dict[str, Any] | None = None,
        error: str | None = None,
        name: str = "stoker.request",
    ) -> None:
        """Emit the request span and its phase children.

        start: when the request arrived; end: when the response ended;
        admitted_at: when admission decided (None if it refused);
        times: the engine's stamps for the request (None if it never ran)."""
        if self.tracer is None:
            return
        carrier = {k.lower(): v for k, v in (headers or {}).items()}
        parent = _propagator.extract(carrier) if "traceparent" in carrier else None
        attrs = {"stoker.request_id": request_id, **{k: v for k, v in (attributes or {}).items() if v is not None}}
        client_id = current_client_request_id()  # the caller's X-Request-Id, to find its span by
        if client_id is not None:
            attrs["stoker.client_request_id"] = client_id
        root = self.tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, start_time=_ns(start), attributes=attrs
        )
        ctx = trace.set_span_in_context(root)

        def child(label: str, begin: float | None, finish: float | None, status_error: str | None = None) -> None:
            if begin is None or finish is None:
                return
            span = self.tracer.start_span(label, context=ctx, start_time=_ns(begin))  # type: ignore[union-attr]
            if status_error:
                span.set_status(Status(StatusCode.ERROR, status_error))
            span.end(end_time=_ns(max(begin, finish)))

        if admitted_at is None:
            child("admission", start, end, error or "refused")
        else:
            child("admission", start, admitted_at)
        if times is not None:
            queued_from = admitted_at if admitted_at is not None else times.arrival
            # A request dropped while waiting was never scheduled: its queue span
            # runs until it finished (was dropped).
            child("queue", queued_from, times.scheduled if times.scheduled is not None else times.finished)
            prefill_end = (
                times.first_token
                if times.first_token is not None
                else (times.finished if times.scheduled is not None else None)
            )
            child("prefill", times.scheduled, prefill_end)
            if times.first_token is not None:
                child("decode", times.first_token, times.finished or times.last_token)
        if error:
            root.set_status(Status(StatusCode.ERROR, error))
        root.end(end_time=_ns(max(start, end)))

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
