"""Traces from a live `stoker serve` (fake engine core): --otlp-endpoint points
at a tiny OTLP/HTTP receiver on 127.0.0.1 that keeps what it is sent."""

from __future__ import annotations

import gzip
import itertools
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from conftest import FAKE_CORE, start_server
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

pytestmark = pytest.mark.timeout(120)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver(ThreadingHTTPServer):
    def __init__(self) -> None:
        self.spans: list = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.paths.append(self.path)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        receiver.spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_request_span_with_phase_children_and_incoming_traceparent(receiver: Receiver, tmp_path) -> None:
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256", "--otlp-endpoint", endpoint],
        str(tmp_path),
    )
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            ok = http.post(
                "/v1/completions",
                json={"prompt": "ab", "max_tokens": 4},
                headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "x-request-id": "traced-1"},
            )
            assert ok.status_code == 200
    finally:
        assert server.stop() == 0  # the span processor flushes at shutdown
    assert receiver.paths and all(p == "/v1/traces" for p in receiver.paths)
    by_name: dict[str, list] = {}
    for span in receiver.spans:
        by_name.setdefault(span.name, []).append(span)
    roots = [
        s
        for s in by_name["stoker.request"]
        if any(a.key == "stoker.client_request_id" and a.value.string_value == "traced-1" for a in s.attributes)
    ]
    assert len(roots) == 1
    root = roots[0]
    # The caller's traceparent: same trace, the caller's span as parent.
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == PARENT_ID
    children = {s.name: s for s in receiver.spans if s.parent_span_id == root.span_id}
    assert set(children) == {"admission", "queue", "prefill", "decode"}
    assert all(c.trace_id == root.trace_id for c in children.values())
    order = [children[n] for n in ("admission", "queue", "prefill", "decode")]
    for earlier, later in itertools.pairwise(order):
        assert earlier.start_time_unix_nano <= later.start_time_unix_nano
    assert root.start_time_unix_nano <= order[0].start_time_unix_nano
    assert order[-1].end_time_unix_nano <= root.end_time_unix_nano
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 4
