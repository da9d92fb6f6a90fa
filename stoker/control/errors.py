"""Rendering the control layer's errors: they are stoker.errors.APIError, the
one error type of the server."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from stoker.errors import APIError


def install_error_handler(app: FastAPI) -> None:
    """Render APIError raised anywhere (dependencies and middleware-called hooks included) in OpenAI's shape."""

    async def handle(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    app.add_exception_handler(APIError, handle)
