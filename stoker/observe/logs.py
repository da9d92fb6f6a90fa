"""One JSON line per request, and the request id that ties it to the
response ids, the engine, the usage row and the trace.

Every request gets the server's own id (`req-<32 hex>`): the engine request
id, the response ids (chatcmpl-, cmpl-, msg_, resp_) and every internal key
derive from it, so nothing a client chooses can collide with another
client's work. A client's X-Request-Id is only a correlation field: kept if
it is short and plain, echoed back in the X-Request-Id response header (the
server id when the client sent none, as vLLM does) and written in the log
line as `client_request_id`; anything else is dropped, since it would be
echoed in a header and written to logs.

The line carries the key's id and name, never the secret (the secret never
reaches this module).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from starlette.datastructures import State
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
ACCESS_LOGGER = "stoker.requests"

_client_request_id: ContextVar[str | None] = ContextVar("stoker_client_request_id", default=None)
"""The client's X-Request-Id of the request being served: every log line of a
request carries it, wherever in the server it is written (admission, auth,
the gate), without each writer having to pass it along."""


def new_request_id() -> str:
    """A server id: unique, whatever any client sends."""
    return f"req-{uuid.uuid4().hex}"


def client_request_id_from(header_value: str | None) -> str | None:
    """The client's X-Request-Id if it is safe to echo and log, else None."""
    if header_value and _SAFE_ID.match(header_value):
        return header_value
    return None


def current_client_request_id() -> str | None:
    """The client's X-Request-Id of the request this code serves (None: none given)."""
    return _client_request_id.get()


def _remember(state: State | dict[str, Any], client_id: str | None) -> str:
    """Give a request its server id and note the client's; returns the server id."""
    request_id = new_request_id()
    if isinstance(state, dict):
        state["request_id"], state["client_request_id"] = request_id, client_id
    else:
        state.request_id, state.client_request_id = request_id, client_id
    _client_request_id.set(client_id)
    return request_id


def request_id_of(request: HTTPConnection) -> str:
    """A request's server id: the one RequestIdMiddleware set on request.state,
    else a new one (remembered on the request with the client's X-Request-Id)."""
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        rid = _remember(request.state, client_request_id_from(request.headers.get(REQUEST_ID_HEADER)))
    return str(rid)


@dataclass
class RequestRecord:
    """One request as the control plane saw it end, built once: written whole as its
    JSON log line (RequestLogger.log) and, once admitted, as its usage row
    (UsageLedger.record keeps the usage columns)."""

    request_id: str
    """The server's id for the request."""
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
    # The usage row's own fields, not in the log line:
    metered: bool = True
    """Whether it used compute (reached the engine and was not dropped while waiting):
    its usage row counts its prompt tokens only then."""
    created_at: float = 0.0
    """When it finished, the usage row's time (the log line stamps its own ts)."""
    reservation_id: str | None = None
    """The shared budget reservation its usage row settles (deleted when the row is written)."""


_USAGE_ONLY = frozenset({"metered", "created_at", "reservation_id"})


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
        self.listeners: list[Callable[[dict[str, object]], None]] = []
        """Called with each line as written (the console's recent-requests buffer), whatever the log level."""

    def log(self, record: RequestRecord, **extra: object) -> dict[str, object]:
        line: dict[str, object] = {"ts": round(time.time(), 6), "event": "request"}
        for k, v in asdict(record).items():
            # The core fields are always present (null when unknown) so log
            # pipelines see one schema; optional context only when set.
            if k in _USAGE_ONLY:
                continue
            if v is not None or k in _ALWAYS:
                line[k] = round(v, 6) if isinstance(v, float) else v
        client_id = current_client_request_id()
        if client_id is not None:
            line["client_request_id"] = client_id
        line.update(extra)
        self.logger.info(json.dumps(line, separators=(",", ":"), default=str))
        for listener in self.listeners:
            listener(line)
        return line


def assign_request_id(scope: Scope) -> str:
    """A new server id for the request, stored as scope["state"]["request_id"]
    (request.state.request_id in FastAPI), with the client's X-Request-Id
    (sanitised, or None) as scope["state"]["client_request_id"]; returns the
    server id."""
    incoming = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"x-request-id"), None)
    return _remember(scope.setdefault("state", {}), client_request_id_from(incoming))


def echoed_request_id(scope: Scope) -> str:
    """What the X-Request-Id response header carries: the client's own id if it
    sent a usable one (so its logs line up), else the server id."""
    state = scope["state"]
    return str(state.get("client_request_id") or state["request_id"])


def with_request_id(headers: list[tuple[bytes, bytes]], request_id: str) -> list[tuple[bytes, bytes]]:
    """Response headers with exactly one X-Request-Id, ours."""
    kept = [(k, v) for k, v in headers if k.lower() != b"x-request-id"]
    return kept + [(b"x-request-id", request_id.encode("latin-1"))]


class RequestIdMiddleware:
    """Request id in, X-Request-Id out on every response, errors included: the
    one place a request gets its id (the server installs it just outside
    ControlMiddleware)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        assign_request_id(scope)
        echoed = echoed_request_id(scope)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": with_request_id(message.get("headers", []), echoed)}
            await send(message)

        await self.app(scope, receive, send_with_id)
