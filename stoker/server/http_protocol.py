"""uvicorn's HTTP/1.1 protocol, refusing HTTP/2 politely.

sglang-router probes every new worker for a gRPC server before it settles on
HTTP: it opens a connection on the worker's port and sends the HTTP/2
connection preface ("PRI * HTTP/2.0..."), twice (SGLang's scheduler, then
vLLM's). Plain uvicorn answers that with a 400 and logs a WARNING "Invalid HTTP
request received." each time. Here a connection that opens with the preface
gets an HTTP/2 GOAWAY frame (HTTP_1_1_REQUIRED), so the client's gRPC stack
fails fast with a clear reason, and one DEBUG line; every other connection is
uvicorn's, byte for byte.
"""

from __future__ import annotations

import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# GOAWAY (type 0x7) on stream 0: 8-byte payload = last stream id 0, error HTTP_1_1_REQUIRED (0xd).
GOAWAY_HTTP_1_1_REQUIRED = b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x0d"


class HTTP1Protocol(HttpToolsProtocol):
    """HttpToolsProtocol that sniffs the first bytes of each connection for the HTTP/2 preface."""

    _sniffed: bytes | None = b""
    """Bytes held while they may still be the start of the preface; None once decided."""

    def data_received(self, data: bytes) -> None:
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
