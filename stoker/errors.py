"""The one HTTP error type of stoker, in OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.

It lives below both the server and the control plane so each can raise it
without importing the other: the server renders any APIError raised in a
route, a dependency or a hook; control raises it for auth, limits and
admission. 429 always means "your quota" (rate limits, concurrency, budget),
503 "our capacity" (queue full, draining, engine down), 504 a deadline that
passed while waiting: clients (and the official SDKs' retries) rely on that split.
"""

from __future__ import annotations

import math
from typing import Any


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        retry_after: float | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        self.retry_after = retry_after
        self.reason = reason or code or type
        """Short label for metrics and logs (e.g. "tokens", "queue_tokens")."""
        if retry_after is not None:
            # Whole seconds, rounded up: retrying earlier would be refused again.
            self.headers["Retry-After"] = str(max(1, math.ceil(retry_after)))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StartupRefused(Exception):
    """Raised by a server extension's install() when its settings make serving
    impossible (e.g. --require-auth without keys): `stoker serve` prints the
    message and exits 2, as for a bad option, instead of a traceback."""
