"""The read-only figures the operator console draws, beside /admin: admin scope
(refused in open mode, as every operator endpoint), in /openapi.json under the
"console" tag, and left out with --no-ui.

    GET /console/live       per-model live figures, sampled each second (console_live.py)
    GET /console/requests   the most recent requests, newest first (RECENT_REQUESTS kept)
    GET /console/usage      tokens and requests per key per hour or day, from the usage ledger

Their paths are outside the request log's prefixes (stoker.server.control), so a
console polling every second writes no log line and does not push real requests
out of the recent-requests buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from sqlalchemy import Float, Integer, and_, cast, func, select
from starlette.concurrency import run_in_threadpool

from stoker.control.auth import get_plane, require_admin
from stoker.control.db import usage
from stoker.control.keys import ApiKey
from stoker.control.ledger import UsageLedger, period_start
from stoker.control.plane import ControlPlane
from stoker.errors import APIError
from stoker.server.console_live import HISTORY_SECONDS, QUANTILE_WINDOW, SAMPLE_INTERVAL, LiveSampler

RECENT_REQUESTS = 500
"""Requests the console's table keeps (the newest; per server process)."""
RECENT_FIELDS = (
    "ts",
    "request_id",
    "status",
    "method",
    "path",
    "model",
    "key_id",
    "key_name",
    "latency",
    "ttft",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "error",
)
BUCKET_SECONDS = {"hour": 3600, "day": 86400}
MAX_BUCKETS = {"hour": 168, "day": 90}
"""A week of hours, a quarter of days."""
MAX_USAGE_KEYS = 200

router = APIRouter(prefix="/console", tags=["console"], dependencies=[Depends(require_admin)])


class RecentRequests:
    """The last RECENT_REQUESTS request log lines, as the request log wrote them (a listener of it)."""

    def __init__(self, size: int = RECENT_REQUESTS) -> None:
        self.lines: deque[dict[str, object]] = deque(maxlen=size)

    def __call__(self, line: dict[str, object]) -> None:
        self.lines.append({name: line.get(name) for name in RECENT_FIELDS})

    def newest(self, limit: int) -> list[dict[str, object]]:
        return [self.lines[-1 - i] for i in range(min(limit, len(self.lines)))]


def _sampler(request: Request) -> LiveSampler:
    sampler: LiveSampler = request.app.state.console_sampler
    return sampler


@router.get("/live")
async def live(
    request: Request,
    since: Annotated[float, Query(ge=0, le=1e11, allow_inf_nan=False)] = 0.0,
) -> dict[str, Any]:
    """Samples taken after `since` (Unix seconds; 0: all kept, the last HISTORY_SECONDS), oldest first.
    Per model: running, waiting, kv_usage (0-1), output_tokens_per_s, requests_per_s, and
    ttft/itl p50/p99 in seconds over the trailing window; server-wide refusals per second by reason."""
    samples = [asdict(s) for s in _sampler(request).since(since)]
    return {
        "interval": SAMPLE_INTERVAL,
        "history_seconds": HISTORY_SECONDS,
        "quantile_window": QUANTILE_WINDOW,
        "now": time.time(),
        "samples": samples,
    }


@router.get("/requests")
async def recent_requests(
    request: Request, limit: Annotated[int, Query(ge=1, le=RECENT_REQUESTS)] = 100
) -> dict[str, Any]:
    """The newest `limit` requests this server logged (refusals included), newest first."""
    recent: RecentRequests = request.app.state.console_recent
    return {"object": "list", "size": RECENT_REQUESTS, "data": recent.newest(limit)}


def _bucket_index(seconds: int, dialect: str) -> Any:
    """The time bucket of a usage row: floor(created_at / seconds). SQLite's CAST truncates
    (floor, for times after 1970); PostgreSQL's rounds, so it gets floor() itself."""
    if dialect == "sqlite":
        return cast(usage.c.created_at / seconds, Integer)
    return cast(func.floor(usage.c.created_at / cast(seconds, Float)), Integer)


