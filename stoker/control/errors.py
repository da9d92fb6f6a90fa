"""Errors of the control layer in OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.

429 always means "your quota" (rate limits, concurrency, budget); 503 means
"our capacity" (queue full, draining); 504 a deadline that passed while
waiting. Clients (and the official SDKs' retry logic) rely on that split.
"""

from __future__ import annotations

import math

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


class ControlError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str,
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

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_response(
    status: int, message: str, type: str, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return ControlError(status, message, type, code, headers=headers).response()


def install_error_handler(app: FastAPI) -> None:
    """Render ControlError raised anywhere (dependencies included) in OpenAI's shape."""

    async def handle(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ControlError)
        return exc.response()

    app.add_exception_handler(ControlError, handle)
