"""OpenTelemetry: a span per request with admission/queue/prefill/decode children from engine timestamps."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from stoker.engine.params import RequestTimes
from stoker.observe.tracing import RequestTracer


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestTracer(provider=provider), exporter


def by_name(exporter) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_disabled_without_endpoint():
    t = RequestTracer()
    assert not t.enabled
    t.record(request_id="r", headers=None, start=1, end=2)  # no-op


def test_enabled_with_otlp_endpoint():
    t = RequestTracer(otlp_endpoint="http://127.0.0.1:4318")
    assert t.enabled
    t.shutdown()


def test_request_span_with_phase_children(traced):
    tracer, exporter = traced
    times = RequestTimes(arrival=100.0, scheduled=100.2, first_token=100.5, last_token=101.0, finished=101.0)
    tracer.record(
        request_id="r1",
        headers={},
        start=100.0,
        end=101.1,
        admitted_at=100.05,
        times=times,
        attributes={"gen_ai.request.model": "m", "gen_ai.usage.output_tokens": 7, "none": None},
    )
    spans = by_name(exporter)
    assert set(spans) == {"stoker.request", "admission", "queue", "prefill", "decode"}
    root = spans["stoker.request"]
    assert root.attributes["stoker.request_id"] == "r1" and root.attributes["gen_ai.usage.output_tokens"] == 7
    assert "none" not in root.attributes
    for name in ("admission", "queue", "prefill", "decode"):
        assert spans[name].parent.span_id == root.context.span_id
        assert spans[name].context.trace_id == root.context.trace_id
    ns = 1_000_000_000
    assert (spans["admission"].start_time, spans["admission"].end_time) == (100 * ns, int(100.05 * ns))
    assert (spans["queue"].start_time, spans["queue"].end_time) == (int(100.05 * ns), int(100.2 * ns))
    assert (spans["prefill"].start_time, spans["prefill"].end_time) == (int(100.2 * ns), int(100.5 * ns))
    assert (spans["decode"].start_time, spans["decode"].end_time) == (int(100.5 * ns), 101 * ns)
    assert root.end_time == int(101.1 * ns)


def test_incoming_traceparent_is_honoured(traced):
    tracer, exporter = traced
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    tracer.record(
        request_id="r",
        headers={"Traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        start=1.0,
        end=2.0,
        admitted_at=1.1,
    )
    root = by_name(exporter)["stoker.request"]
    assert format(root.context.trace_id, "032x") == trace_id
    assert format(root.parent.span_id, "016x") == "00f067aa0ba902b7"


def test_refused_request_has_failed_admission_only(traced):
    tracer, exporter = traced
    tracer.record(request_id="r", headers=None, start=1.0, end=1.01, error="overloaded")
    spans = by_name(exporter)
    assert set(spans) == {"stoker.request", "admission"}
    assert spans["admission"].status.status_code is StatusCode.ERROR
    assert spans["stoker.request"].status.status_code is StatusCode.ERROR


def test_dropped_while_waiting_has_queue_but_no_prefill(traced):
    tracer, exporter = traced
    times = RequestTimes(arrival=1.0, finished=3.0)
    tracer.record(request_id="r", headers=None, start=1.0, end=3.0, admitted_at=1.1, times=times, error="deadline")
    spans = by_name(exporter)
    assert set(spans) == {"stoker.request", "admission", "queue"}
    assert spans["queue"].end_time == 3 * 1_000_000_000
