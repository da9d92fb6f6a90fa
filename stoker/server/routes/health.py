"""Liveness, readiness and version: cheap, never behind the engine. /health and
/version answer anyone; /ready answers anyone its status code and whether the
server is ready, and its details (engine, pid, load) to a key holder only (or
to anyone in open mode): the control plane sets request.state.detailed."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request

import stoker
from stoker.server.state import get_state
from stoker.server.strict_json import StrictJSONResponse

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    """Live: the process answers. Says nothing about the model."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> StrictJSONResponse:
    """Ready: model loaded, warm-up done, engine alive (or asleep: its next request
    wakes it, docs/sleep.md), not draining. 503 otherwise.
    The body tells why, with the engine's latest load snapshot, to a caller that
    may see it; a probe without a key gets only {"ready": ...}."""
    state = get_state(request)
    if not getattr(request.state, "detailed", True):
        return StrictJSONResponse({"ready": state.ready}, status_code=200 if state.ready else 503)
    engine = state.engine
    body: dict[str, Any] = {
        "ready": state.ready,
        "loaded": state.loaded,
        "draining": state.draining,
        "engine_alive": engine.ready,
        "sleeping": state.default_version.sleep.asleep,
        "engine_restarts": engine.restart_count,
        "engine_pid": engine.info.pid if engine.info and engine.ready else None,
        "in_flight": state.num_in_flight,
        "engine_stats": dataclasses.asdict(engine.stats()),
    }
    if len(state.fleet.models) > 1 or state.fleet.retiring:
        # Ready means every model can answer; this says which cannot.
        body["models"] = {
            m.name: {
                "ready": m.available,
                "engine_alive": m.stable.engine.ready,
                "sleeping": m.stable.sleep.asleep,
                "engine_restarts": m.stable.engine.restart_count,
                "in_flight": sum(v.engine.num_in_flight for v in m.versions()),
            }
            for m in state.fleet.models.values()
        }
    if state.startup_error:
        body["error"] = state.startup_error
    return StrictJSONResponse(body, status_code=200 if state.ready else 503)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": stoker.__version__}
