"""Priority, deadlines, one request id and drain-rate Retry-After, against a
real `stoker serve` over the fake engine core (tests/server_fakes.py), whose
queue follows EngineCore's contract: waiting requests ordered by (priority,
deadline, arrival), --max-num-seqs running, deadlines dropping waiting
requests with error "deadline" and aborting running ones."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest
from conftest import (
    FAKE_CORE,
    ServerProcess,
    auth,
    engine_stats,
    start_server,
    wait_for,
)
from sqlalchemy import Row, select

from stoker.control.db import open_db, usage
from stoker.control.keys import KeyStore

pytestmark = pytest.mark.timeout(120)
STEP_S = 0.02  # fake engine: 50 tokens/s


async def ledger_rows(db: str, request_ids: set[str]) -> dict[str, Row]:
    """The usage rows by request id, once each of request_ids has one: the ledger writes
    them every --ledger-flush-interval (1 s here)."""
    engine = open_db(db)

    def rows() -> dict[str, Row]:
        with engine.connect() as conn:
            return {r.request_id: r for r in conn.execute(select(usage)).fetchall()}

    await wait_for(lambda: request_ids <= rows().keys(), 10, f"usage rows for {sorted(request_ids)}", interval=0.05)
    return rows()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server, one running sequence at a time, two keys of different class."""
    tmp = tmp_path_factory.mktemp("control-scheduling")
    db = str(tmp / "stoker.db")
    store = KeyStore(open_db(db))
    secrets = {
        "interactive": store.create("fg", priority="interactive")[1],
        "batch": store.create("bg", priority="batch")[1],
    }
    ops = store.create("ops", scopes=["metrics"])[1]  # /ready's details and /metrics need a key here
    server = start_server(
        [
            "--engine-core",
            FAKE_CORE,
            "--no-embedding-model",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "1",
            "--db",
            db,
            "--require-auth",
        ],
        str(tmp),
        env={"STOKER_FAKE_STEP_S": str(STEP_S)},
    )
    server.key = ops
    try:
        yield server, secrets, db
    finally:
        server.stop()


async def wait_idle(server: ServerProcess) -> None:
    await wait_for(
        lambda: engine_stats(server)["num_running"] == 0 and engine_stats(server)["num_waiting"] == 0, 10, "idle"
    )


def log_lines(server: ServerProcess) -> list[dict]:
    return [json.loads(x) for x in server.log().splitlines() if x.startswith('{"ts"')]


def by_client_id(server: ServerProcess) -> dict[str, dict]:
    """Log lines by the X-Request-Id the test sent (each line's request_id is the server's own)."""
    return {x["client_request_id"]: x for x in log_lines(server) if "client_request_id" in x}


async def test_interactive_requests_are_served_before_batch_ones(served) -> None:
    server, secrets, _ = served
    await wait_idle(server)
    finished: list[str] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:

        async def call(name: str, key: str, max_tokens: int, **body) -> httpx.Response:
            r = await http.post(
                "/v1/completions",
                headers=auth(secrets[key], **{"x-request-id": name}),
                json={"prompt": "q", "max_tokens": max_tokens, **body},
            )
            finished.append(name)
            return r

        # An interactive request holds the only running slot (so nothing is
        # preempted); batch requests queue first, interactive ones after them.
        blocker = asyncio.create_task(call("blocker", "interactive", 100))
        await wait_for(lambda: engine_stats(server)["num_running"] == 1, 5, "blocker running")
        tasks = []
        for i in range(3):
            # A batch key asking for "interactive" is clamped to its class.
            tasks.append(asyncio.create_task(call(f"batch-{i}", "batch", 2, priority="interactive")))
            await asyncio.sleep(0.03)
        for i in range(3):
            tasks.append(asyncio.create_task(call(f"interactive-{i}", "interactive", 2)))
            await asyncio.sleep(0.03)
        await wait_for(lambda: engine_stats(server)["num_waiting"] == 6, 5, "six requests waiting")
        results = await asyncio.gather(blocker, *tasks)
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert finished[0] == "blocker"
    assert set(finished[1:4]) == {f"interactive-{i}" for i in range(3)}, finished
    assert set(finished[4:]) == {f"batch-{i}" for i in range(3)}, finished
    priorities = {name: x["priority"] for name, x in by_client_id(server).items()}
    assert priorities["batch-0"] == 1 and priorities["interactive-0"] == 0


