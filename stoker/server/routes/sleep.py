"""Sleep and wake models on an operator's word (vLLM's names and shapes).

    POST /sleep[?model=NAME][&level=1]   drain, then end the engine process: weights and KV cache freed
    POST /wake_up[?model=NAME]           start it again (a request would wake it too)
    GET  /is_sleeping[?model=NAME]       {"is_sleeping": bool}
    POST /admin/models/{name}/sleep, /admin/models/{name}/wake   the same through the admin API

Without `model`, every model of the fleet: the server sleeps (is_sleeping:
every model sleeps). A sleeping model stays listed and ready; its next
request wakes it (docs/sleep.md). vLLM's levels 1 (weights offloaded to CPU
memory) and 2 (weights discarded) both end the engine process here, which
frees more than either. Audience: an admin key (the operator scope), never
open: sleeping a model makes every client wait for its wake.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request

from stoker.errors import APIError
from stoker.server.fleet import ModelVersion, ServedModel
from stoker.server.state import ServerState, operator_state

router = APIRouter(tags=["admin"])

MODEL_QUERY = Query(None, min_length=1, max_length=128, description="the model to act on; none: every model")


def _models(state: ServerState, name: str | None) -> list[ServedModel]:
    if name is None:
        return list(state.fleet.models.values())
    model = state.fleet.models.get(name)
    if model is None:
        served = ", ".join(state.fleet.models) or "none"
        raise APIError(
            404,
            f"model {name} is not loaded (models: {served}); an adapter sleeps with its base model",
            param="model",
            code="model_not_found",
        )
    return [model]


def _versions(models: list[ServedModel]) -> list[ModelVersion]:
    """The versions that serve: stable and canary (a loading one has not served, a draining one ends)."""
    return [v for m in models for v in (m.stable, m.canary) if v is not None]


def _state(models: list[ServedModel]) -> dict[str, Any]:
    versions = _versions(models)
    return {
        "is_sleeping": bool(versions) and all(v.sleep.asleep for v in versions),
        "models": {m.name: {"is_sleeping": all(v.sleep.asleep for v in _versions([m]))} for m in models},
    }


async def _sleep(state: ServerState, models: list[ServedModel]) -> dict[str, Any]:
    versions = _versions(models)
    await asyncio.gather(*(state.fleet.sleep.sleep(v) for v in versions))  # each drains at once
    down = [v for v in versions if not v.sleep.asleep]
    if down:
        # Its engine is restarting after a crash (or failed): nothing to put to sleep, and no wake would follow.
        raise APIError(
            409,
            f"model {down[0].name} {down[0].label} cannot sleep now: its engine is not running "
            f"({down[0].engine.last_error or 'restarting'})",
            code="not_running",
        )
    return _state(models)


async def _wake(state: ServerState, models: list[ServedModel]) -> dict[str, Any]:
    await asyncio.gather(*(state.fleet.sleep.wake(v) for v in _versions(models)))
    return _state(models)


@router.post("/sleep")
async def sleep(request: Request, model: str | None = MODEL_QUERY, level: int = Query(1, ge=1, le=2)) -> dict[str, Any]:
    """Put a model (none: every model) to sleep now; its requests in flight finish first."""
    state = await operator_state(request)
    return await _sleep(state, _models(state, model))


@router.post("/wake_up")
async def wake_up(request: Request, model: str | None = MODEL_QUERY) -> dict[str, Any]:
    """Wake a sleeping model (none: every model); answers once its engine serves."""
    state = await operator_state(request)
    return await _wake(state, _models(state, model))


@router.get("/is_sleeping")
async def is_sleeping(request: Request, model: str | None = MODEL_QUERY) -> dict[str, Any]:
    state = await operator_state(request)
    return _state(_models(state, model))


@router.post("/admin/models/{name:model_name}/sleep")
async def admin_sleep(name: str, request: Request) -> dict[str, Any]:
    state = await operator_state(request)
    return {"name": name, **await _sleep(state, _models(state, name))}


@router.post("/admin/models/{name:model_name}/wake")
async def admin_wake(name: str, request: Request) -> dict[str, Any]:
    state = await operator_state(request)
    return {"name": name, **await _wake(state, _models(state, name))}
