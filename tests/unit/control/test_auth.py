"""Auth, limits, budgets, admission and observability through a minimal FastAPI
app wired the way the server is meant to wire stoker.control (see docs/operations.md)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from typing import Annotated

import httpx
import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import func, select

from stoker.control.admin import router as admin_router
from stoker.control.auth import require_key, require_metrics_access
from stoker.control.db import usage
from stoker.control.keys import ApiKey
from stoker.control.plane import AuthRequiredButNoKeys, ControlPlane, ControlSettings
from stoker.engine.params import EngineStats, RequestTimes
from stoker.observe.logs import RequestIdMiddleware, RequestLogger
from stoker.observe.tracing import RequestTracer
from stoker.server.app import install_error_handlers
from stoker.server.hooks import FinishedRecord


def make_app(plane: ControlPlane) -> FastAPI:
    app = FastAPI()
    app.state.control = plane
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)
    app.include_router(admin_router)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(_key: Annotated[ApiKey | None, Depends(require_metrics_access)]) -> Response:
        body, ctype = plane.metrics.render()
        return Response(body, media_type=ctype)

    @app.post("/v1/completions")
    async def completions(
        body: dict, request: Request, key: Annotated[ApiKey | None, Depends(require_key)]
    ) -> JSONResponse:
        adm = await plane.admit_http(
            request,
            key,
            model=body["model"],
            prompt_tokens=body["prompt_tokens"],
            max_tokens=body["max_tokens"],
            priority=body.get("priority"),
            timeout=body.get("timeout"),
        )
        n = body.get("completion_tokens", 3)
        times = None
        try:
            await asyncio.sleep(body.get("hold", 0))  # stands in for the engine
            t = time.time()
            times = RequestTimes(adm.arrival, t - 0.003, t - 0.002, t, t, [t - 0.002, t - 0.001, t])
            return JSONResponse({"priority": adm.priority, "deadline": adm.deadline}, headers=adm.headers)
        finally:
            finished = FinishedRecord(
                request_id=adm.request_id,
                endpoint="completion",
                model=body["model"],
                status=200,
                prompt_tokens=body["prompt_tokens"],
                completion_tokens=n,
                cached_tokens=1,
                finish_reasons=["stop"],
                times=[times] if times is not None else [],
                http_request=request,
            )
            plane.gate.finish(adm, finished)

    return app


@pytest.fixture
def log_stream():
    stream = io.StringIO()
    logger = logging.getLogger("test.auth.requests")
    logger.handlers[:] = [logging.StreamHandler(stream)]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return stream, RequestLogger(logger=logger)


@pytest.fixture
def setup(tmp_path, log_stream):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = ControlSettings(
        db=str(tmp_path / "s.db"), max_queued_requests=4, max_queued_tokens=1000, model_name="smol", key_cache_ttl=0.0
    )
    planes = []

    def build(**overrides) -> tuple[ControlPlane, httpx.AsyncClient]:
        s = settings.model_copy(update=overrides)
        plane = ControlPlane.open(s, tracer=RequestTracer(provider=provider), request_log=log_stream[1])
        planes.append(plane)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=make_app(plane)), base_url="http://t")
        return plane, client

    yield build, exporter, log_stream[0]
    for p in planes:
        p.ledger.close()


def body(**kw) -> dict:
    return {"model": "smol", "prompt_tokens": 10, "max_tokens": 20, **kw}


def auth(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return err


async def test_open_mode_serves_without_key_but_admin_is_shut(setup, caplog):
    build, _, _ = setup
    with caplog.at_level(logging.WARNING, logger="stoker.control"):
        _, client = build()
    assert "OPEN" in caplog.text
    assert (await client.post("/v1/completions", json=body())).status_code == 200
    assert_openai_error(await client.get("/admin/keys"), 403, "insufficient_permissions")


async def test_open_mode_keeps_serving_while_the_key_database_is_away(setup, tmp_path):
    """Counting keys (is auth on yet?) against a database that cannot answer: the
    last answer stands (open), the failure is counted, no 500."""
    build, _, _ = setup
    plane, client = build()
    assert (await client.post("/v1/completions", json=body())).status_code == 200
    plane.keys.engine.dispose()  # pooled connections would still reach the old file
    db = tmp_path / "s.db"
    db.rename(tmp_path / "moved.db")
    db.mkdir()  # sqlite cannot open a directory: every new connection fails
    r = await client.post("/v1/completions", json=body())
    assert r.status_code == 200, r.text
    failures = plane.metrics.store_failures.labels("db", "key_lookup")._value.get()
    db.rmdir()
    (tmp_path / "moved.db").rename(db)  # back, so the ledger's rows land at teardown
    assert failures >= 1


async def test_require_auth_refuses_to_start_without_keys(setup):
    build, _, _ = setup
    with pytest.raises(AuthRequiredButNoKeys):
        build(require_auth=True)


async def test_auth_failures(setup):
    build, _, _ = setup
    plane, client = build()
    key, secret = plane.keys.create("alice", models=["smol"])
    _, expired = plane.keys.create("old", expires_at=time.time() + 0.05)
    assert (await client.get("/health")).status_code == 200
    r = await client.post("/v1/completions", json=body())
    assert_openai_error(r, 401, "missing_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    assert_openai_error(await client.post("/v1/completions", json=body(), headers={"Authorization": "Basic x"}), 401)
    assert_openai_error(
        await client.post("/v1/completions", json=body(), headers=auth("sk-nope")), 401, "invalid_api_key"
    )
    assert_openai_error(
        await client.post("/v1/completions", json=body(), headers=auth(secret[:-2] + "zz")), 401, "invalid_api_key"
    )
    assert (await client.post("/v1/completions", json=body(), headers=auth(secret))).status_code == 200
    err = assert_openai_error(
        await client.post("/v1/completions", json=body(model="other"), headers=auth(secret)), 403, "model_not_allowed"
    )
    assert err["param"] == "model"
    await asyncio.sleep(0.06)
    assert_openai_error(
        await client.post("/v1/completions", json=body(), headers=auth(expired)), 401, "api_key_expired"
    )
    plane.keys.revoke(key.id)
    assert_openai_error(await client.post("/v1/completions", json=body(), headers=auth(secret)), 401, "api_key_revoked")
    assert_openai_error(await client.get("/admin/keys", headers=auth(secret)), 401)


async def test_admin_api(setup):
    build, _, _ = setup
    plane, client = build()
    _, admin = plane.keys.create("root", admin=True)
    _, user = plane.keys.create("user")
    assert_openai_error(await client.get("/admin/keys", headers=auth(user)), 403, "insufficient_permissions")
    r = await client.post("/admin/keys", json={"name": "new", "rpm": 5, "models": ["smol"]}, headers=auth(admin))
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["secret"].startswith("sk-stoker-") and created["rpm"] == 5
    assert (await client.post("/v1/completions", json=body(), headers=auth(created["secret"]))).status_code == 200
    listed = (await client.get("/admin/keys", headers=auth(admin))).json()["data"]
    assert {k["name"] for k in listed} == {"root", "user", "new"}
    assert all("secret" not in k and "secret_hash" not in k for k in listed)
    shown = (await client.get(f"/admin/keys/{created['id']}", headers=auth(admin))).json()
    assert shown["usage"]["this_period"]["requests"] == 1
    assert shown["usage"]["this_period"]["total_tokens"] == 13  # 10 prompt + 3 completion, reconciled
    assert (await client.delete(f"/admin/keys/{created['id']}", headers=auth(admin))).json()["revoked"]
    assert_openai_error(
        await client.post("/v1/completions", json=body(), headers=auth(created["secret"])), 401, "api_key_revoked"
    )
    assert_openai_error(await client.get("/admin/keys/nope", headers=auth(admin)), 404)
    assert_openai_error(await client.delete("/admin/keys/nope", headers=auth(admin)), 404, "key_not_found")
    assert (await client.post("/admin/keys", json={"name": "x", "bogus": 1}, headers=auth(admin))).status_code == 400
    # true is not a limit of 1 token a minute, nor 1 an admin flag
    for bad in ({"tpm": True}, {"rpm": False}, {"admin": 1}, {"expires_at": True}):
        answer = await client.post("/admin/keys", json={"name": "x", **bad}, headers=auth(admin))
        assert answer.status_code == 400, (bad, answer.text)


async def test_rate_limit_429_and_headers(setup):
    build, _, _ = setup
    plane, client = build()
    _, secret = plane.keys.create("limited", rpm=2, tpm=1000)
    ok = await client.post("/v1/completions", json=body(), headers=auth(secret))
    assert ok.status_code == 200
    assert ok.headers["x-ratelimit-limit-requests"] == "2" and ok.headers["x-ratelimit-remaining-requests"] == "1"
    assert ok.headers["x-ratelimit-limit-tokens"] == "1000"
    await client.post("/v1/completions", json=body(), headers=auth(secret))
    r = await client.post("/v1/completions", json=body(), headers=auth(secret))
    err = assert_openai_error(r, 429, "rate_limit_exceeded")
    assert err["type"] == "rate_limit_exceeded"
    assert int(r.headers["retry-after"]) >= 1
    for h in (
        "limit-requests",
        "remaining-requests",
        "reset-requests",
        "limit-tokens",
        "remaining-tokens",
        "reset-tokens",
    ):
        assert f"x-ratelimit-{h}" in r.headers


async def test_tokens_per_minute_limit(setup):
    build, _, _ = setup
    plane, client = build()
    _, secret = plane.keys.create("tpm", tpm=100)
    assert (await client.post("/v1/completions", json=body(max_tokens=70), headers=auth(secret))).status_code == 200
    # 80 estimated, 13 used: 67 refunded, so another 80 fits only thanks to reconciliation.
    assert (await client.post("/v1/completions", json=body(max_tokens=70), headers=auth(secret))).status_code == 200
    r = await client.post("/v1/completions", json=body(max_tokens=90), headers=auth(secret))
    assert_openai_error(r, 429, "rate_limit_exceeded")


async def test_concurrency_limit(setup):
    build, _, _ = setup
    plane, client = build()
    _, secret = plane.keys.create("conc", max_concurrent=1)
    slow = asyncio.create_task(client.post("/v1/completions", json=body(hold=0.3), headers=auth(secret)))
    await asyncio.sleep(0.1)
    r = await client.post("/v1/completions", json=body(), headers=auth(secret))
    assert_openai_error(r, 429, "rate_limit_exceeded")
    assert (await slow).status_code == 200
    assert (await client.post("/v1/completions", json=body(), headers=auth(secret))).status_code == 200


async def test_budget_exhaustion(setup):
    build, _, _ = setup
    plane, client = build()
    _, secret = plane.keys.create("budget", budget_tokens=30, budget_period="day")
    small = body(max_tokens=3)  # an estimate of 13, all used
    assert (await client.post("/v1/completions", json=small, headers=auth(secret))).status_code == 200  # 13
    assert (await client.post("/v1/completions", json=small, headers=auth(secret))).status_code == 200  # 26
    r = await client.post("/v1/completions", json=small, headers=auth(secret))  # 39 would pass the budget
    err = assert_openai_error(r, 429, "insufficient_quota")
    assert err["type"] == "insufficient_quota" and int(r.headers["retry-after"]) > 1


async def test_overload_503_with_retry_after_and_no_quota_charge(setup):
    build, _, _ = setup
    plane, client = build()
    _, secret = plane.keys.create("k", rpm=100)
    plane.update_engine_stats(EngineStats(num_waiting=4, num_waiting_tokens=100))
    r = await client.post("/v1/completions", json=body(), headers=auth(secret))
    err = assert_openai_error(r, 503, "overloaded")
    assert err["type"] == "overloaded" and int(r.headers["retry-after"]) >= 1
    assert plane.limiter.headers(plane.keys.list_keys()[0])["x-ratelimit-remaining-requests"] == "100"
    plane.update_engine_stats(EngineStats())
    assert (await client.post("/v1/completions", json=body(), headers=auth(secret))).status_code == 200
    plane.start_drain()
    assert_openai_error(await client.post("/v1/completions", json=body(), headers=auth(secret)), 503, "draining")


async def test_priority_and_deadline_reach_the_engine(setup):
    build, _, _ = setup
    plane, client = build()
    _, batch = plane.keys.create("b", priority="batch")
    r = await client.post("/v1/completions", json=body(priority=0, timeout=3600), headers=auth(batch))
    assert r.json()["priority"] == 1  # never above the key's class
    assert r.json()["deadline"] == pytest.approx(time.time() + 300, abs=5)  # capped by max_queue_wait
    r = await client.post(
        "/v1/completions", json=body(priority=5), headers={**auth(batch), "x-stoker-deadline-ms": "1500"}
    )
    assert r.json()["priority"] == 5 and r.json()["deadline"] == pytest.approx(time.time() + 1.5, abs=1)
    assert_openai_error(await client.post("/v1/completions", json=body(priority="top"), headers=auth(batch)), 400)


async def test_metrics_logs_traces_and_ledger(setup, tmp_path):
    build, exporter, stream = setup
    plane, client = build(metrics_require_auth=True)
    _, secret = plane.keys.create("obs", rpm=1, scopes=["inference", "metrics"])
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = await client.post(
        "/v1/completions",
        json=body(),
        headers={**auth(secret), "x-request-id": "req-abc", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
    )
    assert r.headers["x-request-id"] == "req-abc"
    assert (await client.post("/v1/completions", json=body(), headers=auth(secret))).status_code == 429
    assert (await client.get("/metrics")).status_code == 401
    text = (await client.get("/metrics", headers=auth(secret))).text
    assert 'vllm:request_success_total{finished_reason="stop",model_name="smol"} 1.0' in text
    assert 'stoker:rate_limit_rejections_total{limit="requests"} 1.0' in text
    assert 'stoker:auth_failures_total{reason="missing"} 1.0' in text
    assert "vllm:time_to_first_token_seconds_count" in text

    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(x["status"], x.get("error")) for x in lines] == [
        (200, None),
        (429, "rate_limit_exceeded"),
        (401, "missing_api_key"),
    ]
    first = lines[0]
    # The request's own id is the server's; the client's X-Request-Id is logged beside it.
    assert first["client_request_id"] == "req-abc" and first["request_id"].startswith("req-")
    assert first["request_id"] != "req-abc" and first["key_name"] == "obs" and first["completion_tokens"] == 3
    assert (
        first["cached_tokens"] == 1 and "ttft" in first and "queue_time" in first and first["finish_reason"] == "stop"
    )
    assert secret not in stream.getvalue()

    roots = [s for s in exporter.get_finished_spans() if s.name == "stoker.request"]
    ok = next(s for s in roots if s.attributes.get("stoker.client_request_id") == "req-abc")
    assert ok.attributes["stoker.request_id"] == first["request_id"]
    assert format(ok.context.trace_id, "032x") == trace_id
    children = {s.name for s in exporter.get_finished_spans() if s.parent and s.parent.span_id == ok.context.span_id}
    assert children == {"admission", "queue", "prefill", "decode"}

    plane.close()  # what the server's shutdown does: every usage row lands
    with plane.keys.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(usage)).scalar_one() == 1
