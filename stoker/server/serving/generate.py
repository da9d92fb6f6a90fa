"""Serving one generation attempt on one model version, whatever the API:
admit it, run its job, answer the whole body or stream its events (watching
for the client leaving), and tell the finished hooks how it ended (once, from
one place).

An API hands over a Generation: the job its body became and a Renderer that
writes the job's outputs in that API's shapes. Nothing here knows a shape."""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from stoker.engine.client import EngineUnavailableError, RequestRejectedError
from stoker.engine.params import EngineCoreOutput
from stoker.errors import APIError
from stoker.server.caps import check_cost
from stoker.server.fleet import ModelVersion
from stoker.server.hooks import AdmissionInfo
from stoker.server.protocol import SamplingFields, bad_request, deadline_exceeded, unavailable
from stoker.server.serving import JSONObject
from stoker.server.serving.job import Job, run_job
from stoker.server.state import ServerState
from stoker.server.strict_json import StrictJSONResponse, dumps

CLIENT_CLOSED = 499  # nginx's code for "client closed request", for logs only


class Renderer(ABC):
    """How one API writes a job: the whole body, or the events of its stream
    (one engine delta at a time; a renderer may keep state between them)."""

    end_of_stream: str | None = "data: [DONE]\n\n"
    """Written last, after an error too; None where the API has no such marker."""

    @abstractmethod
    def final(self, job: Job) -> JSONObject:
        """The non-streamed answer, once every sample has finished."""

    @abstractmethod
    def events(self, job: Job, prompt_index: int, delta: EngineCoreOutput) -> list[JSONObject]:
        """The stream events one delta makes (none is fine), after it was folded into job."""

    def closing(self, job: Job) -> list[JSONObject]:
        """Events after the last delta of a stream that ended well."""
        return []

    def frame(self, event: JSONObject) -> str:
        return sse(event)


@dataclass
class Generation:
    """One attempt at serving a generation request on one model version."""

    request: Request
    state: ServerState
    version: ModelVersion
    job: Job
    renderer: Renderer
    stream: bool
    fields: SamplingFields
    """The body's sampling fields: its priority and timeout go to admission."""


@dataclass
class Outcome:
    """How a request ended, as the finished hooks hear it."""

    status: int
    error: str | None = None


async def generate(attempt: Generation) -> Response:
    """Admit and run the attempt's job; answer its final body, or stream its events."""
    await _admit(attempt)
    job = attempt.job
    adapters = attempt.state.fleet.adapters
    events = run_job(attempt.version.engine, job, attempt.state.engine_ids_in_use, adapters.in_flight)
    outcome: Outcome | None = None  # None: nothing to report (an unexpected failure propagates)
    try:
        try:
            # A sleeping model wakes first (docs/sleep.md), watching for the client leaving meanwhile; its wake
            # failing is a 503, its deadline passing a 504. An awake one passes at once, with no task to start.
            waking = attempt.state.fleet.sleep.wake(attempt.version, job.deadline)
            await (until_disconnect(attempt.request, waking) if attempt.version.sleep.asleep else waking)
            # Wait for the first delta before committing to a status, so early
            # failures (engine down, request rejected, deadline) are real HTTP errors.
            first = await until_disconnect(attempt.request, events.__anext__())
            if not attempt.stream:
                await until_disconnect(attempt.request, _drain(events))
        except ClientDisconnected:
            outcome = Outcome(CLIENT_CLOSED, "client disconnected")
            return Response(status_code=CLIENT_CLOSED)
        except APIError as exc:
            await events.aclose()
            outcome = Outcome(exc.status, "deadline" if exc.code == "deadline_exceeded" else exc.message)
            raise
        except (EngineUnavailableError, ValueError) as exc:
            await events.aclose()
            error = engine_error(exc)
            outcome = Outcome(error.status, error.message)
            raise error from None
        if job.deadline_missed and job.completion_tokens == 0:
            # Dropped (or cut) at its deadline before a single token: nothing was
            # sent yet, so the client gets a real 504 rather than an empty answer.
            await events.aclose()
            timeout = deadline_exceeded(job.request_id)
            outcome = Outcome(timeout.status, "deadline")
            raise timeout
        if attempt.stream:
            streamed = Outcome(200)
            body = _stream(attempt.renderer, job, first, events, streamed)
            return EngineStreamingResponse(body, on_close=lambda: _report(attempt, _stream_ended(job, streamed)))
        # A deadline that passed during generation ends the samples with
        # finish_reason "abort"; the answer keeps what was generated.
        try:
            response = StrictJSONResponse(attempt.renderer.final(job))
        except APIError as exc:
            outcome = Outcome(exc.status, exc.message)
            raise
        outcome = Outcome(200, "deadline" if job.deadline_missed else None)
        return response
    finally:
        if outcome is not None:
            _report(attempt, outcome)


