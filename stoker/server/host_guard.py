"""--allowed-hosts: answer only requests whose Host header names this server.

A server open on 127.0.0.1 (open mode, or a key kept in a browser) can be
reached from a web page through DNS rebinding: the attacker's name resolves to
127.0.0.1 and the browser sends Host: evil.example. Checking Host closes that.
Starlette's TrustedHostMiddleware does the same check but answers in plain text;
this one answers in the API's error shape, so clients parse it like any refusal.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from stoker.errors import APIError
from stoker.server.strict_json import StrictJSONResponse


def host_allowed(host: str, allowed: list[str]) -> bool:
    """host (port removed) against names, "*.example.com" wildcards, or "*"."""
    for pattern in allowed:
        if pattern == "*" or host == pattern:
            return True
        if pattern.startswith("*.") and host.endswith(pattern[1:]):
            return True
    return False


def _host_of(scope: Scope) -> str:
    raw = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
    if raw.startswith("["):  # [::1]:8000
        return raw[: raw.find("]") + 1].lower()
    return raw.rsplit(":", 1)[0].lower() if raw.count(":") == 1 else raw.lower()


class HostGuardMiddleware:
    def __init__(self, app: ASGIApp, allowed: list[str]) -> None:
        self.app = app
        self.allowed = [host.lower() for host in allowed]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not host_allowed(_host_of(scope), self.allowed):
            error = APIError(
                400, "Invalid Host header: this server answers only for its --allowed-hosts.", code="invalid_host"
            )
            await StrictJSONResponse(error.body(), status_code=400)(scope, receive, send)
            return
        await self.app(scope, receive, send)
