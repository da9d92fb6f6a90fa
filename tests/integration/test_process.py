"""The engine process and its supervisor, against the fake core (seconds, no model)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from stoker.config import EngineConfig
from stoker.engine import prestart
from stoker.engine.client import (
    AsyncEngineClient,
    EngineDeadError,
    EngineStartupError,
    EngineUnavailableError,
    RequestRejectedError,
)
from stoker.engine.params import EngineCoreRequest, FinishReason, SamplingParams

FAKE = "server_fakes:FakeEngineCore"
pytestmark = pytest.mark.timeout(120)


def request(rid: str, max_tokens: int = 5, n: int = 1, prompt: list[int] | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt or [100, 101, 102], SamplingParams(max_tokens=max_tokens, n=n), time.time())


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def client():
    c = AsyncEngineClient(EngineConfig(max_model_len=256), core_spec=FAKE, startup_timeout=60)
    await c.start()
    try:
        yield c
    finally:
        await c.shutdown()


async def collect(client: AsyncEngineClient, req: EngineCoreRequest) -> dict[int, str]:
    texts: dict[int, str] = {}
    reasons = {}
    async for delta in client.generate(req):
        texts[delta.index] = texts.get(delta.index, "") + delta.new_text
        if delta.finished:
            reasons[delta.index] = delta.finish_reason
    assert set(reasons.values()) == {FinishReason.LENGTH}
    return texts


async def test_generate_and_fan_out(client: AsyncEngineClient) -> None:
    assert client.ready and client.max_model_len == 256
    assert client.tokenizer.decode(client.tokenizer.encode("hi")) == "hi"
    assert await collect(client, request("one")) == {0: "abcde"}
    assert await collect(client, request("two", max_tokens=3, n=3)) == {0: "abc", 1: "bcd", 2: "cde"}
    many = await asyncio.gather(*(collect(client, request(f"c{i}", 4)) for i in range(16)))
    assert all(m == {0: "abcd"} for m in many)


async def test_rejection_is_a_value_error(client: AsyncEngineClient) -> None:
    with pytest.raises(RequestRejectedError, match="out of range"):
        await collect(client, request("bad", prompt=[10**6]))
    assert await collect(client, request("after")) == {0: "abcde"}


async def test_closing_the_stream_aborts_and_frees_blocks(client: AsyncEngineClient) -> None:
    await wait_for(lambda: client.stats().kv_blocks_used == 0)
    stream = client.generate(request("long", max_tokens=10_000, prompt=[100] * 100))
    await stream.__anext__()
    await wait_for(lambda: client.stats().kv_blocks_used > 0)
    await stream.aclose()
    assert client.num_in_flight == 0
    await wait_for(lambda: client.stats().kv_blocks_used == 0 and client.stats().num_running == 0)


async def test_cancelled_task_aborts(client: AsyncEngineClient) -> None:
    task = asyncio.create_task(collect(client, request("cancel", max_tokens=10_000)))
    await wait_for(lambda: client.stats().num_running == 1)
    task.cancel()
    await wait_for(lambda: client.stats().num_running == 0)


async def test_kill_9_fails_in_flight_and_restarts(client: AsyncEngineClient) -> None:
    tasks = [asyncio.create_task(collect(client, request(f"r{i}", max_tokens=10_000))) for i in range(4)]
    await wait_for(lambda: client.stats().num_running == 4)
    os.kill(client.info.pid, signal.SIGKILL)
    start = time.monotonic()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert time.monotonic() - start < 2.0
    assert not client.ready
    with pytest.raises(EngineUnavailableError):
        await collect(client, request("during-restart"))
    await wait_for(lambda: client.ready, timeout=60)
    assert client.restart_count == 1
    assert await collect(client, request("after-restart")) == {0: "abcde"}


async def test_startup_failure_is_reported() -> None:
    c = AsyncEngineClient(EngineConfig(), core_spec="server_fakes:FailingEngineCore", startup_timeout=60)
    with pytest.raises(EngineStartupError, match="no such model"):
        await c.start()
    await c.shutdown()


async def test_a_prestarted_process_serves_the_first_start_and_a_restart_spawns_afresh() -> None:
    prestart.prestart(FAKE, 1)
    [waiting] = prestart.waiting_pids()
    c = AsyncEngineClient(EngineConfig(max_model_len=256), core_spec=FAKE, startup_timeout=60)
    try:
        info = await c.start()
        assert info.pid == waiting and prestart.waiting_pids() == []
        assert "".join((await collect(c, request("p1", 3))).values())
        os.kill(info.pid, signal.SIGKILL)
        await wait_for(lambda: c.info is not None and c.info.pid != waiting and c.ready, timeout=60)
        assert "".join((await collect(c, request("p2", 3))).values())
    finally:
        await c.shutdown()


@pytest.mark.parametrize("prestarted", [True, False])
async def test_the_engine_loads_without_the_collector_and_serves_with_it(prestarted: bool) -> None:
    core = "server_fakes:CollectorCheckingEngineCore"
    if prestarted:
        prestart.prestart(core, 1)
    c = AsyncEngineClient(EngineConfig(max_model_len=256), core_spec=core, startup_timeout=60)
    await c.start()
    try:
        assert await collect(c, request("collected")) == {0: "abcde"}
    finally:
        await c.shutdown()
        prestart.discard()


async def test_a_prestarted_process_that_died_waiting_is_passed_over() -> None:
    prestart.prestart(FAKE, 1)
    [waiting] = prestart.waiting_pids()
    os.kill(waiting, signal.SIGKILL)
    await wait_for(lambda: Path(f"/proc/{waiting}/stat").read_text().split(") ")[1][0] == "Z")  # dead, not reaped
    c = AsyncEngineClient(EngineConfig(max_model_len=256), core_spec=FAKE, startup_timeout=60)
    try:
        info = await c.start()
        assert info.pid != waiting and prestart.waiting_pids() == []
        assert "".join((await collect(c, request("d1", 3))).values())
    finally:
        await c.shutdown()


def test_prestarted_processes_nobody_takes_end_on_discard() -> None:
    prestart.prestart("another.core:Spec", 1)  # a core spec no client asks for, and no module of that name
    prestart.prestart(FAKE, 1)
    pids = prestart.waiting_pids()
    assert len(pids) == 2
    prestart.discard()
    assert prestart.waiting_pids() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # ended and reaped, not left a zombie
            os.kill(pid, 0)


async def test_a_shutdown_while_the_engine_restarts_does_not_wait_for_it() -> None:
    c = AsyncEngineClient(EngineConfig(max_model_len=256), core_spec=FAKE, startup_timeout=60)
    info = await c.start()
    os.kill(info.pid, signal.SIGKILL)
    await wait_for(lambda: not c.ready)
    started = time.monotonic()
    # The restart has begun: its process is not listening yet, so a SHUTDOWN message would
    # be dropped and waited on for the whole timeout.
    await c.shutdown(timeout=30)
    assert time.monotonic() - started < 10
    assert c._engine is None
