"""Two real `stoker serve` replicas (over the fake engine core) sharing one
redis-server and one key database: a key's rpm and concurrency hold across
both; Redis killed mid-test gives 503 + Retry-After (never 500), and service
comes back by itself when Redis does. A bad --redis-url stops `stoker serve`
at start with one line."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import pytest
from conftest import FAKE_CORE, REPO, TESTS_DIR, start_server, store_failures
from redis_server import RedisServer

from stoker.control.db import open_db
from stoker.control.keys import KeyStore

pytestmark = pytest.mark.timeout(180)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared-limits")
    redis = RedisServer(str(tmp))
    redis.start()
    db = str(tmp / "stoker.db")
    store = KeyStore(open_db(db))
    secrets = {
        "rpm": store.create("rpm", rpm=5)[1],
        "concurrent": store.create("concurrent", max_concurrent=2)[1],
        "plain": store.create("plain")[1],
        "tpm": store.create("tpm", tpm=2000)[1],
        "metrics": store.create("metrics", scopes=["metrics"])[1],
    }
    args = ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256", "--redis-url", redis.url]
    env = {"STOKER_DB": db, "STOKER_FAKE_STEP_S": "0.02"}
    servers = []
    try:
        for _ in range(2):
            servers.append(start_server(args, str(tmp), env=env))
            servers[-1].key = secrets["metrics"]  # /metrics takes a metrics-scope key
        yield servers, redis, secrets
    finally:
        for server in servers:
            server.stop()
        redis.stop()


def chat(server, secret: str, max_tokens: int = 2) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": max_tokens},
        headers={"Authorization": f"Bearer {secret}"},
        timeout=30,
    )


def test_rpm_holds_across_replicas(replicas) -> None:
    servers, _, secrets = replicas
    statuses = [chat(servers[i % 2], secrets["rpm"]).status_code for i in range(12)]
    # rpm=5 refills one request every 12 s; these 12 take well under that.
    assert statuses.count(200) == 5 and statuses.count(429) == 7, statuses


async def test_tpm_holds_across_replicas(replicas) -> None:
    servers, _, secrets = replicas
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as http:
        responses = await asyncio.gather(
            *(
                http.post(
                    f"{servers[i % 2].url}/v1/chat/completions",
                    json={"messages": CHAT, "max_tokens": 50},
                    headers={"Authorization": f"Bearer {secrets['tpm']}"},
                )
                for i in range(40)
            )
        )
    elapsed = time.monotonic() - started
    assert {r.status_code for r in responses} <= {200, 429}
    used = [r.json()["usage"]["total_tokens"] for r in responses if r.status_code == 200]
    cost = used[0]  # every request here costs the same: its estimate, fully used
    assert set(used) == {cost} and cost > 50
    # Together the replicas admit what one bucket of 2000 (+ its refill meanwhile) holds, no more.
    assert 2000 // cost <= len(used) <= (2000 + 2000 / 60 * elapsed) // cost, (len(used), cost, elapsed)


async def test_concurrency_holds_across_replicas(replicas) -> None:
    servers, _, secrets = replicas
    async with httpx.AsyncClient(timeout=30) as http:

        async def one(i: int) -> int:
            r = await http.post(
                f"{servers[i % 2].url}/v1/chat/completions",
                json={"messages": CHAT, "max_tokens": 40},  # ~0.8 s each at 20 ms a token
                headers={"Authorization": f"Bearer {secrets['concurrent']}"},
            )
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
            return r.status_code

        statuses = await asyncio.gather(*(one(i) for i in range(6)))
    assert sorted(statuses) == [200, 200, 429, 429, 429, 429], statuses
    # Released when they finished: both slots are free again, from either replica.
    assert [chat(servers[i], secrets["concurrent"]).status_code for i in (0, 1)] == [200, 200]


def test_redis_killed_gives_503_then_service_resumes(replicas) -> None:
    servers, redis, secrets = replicas
    assert chat(servers[0], secrets["plain"]).status_code == 200
    before = [store_failures(server, "redis")["acquire"] for server in servers]
    redis.stop()
    try:
        for server in servers:
            r = chat(server, secrets["plain"])
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "store_unavailable" and r.headers["retry-after"] == "2"
    finally:
        redis.start()
    # Each refusal is one failed acquire on the replica that refused it.
    assert [store_failures(server, "redis")["acquire"] for server in servers] == [n + 1 for n in before]
    # No stoker restart: the client reconnects on the next call.
    assert [chat(server, secrets["plain"]).status_code for server in servers] == [200, 200]
    assert [store_failures(server, "redis")["acquire"] for server in servers] == [n + 1 for n in before]
    for server in servers:
        assert "Redis at redis://127.0.0.1" in server.log() and "answers again" in server.log()


@pytest.mark.parametrize(
    "url,message",
    [
        ("http://127.0.0.1:6379", "not a Redis URL"),
        ("redis://user:hunter2@127.0.0.1:1/0", "cannot reach Redis"),
    ],
)
def test_bad_redis_url_refuses_to_start_in_one_line(url, message, tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "serve", "--engine-core", FAKE_CORE, "--no-embedding-model"]
        + ["--redis-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO]), "STOKER_DB": str(tmp_path / "k.db")},
    )
    err = proc.stderr.strip()
    assert proc.returncode == 2, proc.stderr
    assert len(err.splitlines()) == 1 and err.startswith("stoker serve: --redis-url ") and message in err, err
    assert "Traceback" not in err and "hunter2" not in err