async def _admit(attempt: Generation) -> None:
    """Refuse what costs too much, run the admit hooks, and take the priority
    and deadline they set."""
    request, job = attempt.request, attempt.job
    job.request_id = request_id_for(request) or job.request_id
    job.version = attempt.version.label
    job.lora_name = attempt.version.lora_name
    info = AdmissionInfo(
        job.endpoint,
        job.model,
        sum(map(len, job.prompts)),
        job.params.max_tokens or 0,
        job.params.n,
        attempt.stream,
        priority=attempt.fields.priority,
        timeout=attempt.fields.timeout,
        prompts=len(job.prompts),
    )
    engine_info = attempt.version.engine.info
    check_cost(attempt.state.config, info.cost, engine_info.kv_capacity_tokens if engine_info else None)
    await attempt.state.hooks.run_admit(request, info)
    job.priority = getattr(request.state, "priority", job.priority)
    job.deadline = getattr(request.state, "deadline", job.deadline)


def _report(attempt: Generation, outcome: Outcome) -> None:
    """The one place a generation request's end reaches the finished hooks."""
    record = attempt.job.record(outcome.status, outcome.error, attempt.stream, attempt.request)
    attempt.state.hooks.run_finished(record)


def request_id_for(request: Request) -> str | None:
    """The id a middleware gave the request (stoker.control takes X-Request-Id or makes one)."""
    rid = getattr(request.state, "request_id", None)
    return rid if isinstance(rid, str) and rid else None


def engine_error(exc: Exception) -> APIError:
    """Map engine-side failures to HTTP errors (before any header is sent)."""
    if isinstance(exc, RequestRejectedError):
        return bad_request(str(exc))
    if isinstance(exc, EngineUnavailableError):
        return unavailable(str(exc))
    raise exc


async def _drain(events: AsyncIterator[tuple[int, EngineCoreOutput]]) -> None:
    async for _ in events:
        pass


async def _stream(
    renderer: Renderer,
    job: Job,
    first: tuple[int, EngineCoreOutput],
    events: AsyncGenerator[tuple[int, EngineCoreOutput], None],
    outcome: Outcome,
) -> AsyncIterator[str]:
    """The SSE body: what the renderer makes of each delta; an error after the
    headers went out ends the stream with the error's body."""
    try:
        for event in renderer.events(job, *first):
            yield renderer.frame(event)
        async for prompt_index, delta in events:
            for event in renderer.events(job, prompt_index, delta):
                yield renderer.frame(event)
        for event in renderer.closing(job):
            yield sse(event)
    except EngineUnavailableError as exc:
        outcome.error = str(exc)
        yield sse(unavailable(str(exc)).body())
    except APIError as exc:  # an event strict JSON could not encode: end the stream with the error
        outcome.error = exc.message
        yield sse(exc.body())
    finally:
        await events.aclose()
    if renderer.end_of_stream is not None:
        yield renderer.end_of_stream


def _stream_ended(job: Job, outcome: Outcome) -> Outcome:
    """A stream's outcome once it closed: cut short by the client unless every
    sample finished (or an error ended it first)."""
    if not all(o.finished for o in job.outputs) and outcome.error is None:
        return Outcome(CLIENT_CLOSED, "client disconnected")
    if outcome.error is None and job.deadline_missed:
        return Outcome(outcome.status, "deadline")
    return outcome


# ---- the answer on the wire: server-sent events, the client leaving --------

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