def usage_report(
    ledger: UsageLedger,
    keys: list[ApiKey],
    bucket: Literal["hour", "day"],
    buckets: int,
    key_id: str | None,
    now: float,
) -> dict[str, Any]:
    """Per key (the MAX_USAGE_KEYS with the most tokens in the window, or key_id's), requests and
    tokens per bucket over the last `buckets` buckets, and its tokens this budget period; and every
    active key's budget with the tokens it used this period (used before the window too)."""
    ledger.flush()
    seconds = BUCKET_SECONDS[bucket]
    first = int(now // seconds) - buckets + 1
    start = first * seconds
    index = _bucket_index(seconds, ledger.engine.dialect.name)
    tokens = func.sum(usage.c.prompt_tokens + usage.c.completion_tokens)
    where = [usage.c.created_at >= start, usage.c.key_id.is_not(None)]
    if key_id is not None:
        where.append(usage.c.key_id == key_id)
    with ledger.engine.connect() as conn:
        top = [
            row[0]
            for row in conn.execute(
                select(usage.c.key_id)
                .where(and_(*where))
                .group_by(usage.c.key_id)
                .order_by(tokens.desc())
                .limit(MAX_USAGE_KEYS)
            )
        ]
        rows = conn.execute(
            select(
                usage.c.key_id,
                index.label("bucket"),
                func.count().label("requests"),
                func.coalesce(func.sum(usage.c.prompt_tokens), 0).label("prompt_tokens"),
                func.coalesce(func.sum(usage.c.completion_tokens), 0).label("completion_tokens"),
            )
            .where(and_(*where), usage.c.key_id.in_(top))
            .group_by(usage.c.key_id, index)
        ).all()
    by_id = {k.id: k for k in keys}
    series: dict[str, list[dict[str, int]]] = {k: [] for k in top}
    for row in rows:
        series[row.key_id].append(
            {
                "t": int(row.bucket) * seconds,
                "requests": int(row.requests),
                "prompt_tokens": int(row.prompt_tokens),
                "completion_tokens": int(row.completion_tokens),
            }
        )
    report = []
    for kid in top:
        key = by_id.get(kid)
        entry: dict[str, Any] = {
            "key_id": kid,
            "key_name": key.name if key else None,
            "series": sorted(series[kid], key=lambda point: point["t"]),
        }
        if key is not None:
            entry["budget_tokens"] = key.budget_tokens
            entry["budget_period"] = key.budget_period
            entry["period_start"] = period_start(key.budget_period, now)
            entry["used_this_period"] = ledger.used(kid, key.budget_period, now)
        report.append(entry)
    budgets = [
        {
            "key_id": key.id,
            "budget_tokens": key.budget_tokens,
            "budget_period": key.budget_period,
            "used_this_period": ledger.used(key.id, key.budget_period, now),
        }
        for key in keys
        if key.budget_tokens is not None and not key.revoked
    ]
    return {"bucket": bucket, "bucket_seconds": seconds, "start": start, "keys": report, "budgets": budgets}


@router.get("/usage")
async def key_usage(
    request: Request,
    bucket: Literal["hour", "day"] = "hour",
    buckets: Annotated[int, Query(ge=1, le=max(MAX_BUCKETS.values()))] = 24,
    key_id: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
) -> dict[str, Any]:
    """Requests and tokens (prompt + completion: what budgets count) per key and per hour (up to 168)
    or day (up to 90), for the keys with the most tokens in that time (up to 200), or for key_id."""
    plane = get_plane(request)
    if buckets > MAX_BUCKETS[bucket]:
        raise APIError(
            400, f"buckets: at most {MAX_BUCKETS[bucket]} for bucket={bucket}", code="invalid_value", param="buckets"
        )
    keys = await run_in_threadpool(plane.keys.list_keys)
    return await run_in_threadpool(usage_report, plane.ledger, keys, bucket, buckets, key_id, time.time())


def install(app: FastAPI) -> None:
    """The routes, the sampler (for the app's lifetime) and the recent-requests listener.
    Needs the control plane (app.state.control): its metrics, request log, keys and ledger."""
    plane: ControlPlane = app.state.control
    sampler = LiveSampler(plane.metrics)
    recent = RecentRequests()
    plane.request_log.listeners.append(recent)
    app.state.console_sampler = sampler
    app.state.console_recent = recent
    app.include_router(router)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        task = asyncio.create_task(sampler.run())
        try:
            async with inner(a) as value:
                yield value
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app.router.lifespan_context = lifespan
