"""One JSON line per request; the server's request ids, and the client's X-Request-Id echoed and logged."""

from __future__ import annotations

import io
import json
import logging

from fastapi import FastAPI
from fastapi.testclient import TestClient

from stoker.observe.logs import (
    RequestIdMiddleware,
    RequestLogger,
    RequestRecord,
    client_request_id_from,
)


def test_one_json_line_with_the_fields():
    stream = io.StringIO()
    logger = logging.getLogger("test.requests.one")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    RequestLogger(logger=logger).log(
        RequestRecord(
            request_id="r1",
            status=200,
            model="m",
            key_id="k1",
            key_name="alice",
            prompt_tokens=10,
            cached_tokens=4,
            completion_tokens=5,
            queue_time=0.01,
            ttft=0.123456789,
            latency=0.5,
            finish_reason="stop",
        )
    )
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["request_id"] == "r1" and line["key_name"] == "alice" and line["cached_tokens"] == 4
    assert line["ttft"] == 0.123457 and "error" not in line and line["event"] == "request"


def test_core_fields_always_present():
    stream = io.StringIO()
    logger = logging.getLogger("test.requests.two")
    logger.handlers[:] = [logging.StreamHandler(stream)]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    line = RequestLogger(logger=logger).log(RequestRecord(request_id="r", status=401))
    assert line["ttft"] is None and line["key_id"] is None and "method" not in line


def test_default_logger_writes_raw_json_to_its_stream():
    stream = io.StringIO()
    logging.getLogger("stoker.requests").handlers.clear()
    RequestLogger(stream=stream).log(RequestRecord(request_id="r2", status=429, error="rate_limit_exceeded"))
    assert json.loads(stream.getvalue())["error"] == "rate_limit_exceeded"
    logging.getLogger("stoker.requests").handlers.clear()


def test_client_request_id_kept_when_safe():
    assert client_request_id_from("abc-123.x:y") == "abc-123.x:y"
    assert client_request_id_from(None) is None
    assert client_request_id_from("bad id\nwith newline") is None
    assert client_request_id_from("x" * 200) is None


def test_middleware_gives_the_server_id_and_echoes_the_clients():
    app = FastAPI()
    stream = io.StringIO()
    logger = logging.getLogger("test.requests.middleware")
    logger.addHandler(logging.StreamHandler(stream))
    logger.setLevel(logging.INFO)
    logger.propagate = False

    @app.get("/x")
    async def x(request: __import__("fastapi").Request) -> dict:
        RequestLogger(logger=logger).log(RequestRecord(request_id=request.state.request_id, status=200))
        return {"rid": request.state.request_id, "client": request.state.client_request_id}

    app.add_middleware(RequestIdMiddleware)
    client = TestClient(app)
    r = client.get("/x", headers={"X-Request-Id": "mine-1"})
    # The client's id is echoed and logged, never the request's own id.
    assert r.headers["x-request-id"] == "mine-1" and r.json()["client"] == "mine-1"
    assert r.json()["rid"].startswith("req-") and r.json()["rid"] != "mine-1"
    line = json.loads(stream.getvalue().splitlines()[-1])
    assert line["request_id"] == r.json()["rid"] and line["client_request_id"] == "mine-1"
    r = client.get("/x")
    assert r.headers["x-request-id"] == r.json()["rid"] and r.json()["rid"].startswith("req-")
    assert r.json()["client"] is None and "client_request_id" not in json.loads(stream.getvalue().splitlines()[-1])
    assert client.get("/missing").headers["x-request-id"].startswith("req-")
