"""Plugs the control plane into stoker's server: stoker.server.app imports this
module (its EXTENSIONS list) and calls install(app, state).

What it adds, through the server's hooks and nothing else:
  before    Bearer auth on every /v1/* and tokenizer route (401/403)
  admit     model allow-list, budget, rate limits, capacity (403/429/503);
            sets request.state.priority / .deadline for the engine request
  finished  limits reconciled, usage row, metrics, JSON log line, trace
plus /admin/keys, GET /metrics, X-Request-Id and x-ratelimit-* response
headers (ControlMiddleware), and a task feeding engine stats to admission and
metrics for the app's lifetime. Settings: state.extras["control_config"] (a
ControlSettings built by `stoker serve` from its options, YAML and STOKER_*
variables, or a dict) if the server put one there, else STOKER_* environment
variables (STOKER_DB, STOKER_REQUIRE_AUTH, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stoker.control.admin import router as admin_router
from stoker.control.auth import (
    authenticate,
    get_plane,
    optional_key,
    require_metrics_access,
    require_operator,
    require_scope,
)
from stoker.control.keys import SCOPE_ROUTER
from stoker.control.plane import ControlPlane
from stoker.control.settings import ControlSettings
from stoker.engine.params import EngineStats
from stoker.errors import APIError
from stoker.observe.cost import CostMeter
from stoker.observe.logs import RequestIdMiddleware, RequestRecord
from stoker.server.fleet import Fleet
from stoker.server.hooks import AdmissionInfo, FallbackEvent, FinishedRecord
from stoker.server.state import OUTSIDE_ENGINE, POOLING_ENDPOINTS, ServerState
from stoker.server.strict_json import StrictJSONResponse

log = logging.getLogger("stoker.control")

STATS_INTERVAL = 0.25
# API routes whose every request gets a log line (health probes, /metrics and the
# routers' polls of /get_load do not; an operator's /flush_cache does).
LOGGED_PREFIXES = ("/v1/", "/v2/", "/rerank", "/score", "/tokenize", "/detokenize", "/admin/", "/flush_cache")
# The engine pushes a snapshot at most ~0.2 s after the fact; requests admitted
# within this margin before we saw it may not be in it yet.
STATS_LAG = 0.25


# Who may call what besides the /v1 API (which the before hook guards) and
# /admin (admin keys): path -> scope, None meaning any valid key. Open in open
# mode, except the operator actions of OPERATOR_PATHS, shut there. Exact paths,
# as the router matches them (a trailing slash only earns a redirect to these).
SCOPED_PATHS: dict[str, str | None] = {
    "/get_load": SCOPE_ROUTER,
    "/server_info": SCOPE_ROUTER,
    "/get_server_info": SCOPE_ROUTER,
    "/model_info": SCOPE_ROUTER,
    "/get_model_info": SCOPE_ROUTER,
    "/docs": None,
    "/docs/oauth2-redirect": None,
    "/redoc": None,
    "/openapi.json": None,
}
# Operator actions a router fans out to every replica: the router scope, never open.
OPERATOR_PATHS: dict[str, str] = {"/flush_cache": SCOPE_ROUTER}
# Answered to everyone, in more detail to a key holder (or in open mode): the
# route reads request.state.detailed.
DETAILED_PATHS = frozenset({"/ready"})


class AccessMiddleware:
    """Guards the endpoints of SCOPED_PATHS, OPERATOR_PATHS and DETAILED_PATHS
    before they run: the routes themselves know nothing of keys."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path in SCOPED_PATHS or path in OPERATOR_PATHS or path in DETAILED_PATHS:
            request = Request(scope)
            try:
                if path in OPERATOR_PATHS:
                    await require_operator(request, OPERATOR_PATHS[path])
                elif path in SCOPED_PATHS:
                    await require_scope(request, SCOPED_PATHS[path])
                else:
                    request.state.detailed, _ = await optional_key(request)
            except APIError as exc:
                await StrictJSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def settings_from(state: ServerState) -> ControlSettings:
    given = state.extras.get("control_config")
    if isinstance(given, ControlSettings):
        return given
    values: dict[str, object] = {}
    for name, info in ControlSettings.model_fields.items():
        raw = os.environ.get(f"STOKER_{name.upper()}")
        if raw is not None:
            values[name] = None if raw.lower() in ("none", "null", "") and not info.is_required() else raw
    if isinstance(given, dict):
        values.update(given)
    return ControlSettings.model_validate(values)


