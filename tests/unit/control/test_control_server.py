"""stoker.control plugged into the real server (a `stoker serve` process over
the fake engine core): auth, quotas, admission headers, metrics, request log,
and usage rows written by the time SIGTERM's drain has finished."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import FAKE_CORE, start_server
from sqlalchemy import select

from stoker.control.db import open_db, usage
from stoker.control.keys import KeyStore

pytestmark = pytest.mark.timeout(180)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("control-server")
    db = str(tmp / "stoker.db")
    store = KeyStore(open_db(db))
    keys = {
        "admin": store.create("root", admin=True),
        "user": store.create("user", rpm=3, models=["fake-model"]),
        "budget": store.create("budget", budget_tokens=40, budget_period="day"),
        "other": store.create("other-model-only", models=["nope"]),
    }
    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256"],
        str(tmp),
        env={"STOKER_DB": db, "STOKER_REQUIRE_AUTH": "true", "STOKER_FAKE_STEP_S": "0.005"},
    )
    try:
        yield server, {name: secret for name, (_, secret) in keys.items()}, db
    finally:
        server.stop()


def bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


def test_anthropic_clients_key_in_x_api_key(served) -> None:
    """Anthropic's clients send the key bare in x-api-key: it counts as the bearer token.
    (Runs first: test_control_plane_in_the_real_server counts its requests, then stops the server.)"""
    server, secrets, _ = served
    body = {"model": "fake-model", "max_tokens": 2, "messages": CHAT}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/v1/messages", json=body, headers={"x-api-key": secrets["admin"]}).status_code == 200
        r = http.post("/v1/messages", json=body, headers={"x-api-key": "sk-stoker-wrong"})
        assert r.status_code == 401
        assert http.post("/v1/messages", json=body).status_code == 401


def test_control_plane_in_the_real_server(served) -> None:
    server, secrets, db = served
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200 and http.get("/ready").status_code == 200
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3})
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        assert http.get("/v1/models").status_code == 401

        r = http.post(
            "/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 3},
            headers={**bearer(secrets["user"]), "X-Request-Id": "trace-me-1"},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "trace-me-1"
        assert r.headers["x-ratelimit-limit-requests"] == "3" and r.headers["x-ratelimit-remaining-requests"] == "2"
        # streaming passes through too
        with http.stream(
            "POST",
            "/v1/chat/completions",
            headers=bearer(secrets["user"]),
            json={"messages": CHAT, "max_tokens": 3, "stream": True, "priority": "batch"},
        ) as s:
            assert s.status_code == 200 and [x for x in s.iter_lines() if x][-1] == "data: [DONE]"
        http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}, headers=bearer(secrets["user"]))
        r = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}, headers=bearer(secrets["user"]))
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_exceeded"
        assert int(r.headers["retry-after"]) >= 1 and "x-ratelimit-reset-requests" in r.headers

        r = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}, headers=bearer(secrets["other"]))
        assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"

        for _ in range(3):  # 30-token chat requests (20 prompt + 10) against a 40-token daily budget
            last = http.post(
                "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 10}, headers=bearer(secrets["budget"])
            )
        assert last.status_code == 429 and last.json()["error"]["code"] == "insufficient_quota"

        r = http.post(
            "/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 2},
            headers={**bearer(secrets["admin"]), "x-stoker-deadline-ms": "abc", "x-request-id": "bad-dl"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-stoker-deadline-ms"
        r = http.post(
            "/v1/chat/completions",
            json={"model": "nope", "messages": CHAT},
            headers={**bearer(secrets["admin"]), "x-request-id": "no-model"},
        )
        assert r.status_code == 404

        keys = http.get("/admin/keys", headers=bearer(secrets["admin"])).json()["data"]
        assert len(keys) == 4
        assert http.get("/admin/keys", headers=bearer(secrets["user"])).status_code == 403

        assert http.get("/metrics").status_code == 401  # keys exist: /metrics takes one with the metrics scope
        metrics = http.get("/metrics", headers=bearer(secrets["admin"])).text
        assert 'vllm:request_success_total{finished_reason="length",model_name="fake-model"}' in metrics
        assert 'stoker:rate_limit_rejections_total{limit="requests"} 1.0' in metrics
        assert (
            "vllm:num_requests_running" in metrics and "vllm:e2e_request_latency_seconds_bucket" in metrics
        )  # the fake core stamps no first token

    assert server.stop() == 0
    lines = [json.loads(x) for x in server.log().splitlines() if x.startswith('{"ts"')]
    # Each line under the server's own request id, the client's X-Request-Id beside it.
    first = next(x for x in lines if x.get("client_request_id") == "trace-me-1")
    assert first["request_id"].startswith("req-")
    assert first["key_name"] == "user" and first["status"] == 200 and first["completion_tokens"] == 3
    assert (
        first["finish_reason"] == "length"
        and "ttft" in first
        and first["latency"] > 0
        and first["model"] == "fake-model"
    )
    assert not any(s in server.log() for s in secrets.values())
    by_id = {x.get("client_request_id"): x for x in lines}
    assert by_id["no-model"]["status"] == 404 and by_id["no-model"]["key_name"] == "root"
    assert by_id["bad-dl"]["status"] == 400
    # one line per request, refusals included (two from test_anthropic_clients_key_in_x_api_key,
    # one from /metrics without a key)
    assert sum(x["status"] == 401 for x in lines) == 5
    with open_db(db).connect() as conn:
        rows = conn.execute(select(usage)).fetchall()
    # Every admitted request, written by shutdown: 3 user, the x-api-key one, and 1 budget (a second
    # 30-token request could pass the 40-token budget: refused, as the third).
    assert len(rows) == 5
    assert {r.status for r in rows} == {200}


async def test_overload_gets_503_with_retry_after_while_health_stays_fast(tmp_path) -> None:
    import asyncio
    import time

    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256", "--max-num-seqs", "1"],
        str(tmp_path),
        env={"STOKER_DB": str(tmp_path / "o.db"), "STOKER_MAX_QUEUED_REQUESTS": "2", "STOKER_FAKE_STEP_S": "0.01"},
    )
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            body = {"prompt": "ab", "max_tokens": 20}
            tasks = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(12)]
            await asyncio.sleep(0.05)
            start = time.monotonic()
            assert (await http.get("/health")).status_code == 200
            health_s = time.monotonic() - start
            results = await asyncio.gather(*tasks)
            metrics = (await http.get("/metrics")).text
        statuses = sorted(r.status_code for r in results)
        assert set(statuses) == {200, 503} and statuses.count(200) >= 2, statuses
        refused = next(r for r in results if r.status_code == 503)
        assert refused.json()["error"]["type"] == "overloaded" and int(refused.headers["retry-after"]) >= 1
        assert health_s < 1.0
        assert 'stoker:admission_rejections_total{reason="queue_requests"}' in metrics
    finally:
        server.stop()
