"""JSON as strict clients parse it: NaN and Infinity are not JSON, so every
response body and every SSE event is encoded with them forbidden. A value
that cannot be encoded is a bug upstream (the sampler keeps logprobs finite);
it becomes a clean OpenAI-shaped error, never a traceback or invalid JSON."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi.responses import JSONResponse

from stoker.errors import APIError

logger = logging.getLogger("stoker.server")


def non_finite_error() -> APIError:
    return APIError(
        500,
        "The response held a number JSON cannot represent (NaN or infinity); this is a server bug.",
        type="server_error",
        code="non_finite_number",
    )


def dumps(data: Any) -> str:
    """Compact JSON; raises APIError (500, non_finite_number) on NaN or infinity."""
    try:
        return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        logger.error("refused to encode a non-finite number in a response")
        raise non_finite_error() from None


class StrictJSONResponse(JSONResponse):
    """The app's response class: raising APIError from render() (which runs
    inside the route) lets the app's error handler answer instead."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")
