"""How an answer reaches the client: server-sent events, the client leaving
mid-way, and how OpenAPI describes a streamed answer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from stoker.server.serving import JSONObject
from stoker.server.strict_json import dumps

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


async def wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be a disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await while watching the client; if it leaves, cancel the work (which aborts
    the engine requests) and raise ClientDisconnected."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work
    raise ClientDisconnected()


def sse(data: JSONObject | str) -> str:
    """One SSE event; raises APIError (500) for a value strict JSON cannot hold."""
    payload = data if isinstance(data, str) else dumps(data)
    return f"data: {payload}\n\n"


def named_sse(event: JSONObject) -> str:
    """An SSE event named by its type on the event line too, as /v1/responses
    and /v1/messages write them."""
    return f"event: {event['type']}\n{sse(event)}"


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client leaving (whatever
    the ASGI spec version) and always closes its body iterator, so the engine
    request is aborted within a step of the disconnect."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            with contextlib.suppress(OSError):
                await self.stream_response(send)

        streaming = asyncio.ensure_future(stream())
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, listening):
                task.cancel()
            await asyncio.gather(streaming, listening, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._on_close is not None:
                self._on_close()


# With "stream": true the answer is server-sent events, one JSON chunk per
# `data:` line and `data: [DONE]` last (chat, completions); /v1/responses and
# /v1/messages name each event on an `event:` line too. Before OpenAPI 3.2's
# itemSchema, a stream's `schema` describes one event.
SSE_EVENT: JSONObject = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}
STREAMED: dict[int | str, JSONObject] = {
    200: {
        "description": 'The completion, or with "stream": true its chunks as server-sent events.',
        "content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT}},
    }
}
