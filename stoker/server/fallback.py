"""Serving a request from its model's fallback chain.

The routes hand over one attempt (tokenize for the model, admit, run until
the first token); this walks the chain `--fallback` gave the model. A model
that is unavailable (engine down, restarting, loading) is skipped; one whose
attempt ends in a 503 before anything was sent (its admission is full, its
engine died before the first token) hands over to the next. Nothing is
switched once a response has started, so a stream never changes model
midway. A fallback that refuses for its own reasons (the key may not use it,
the prompt does not fit its context) ends the walk with the first model's
503: the client hears about the model it asked for.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi.responses import Response

from stoker.errors import APIError
from stoker.server.fleet import ModelVersion
from stoker.server.hooks import FallbackEvent
from stoker.server.state import ServerState

SERVED_HEADER = "x-stoker-model-served"
"""Response header naming the model that answered (also the body's `model`)."""
VERSION_HEADER = "x-stoker-model-version"
"""Response header naming the version of it that answered ("v2"): how a client sees a canary."""

Attempt = Callable[[ModelVersion], Awaitable[Response]]


async def serve_from_chain(state: ServerState, name: str | None, attempt: Attempt) -> Response:
    state.check_accepting()
    chain = state.fleet.chain(name)
    state.fleet.check_kind(chain[0], "generate", "generation")
    first_error: APIError | None = None
    reason = "unavailable"
    for position, model in enumerate(chain):
        try:
            state.fleet.check_available(model)
            version = state.fleet.pick(model)
            version.holds += 1
            try:
                response = await attempt(version)
            finally:
                version.holds -= 1
        except APIError as exc:
            if exc.status != 503 or exc.code == "draining":
                if first_error is None:
                    raise
                raise first_error from None
            if first_error is None:
                first_error = exc
                reason = "overloaded" if exc.code == "overloaded" else "unavailable"
            continue
        response.headers[SERVED_HEADER] = model.name
        response.headers[VERSION_HEADER] = version.label
        if position:
            state.hooks.run_fallback(FallbackEvent(chain[0].name, model.name, reason))
        return response
    assert first_error is not None
    raise first_error
