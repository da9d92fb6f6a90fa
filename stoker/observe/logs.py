"""One JSON line per request, and the request id that ties it to the
response header, the usage row and the trace.

The line carries the key's id and name, never the secret (the secret never
reaches this module). A client-supplied X-Request-Id is kept if it is short
and plain, so ids can be followed across services; anything else is
replaced, since the id is echoed in a header and written to logs.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
ACCESS_LOGGER = "stoker.requests"


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def request_id_from(header_value: str | None) -> str:
    """The client's X-Request-Id if it is safe to echo, else a fresh one."""
    if header_value and _SAFE_ID.match(header_value):
        return header_value
    return new_request_id()


def request_id_of(request: Any) -> str:
    """A request's id: the one RequestIdMiddleware set on request.state, else
    the client's X-Request-Id if safe, else a new one (remembered on the request)."""
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        rid = request_id_from(request.headers.get(REQUEST_ID_HEADER))
        request.state.request_id = rid
    return str(rid)


@dataclass
class RequestLogRecord:
    request_id: str
    status: int
    model: str | None = None
    key_id: str | None = None
    key_name: str | None = None
    method: str | None = None
    path: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    queue_time: float | None = None
    ttft: float | None = None
    latency: float | None = None
    finish_reason: str | None = None
    priority: int | None = None
    stream: bool | None = None
    error: str | None = None
    """OpenAI error type/code when the request failed (e.g. rate_limit_exceeded)."""


_ALWAYS = frozenset(
    {
        "request_id",
        "status",
        "model",
        "key_id",
        "key_name",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "queue_time",
        "ttft",
        "latency",
        "finish_reason",
    }
)


class _Raw(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage()


class RequestLogger:
    """Writes records through the `stoker.requests` logger, so operators can
    route or silence it with ordinary logging config; by default one line to
    stderr per request, not mixed with other log formats."""

    def __init__(self, stream: TextIO | None = None, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(ACCESS_LOGGER)
        if logger is None and not self.logger.handlers:
            handler = logging.StreamHandler(stream or sys.stderr)
            handler.setFormatter(_Raw())
            self.logger.addHandler(handler)
            self.logger.setLevel(logging.INFO)
            self.logger.propagate = False

    def log(self, record: RequestLogRecord, **extra: Any) -> dict:
        line: dict[str, Any] = {"ts": round(time.time(), 6), "event": "request"}
        for k, v in asdict(record).items():
            # The core fields are always present (null when unknown) so log
            # pipelines see one schema; optional context only when set.
            if v is not None or k in _ALWAYS:
                line[k] = round(v, 6) if isinstance(v, float) else v
        line.update(extra)
        self.logger.info(json.dumps(line, separators=(",", ":"), default=str))
        return line


def assign_request_id(scope: Scope) -> str:
    """The client's X-Request-Id (sanitised) or a new id, stored as
    scope["state"]["request_id"] (request.state.request_id in FastAPI)."""
    incoming = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"x-request-id"), None)
    request_id = request_id_from(incoming)
    scope.setdefault("state", {})["request_id"] = request_id
    return request_id


def with_request_id(headers: list[tuple[bytes, bytes]], request_id: str) -> list[tuple[bytes, bytes]]:
    """Response headers with exactly one X-Request-Id, ours."""
    kept = [(k, v) for k, v in headers if k.lower() != b"x-request-id"]
    return kept + [(b"x-request-id", request_id.encode("latin-1"))]


class RequestIdMiddleware:
    """Request id in, X-Request-Id out on every response, errors included. The
    server's ControlMiddleware does the same plus admission; this one serves
    apps without the control plane."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = assign_request_id(scope)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": with_request_id(message.get("headers", []), request_id)}
            await send(message)

        await self.app(scope, receive, send_with_id)
