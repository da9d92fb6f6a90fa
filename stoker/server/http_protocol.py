"""uvicorn's HTTP/1.1 protocol, refusing HTTP/2 politely, with a bound on
how long and how big a request's headers may be.

sglang-router probes every new worker for a gRPC server before it settles on
HTTP: it opens a connection on the worker's port and sends the HTTP/2
connection preface ("PRI * HTTP/2.0..."), twice (SGLang's scheduler, then
vLLM's). Plain uvicorn answers that with a 400 and logs a WARNING "Invalid HTTP
request received." each time. Here a connection that opens with the preface
gets an HTTP/2 GOAWAY frame (HTTP_1_1_REQUIRED), so the client's gRPC stack
fails fast with a clear reason, and one DEBUG line; every other connection is
uvicorn's, byte for byte.

httptools (llhttp) puts no limit on headers and uvicorn no timeout on reading
them (its keep-alive timer only runs between requests): a client sending a
header a byte at a time would hold a connection, and one sending endless
headers would grow the server's memory. Here a request's headers must arrive
within header_timeout seconds of its first byte (or of the connection) and fit
in max_header_bytes; otherwise the connection is answered 408 or 431 and closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from stoker.errors import APIError

logger = logging.getLogger(__name__)

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# GOAWAY (type 0x7) on stream 0: 8-byte payload = last stream id 0, error HTTP_1_1_REQUIRED (0xd).
GOAWAY_HTTP_1_1_REQUIRED = b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x0d"


async def over_capacity(scope: Scope, receive: Receive, send: Send) -> None:
    """uvicorn's answer past limit_concurrency (--max-connections), in the server's error shape."""
    error = APIError(
        503,
        "The server holds as many connections and requests as it may (--max-connections); retry shortly.",
        type="service_unavailable",
        code="too_many_connections",
        retry_after=1,
    )
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class HTTP1Protocol(HttpToolsProtocol):
    """HttpToolsProtocol that sniffs the first bytes of each connection for the
    HTTP/2 preface, and bounds each request's headers in time and size."""

    header_timeout: float = 10.0
    max_header_bytes: int = 64 * 1024

    _sniffed: bytes | None = b""
    """Bytes held while they may still be the start of the preface; None once decided."""
    _header_timer: asyncio.TimerHandle | None = None
    _in_headers = True
    """Reading a request's start line and headers (from the connection's first byte on)."""
    _header_seen = 0
    _tail = b""
    """The last bytes of the header block so far, to find its end across reads."""

    @classmethod
    def configured(cls, header_timeout: float, max_header_bytes: int) -> type[HTTP1Protocol]:
        """This protocol with the server's header bounds (uvicorn builds one per connection)."""
        return type(cls.__name__, (cls,), {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes})

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._in_headers and not self.transport.is_closing():
            logger.info("%s: request headers not received within %.0f s: closed", self.client, self.header_timeout)
            self._refuse(408, b"Request Timeout", f"request headers must arrive within {self.header_timeout:g} s")

    def _refuse(self, status: int, reason: bytes, message: str) -> None:
        body = message.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, reason, len(body), body)
        )
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._arm_header_timer()  # the next request on a kept-alive connection: its headers are timed too

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._header_seen = 0
        self._tail = b""
        self._disarm_header_timer()
        limit = self.limit_concurrency
        if limit is None or (len(self.connections) < limit and len(self.tasks) < limit):
            return super().on_headers_complete()
        # uvicorn would answer its plain-text 503: the request goes to over_capacity instead.
        logger.warning("over --max-connections (%d): answered 503", limit)
        app, self.app, self.limit_concurrency = self.app, over_capacity, None
        try:
            super().on_headers_complete()
        finally:
            self.app, self.limit_concurrency = app, limit

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_headers = True  # what comes next on this connection is the next request's head

    def _within_header_limit(self, data: bytes) -> bool:
        """Count the header bytes in data (up to the blank line that ends them); False past the limit."""
        if not self._in_headers:
            return True
        joined = self._tail + data
        end = joined.find(b"\r\n\r\n")
        counted = len(data) if end < 0 else max(0, end + 4 - len(self._tail))
        self._header_seen += counted
        self._tail = joined[-3:]
        return self._header_seen <= self.max_header_bytes

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return None
        if not self._within_header_limit(data):
            logger.info("%s: request headers over %d bytes: closed", self.client, self.max_header_bytes)
            self._refuse(
                431, b"Request Header Fields Too Large", f"request headers exceed {self.max_header_bytes} bytes"
            )
            return None
        if self._sniffed is None:
            return super().data_received(data)
        head = self._sniffed + data
        if head.startswith(HTTP2_PREFACE):
            logger.debug("HTTP/2 connection preface from %s: answered GOAWAY (HTTP/1.1 only)", self.client)
            self._sniffed = None
            self.transport.write(GOAWAY_HTTP_1_1_REQUIRED)
            self.transport.close()
            return None
        if HTTP2_PREFACE.startswith(head):
            self._sniffed = head  # a prefix so far: wait for more
            return None
        self._sniffed = None
        return super().data_received(head)
