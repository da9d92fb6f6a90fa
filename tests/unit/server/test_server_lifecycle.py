"""Supervision, client disconnects and the SIGTERM drain, over real server
processes running the fake engine core (50 tokens/s per request)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from conftest import FAKE_CORE, ServerProcess, start_server

pytestmark = pytest.mark.timeout(120)


_probe = httpx.Client(timeout=5)  # one client: building an SSL context per probe costs ~50 ms


def ready_body(server: ServerProcess) -> dict:
    return _probe.get(f"{server.url}/ready").json()


async def wait_running(server: ServerProcess, count: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while ready_body(server)["engine_stats"]["num_running"] < count:
        assert time.monotonic() < deadline, f"{count} requests not running within {timeout} s"
        await asyncio.sleep(0.02)


def wait_until(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what} not within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - start


def blocks_idle(server: ServerProcess) -> bool:
    stats = ready_body(server)["engine_stats"]
    return stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def long_body(stream: bool, max_tokens: int = 150) -> dict:
    return {"prompt": "p" * 100, "max_tokens": max_tokens, "stream": stream}


def test_stream_disconnect_aborts_and_frees_blocks(fake_server: ServerProcess) -> None:
    wait_until(lambda: blocks_idle(fake_server), 10, "idle before the test")
    with (
        httpx.Client(base_url=fake_server.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=long_body(True)) as response,
    ):
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        # The engine pushes stats at most every 0.2 s, counted from its previous
        # push (which may be the "went idle" push of the test before), so a
        # snapshot can lag the first tokens by up to that: wait for it.
        wait_until(
            lambda: ready_body(fake_server)["engine_stats"]["kv_blocks_used"] > 0,
            1.0,
            "blocks in use in a stats snapshot",
        )
    # 150 tokens take 3 s; the blocks must come back long before that.
    assert wait_until(lambda: blocks_idle(fake_server), 1.5, "blocks freed after disconnect") < 1.5


def test_non_streaming_disconnect_aborts_and_frees_blocks(fake_server: ServerProcess) -> None:
    wait_until(lambda: blocks_idle(fake_server), 10, "idle before the test")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{fake_server.url}/v1/completions", json=long_body(False), timeout=0.5)
    assert wait_until(lambda: blocks_idle(fake_server), 1.5, "blocks freed after disconnect") < 1.5


async def test_engine_kill_fails_in_flight_cleanly_and_recovers(fake_server: ServerProcess) -> None:
    before = ready_body(fake_server)
    restarts = before["engine_restarts"]
    async with httpx.AsyncClient(base_url=fake_server.url, timeout=30) as http:

        async def stream() -> list[str]:
            async with http.stream("POST", "/v1/completions", json=long_body(True, 150)) as response:
                assert response.status_code == 200
                return [line async for line in response.aiter_lines() if line]

        streaming = asyncio.create_task(stream())
        plain = asyncio.create_task(http.post("/v1/completions", json=long_body(False, 150)))
        await wait_running(fake_server, 2)
        os.kill(before["engine_pid"], signal.SIGKILL)
        start = time.monotonic()
        lines, response = await asyncio.gather(streaming, plain)
        assert time.monotonic() - start < 2.0
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
    assert lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2][len("data: ") :])
    wait_until(lambda: ready_body(fake_server)["ready"], 30, "ready again")
    after = ready_body(fake_server)
    assert after["engine_restarts"] == restarts + 1 and after["engine_pid"] != before["engine_pid"]
    ok = httpx.post(f"{fake_server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ab"


async def drain_run(tmp_path, shutdown_timeout: float, max_tokens: int) -> tuple[list[list[str]], int, float]:
    server = start_server(
        [
            "--engine-core",
            FAKE_CORE,
            "--no-embedding-model",
            "--max-model-len",
            "512",
            "--shutdown-timeout",
            str(shutdown_timeout),
        ],
        str(tmp_path),
        env={"STOKER_FAKE_STEP_S": "0.02"},
    )
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

            async def stream() -> list[str]:
                body = {"prompt": "x", "max_tokens": max_tokens, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    return [line async for line in response.aiter_lines() if line]

            tasks = [asyncio.create_task(stream()) for _ in range(3)]
            await wait_running(server, 3)
            server.proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            await asyncio.sleep(0.2)
            assert (await http.get("/ready")).status_code == 503
            refused = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503
            results = await asyncio.gather(*tasks)
        code = await asyncio.to_thread(server.proc.wait, 30)
        return results, code, time.monotonic() - start
    finally:
        server.stop()


def finish_reasons(lines: list[str]) -> list[str]:
    chunks = [json.loads(line[len("data: ") :]) for line in lines if line != "data: [DONE]"]
    return [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]


async def test_sigterm_drains_in_flight_then_exits_0(tmp_path) -> None:
    results, code, _ = await drain_run(tmp_path, shutdown_timeout=30, max_tokens=60)
    assert code == 0
    for lines in results:
        assert lines[-1] == "data: [DONE]" and finish_reasons(lines) == ["length"]
        assert len(lines) == 61  # every token arrived


async def test_sigterm_past_shutdown_timeout_aborts(tmp_path) -> None:
    results, code, elapsed = await drain_run(tmp_path, shutdown_timeout=1, max_tokens=400)
    assert code == 0 and elapsed < 6
    for lines in results:
        assert lines[-1] == "data: [DONE]" and finish_reasons(lines) == ["abort"]