async def test_deadline_drop_is_504_timeout_and_a_late_one_ends_with_abort(served) -> None:
    server, secrets, db = served
    await wait_idle(server)
    key = secrets["interactive"]
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        blocker = asyncio.create_task(
            http.post("/v1/completions", headers=auth(key), json={"prompt": "q", "max_tokens": 50})
        )
        await wait_for(lambda: engine_stats(server)["num_running"] == 1, 5, "blocker running")
        start = time.monotonic()
        dropped = await http.post(
            "/v1/completions",
            json={"prompt": "late", "max_tokens": 2},
            headers=auth(key, **{"x-stoker-deadline-ms": "300", "x-request-id": "dl-queue"}),
        )
        waited = time.monotonic() - start
        with_stream = await http.post(
            "/v1/chat/completions",
            headers=auth(key, **{"x-request-id": "dl-stream"}),
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True, "timeout": 0.2},
        )
        assert (await blocker).status_code == 200
        # Past its deadline while generating: finish_reason "abort", partial text kept.
        cut = await http.post(
            "/v1/completions",
            json={"prompt": "q", "max_tokens": 100, "timeout": 0.5},
            headers=auth(key, **{"x-request-id": "dl-running"}),
        )
        metrics = (await http.get("/metrics", headers=server.headers())).text

    assert dropped.status_code == 504, dropped.text
    error = dropped.json()["error"]
    assert error["type"] == "timeout" and error["code"] == "deadline_exceeded"
    assert 0.25 < waited < 1.0 and dropped.headers["x-request-id"] == "dl-queue"
    assert with_stream.status_code == 504 and with_stream.json()["error"]["type"] == "timeout"
    assert cut.status_code == 200
    choice = cut.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["text"]) < 100
    assert 'stoker:deadline_exceeded_total{phase="queue"} 2.0' in metrics
    assert 'stoker:deadline_exceeded_total{phase="running"} 1.0' in metrics

    lines = by_client_id(server)
    assert lines["dl-queue"]["status"] == 504 and lines["dl-queue"]["error"] == "deadline"
    assert lines["dl-running"]["finish_reason"] == "abort" and lines["dl-running"]["error"] == "deadline"
    # Metered either way: a row for each; the dropped one used nothing.
    by_id = await ledger_rows(db, {lines["dl-queue"]["request_id"], lines["dl-running"]["request_id"]})
    rows = {name: by_id[x["request_id"]] for name, x in lines.items() if x["request_id"] in by_id}
    assert rows["dl-queue"].status == 504 and rows["dl-queue"].prompt_tokens == 0
    assert rows["dl-running"].completion_tokens == len(choice["text"]) and rows["dl-running"].prompt_tokens == 1


async def test_one_request_id_everywhere_even_when_reused(served) -> None:
    server, secrets, db = served
    await wait_idle(server)
    key = secrets["interactive"]
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        # Two requests with the same X-Request-Id at once: both run, each under
        # its own server id; the client's id is only echoed and logged.
        same = await asyncio.gather(
            *[
                http.post(
                    "/v1/completions",
                    json={"prompt": "q", "max_tokens": 5},
                    headers=auth(key, **{"x-request-id": "dup-id"}),
                )
                for _ in range(2)
            ]
        )
        fresh = await http.post(
            "/v1/chat/completions",
            headers=auth(key),
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        )
    assert [r.status_code for r in same] == [200, 200]
    assert all(r.headers["x-request-id"] == "dup-id" for r in same)
    server_ids = [r.json()["id"].removeprefix("cmpl-") for r in same]
    assert len(set(server_ids)) == 2 and all(rid.startswith("req-") for rid in server_ids)
    rid = fresh.headers["x-request-id"]  # no id sent: the server's own is echoed
    assert fresh.json()["id"] == f"chatcmpl-{rid}"
    lines = log_lines(server)
    dup = [x for x in lines if x.get("client_request_id") == "dup-id"]
    assert sorted(x["request_id"] for x in dup) == sorted(server_ids)
    assert all(x["engine_request_id"] == x["request_id"] for x in dup)
    assert [x["engine_request_id"] for x in lines if x["request_id"] == rid] == [rid]
    ids = await ledger_rows(db, set(server_ids) | {rid})
    assert set(server_ids) | {rid} <= ids.keys()


async def test_overload_retry_after_follows_the_measured_drain_rate(tmp_path) -> None:
    started = time.time()
    server = start_server(
        [
            "--engine-core",
            FAKE_CORE,
            "--no-embedding-model",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "1",
            "--max-queued-tokens",
            "50",
        ],
        str(tmp_path),
        env={"STOKER_FAKE_STEP_S": str(STEP_S)},
    )
    ready = time.time()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            for _ in range(4):  # 4 x 30 prompt tokens finished: the measured drain
                assert (await http.post("/v1/completions", json={"prompt": [100] * 30, "max_tokens": 2})).is_success
            blocker = asyncio.create_task(http.post("/v1/completions", json={"prompt": [100], "max_tokens": 150}))
            await wait_for(lambda: engine_stats(server)["num_running"] == 1, 5, "blocker running")
            waiter = asyncio.create_task(http.post("/v1/completions", json={"prompt": [100] * 40, "max_tokens": 2}))
            await wait_for(lambda: engine_stats(server)["num_waiting"] == 1, 5, "one waiting")
            await asyncio.sleep(0.6)  # past the admission's snapshot lag: counted once, from the engine
            before = time.time()
            refused = await http.post("/v1/completions", json={"prompt": [100] * 200, "max_tokens": 2})
            after = time.time()
            assert refused.status_code == 503, refused.text
            await asyncio.gather(blocker, waiter)
            metrics = (await http.get("/metrics")).text
    finally:
        server.stop()
    assert refused.json()["error"]["type"] == "overloaded"
    # excess = 40 waiting + 200 asked - 50 allowed; rate = 120 tokens / server uptime.
    excess, drained = 40 + 200 - 50, 4 * 30

    def expected(uptime: float) -> int:
        return math.ceil(min(60.0, max(1.0, excess / (drained / max(1.0, uptime)))))

    assert expected(before - ready) <= int(refused.headers["retry-after"]) <= expected(after - started)
    assert "stoker:drain_rate_tokens_per_second" in metrics