class ControlMiddleware:
    """Arrival time, and the key's x-ratelimit-* headers on admitted responses;
    it runs inside RequestIdMiddleware, which gives the request its id and
    answers X-Request-Id. Also a safety net: an admission still open when the
    response is over is finished here, so a code path that forgot the finished
    hook cannot leak a concurrency slot."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope["state"]
        request_id: str = state["request_id"]
        state["arrival"] = time.time()
        status = {"code": 500}

        async def send_wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                adm = state.get("admission")
                if adm is not None:
                    headers = list(message.get("headers", []))
                    present = {k.lower() for k, _ in headers}
                    headers += [(k.encode(), v.encode()) for k, v in adm.headers.items() if k.encode() not in present]
                    message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_wrapped)
        finally:
            plane: ControlPlane = scope["app"].state.control
            adm = state.get("admission")
            if adm is not None and not adm.done:
                unfinished = FinishedRecord(
                    request_id=adm.request_id,
                    endpoint="",  # no route finished it: its log line names no endpoint
                    model=adm.model,
                    status=status["code"],
                    prompt_tokens=adm.prompt_tokens,
                    error="request ended without a finish record",
                )
                plane.gate.finish(adm, unfinished)
            elif adm is None and not state.get("logged") and scope.get("path", "").startswith(LOGGED_PREFIXES):
                # Refused before admission by the server itself (400, 404, 413, ...):
                # still one log line per request.
                key = state.get("api_key")
                plane.request_log.log(
                    RequestRecord(
                        request_id=request_id,
                        status=status["code"],
                        key_id=key.id if key else None,
                        key_name=key.name if key else None,
                        method=scope.get("method"),
                        path=scope.get("path"),
                        latency=time.time() - state["arrival"],
                    )
                )


async def _before(request: Request) -> None:
    await authenticate(request)


async def _operator(request: Request) -> None:
    await require_operator(request)


async def _admit(request: Request, info: AdmissionInfo) -> None:
    plane = get_plane(request)
    if info.endpoint not in OUTSIDE_ENGINE:
        # Its own queue bound from its first request on, not from the next stats tick (an adapter: its base's).
        plane.track_model(info.model, request.app.state.stoker.fleet.adapters.base_of(info.model))
    try:
        adm = await plane.admit_http(
            request,
            getattr(request.state, "api_key", None),
            model=info.model,
            prompt_tokens=info.prompt_tokens,
            max_tokens=info.max_tokens,
            n=info.n,
            prompts=info.prompts,
            priority=info.priority,
            timeout=info.timeout,
            arrival=getattr(request.state, "arrival", None),
            capacity=info.endpoint not in OUTSIDE_ENGINE,
        )
    except APIError as exc:
        if exc.status != 400:  # gate.admit logged its own refusals; a bad priority/deadline is left to the middleware
            request.state.logged = True
        raise
    request.state.admission = adm
    request.state.priority = adm.priority
    request.state.deadline = adm.deadline


def _finished(record: FinishedRecord) -> None:
    request = record.http_request
    if request is None:
        return
    adm = getattr(request.state, "admission", None)
    if adm is None:
        return
    plane = get_plane(request)
    version = record.model_version
    if version is not None and record.endpoint in POOLING_ENDPOINTS:
        ok = record.status < 400
        plane.metrics.observe_version(record.model, version, ok, None, time.time() - record.started)
    elif version is not None and record.endpoint not in OUTSIDE_ENGINE:
        first = record.times[0] if record.times else None
        plane.metrics.observe_version(
            record.model,
            version,
            record.status < 400 and record.error in (None, "deadline"),
            first.first_token - first.arrival if first and first.first_token is not None else None,
            first.finished - first.arrival if first and first.finished is not None else None,
        )
    plane.gate.finish(adm, record, generation=record.endpoint not in OUTSIDE_ENGINE)


async def _metrics(request: Request) -> Response:
    body, content_type = get_plane(request).metrics.render()
    return Response(body, media_type=content_type)


async def _feed_stats(plane: ControlPlane, state: ServerState) -> None:
    """Each engine's stats -> its model's admission and metrics; engine restarts,
    the versions loaded, costs and drain -> metrics."""
    last: dict[int, EngineStats] = {}
    restarts: dict[int, int] = {}
    cost = CostMeter(plane.settings.cost_per_hour) if plane.settings.cost_per_hour is not None else None
    while True:
        if state.loaded:
            _feed_fleet(plane, state.fleet, last, restarts, cost)
        if state.draining and not plane.admission.draining:
            plane.start_drain()
        await asyncio.sleep(STATS_INTERVAL)


def _feed_fleet(
    plane: ControlPlane,
    fleet: Fleet,
    last: dict[int, EngineStats],
    restarts: dict[int, int],
    cost: CostMeter | None,
) -> None:
    live: set[int] = set()
    plane.metrics.set_sleeping({m.name: m.stable.sleep.asleep for m in fleet.models.values()})
    if fleet.models:
        plane.metrics.model_name = fleet.default.name
    for served in list(fleet.models.values()):
        plane.track_model(served.name)
    for version in fleet.versions():
        engine = version.engine
        key = id(engine)
        live.add(key)
        source = f"{version.name}/{version.label}"
        for _ in range(engine.restart_count - restarts.get(key, 0)):
            plane.engine_restarted(source)
        restarts[key] = engine.restart_count
        for seconds in version.sleep.take_wakes():
            plane.metrics.model_wake_seconds.labels(version.name).observe(seconds)
        stats = engine.stats()
        previous = last.get(key)
        if stats is previous:
            continue
        if cost is not None:
            before = previous if previous is not None and previous.steps <= stats.steps else None
            cost.add(
                version.name,
                stats.prompt_tokens - (before.prompt_tokens if before else 0),
                stats.generation_tokens - (before.generation_tokens if before else 0),
                stats.busy_seconds - (before.busy_seconds if before else 0.0),
            )
        model = fleet.models.get(version.name)
        stable = model is not None and model.stable is version
        plane.update_engine_stats(
            stats, taken_at=time.time() - STATS_LAG, model=version.name, source=source, queue=stable
        )
        last[key] = stats
    for key in set(last) - live:  # retired versions
        last.pop(key, None)
        restarts.pop(key, None)
    plane.metrics.set_model_versions(
        [
            (
                v.name,
                v.label,
                v.digest or "",
                # The file's name, not its absolute path: a metrics key is not an admin key.
                os.path.basename(os.path.normpath(v.spec.path)),
                v.status,
                v.engine.info.quantized_matmul if v.engine.info else "",
            )
            for v in fleet.versions()
            if v.status != "failed"
        ]
    )
    if cost is not None:
        costs = cost.costs()
        for name in set(costs) - set(fleet.models):  # unloaded models
            cost.forget(name)
            del costs[name]
        plane.metrics.set_costs(costs)


def _fallback(plane: ControlPlane, event: FallbackEvent) -> None:
    plane.metrics.fallbacks.labels(event.asked, event.served, event.reason).inc()
    log.info("fallback: %s -> %s (%s)", event.asked, event.served, event.reason)


def install(app: FastAPI, state: ServerState) -> ControlPlane:
    settings = settings_from(state)
    plane = ControlPlane.open(settings)
    host = state.config.host
    try:
        plane.check_exposure(host, settings.allow_open)
    except Exception:
        plane.close()
        raise
    app.state.control = plane
    state.extras["control"] = plane
    app.include_router(admin_router)
    app.add_api_route(
        "/metrics", _metrics, methods=["GET"], dependencies=[Depends(require_metrics_access)], include_in_schema=False
    )
    app.add_middleware(AccessMiddleware)  # inside ControlMiddleware: a refusal has its request id and log line
    app.add_middleware(ControlMiddleware)
    # Just outside ControlMiddleware: every response, refusals included, carries the id.
    app.add_middleware(RequestIdMiddleware)
    state.hooks.before.append(_before)
    state.hooks.admit.append(_admit)
    state.hooks.finished.append(_finished)
    state.hooks.operator.append(_operator)
    state.hooks.fallback.append(lambda event: _fallback(plane, event))

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        feeder = asyncio.create_task(_feed_stats(plane, state))
        try:
            async with inner(a) as value:
                yield value
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeder
            await plane.aclose()
            plane.close()  # after the drain: every usage row is written

    app.router.lifespan_context = lifespan
    return plane
