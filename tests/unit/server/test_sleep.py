"""Idle sleep on a real server (docs/sleep.md): a tiny random-weight model
sleeps after 1 s idle (its engine process ends, the server's memory drops),
stays listed and ready, and the next request through the official client
wakes it and answers the same greedy text; concurrent requests share one
wake; a request racing the sleep waits and wakes it; operators sleep and
wake models with /sleep, /wake_up, /is_sleeping (admin key only). A second
model, never idle-slept, keeps its engine throughout."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from conftest import REPO, ServerProcess, poll_until, start_server
from prometheus_client.parser import text_string_to_metric_families
from tiny_loras import ALL_MODULES, ATTENTION, make_peft_adapter
from tiny_models import make_tiny_hf_model

from stoker.control.db import open_db
from stoker.control.keys import KeyStore
from stoker.server.config import ServerConfig
from stoker.server.fleet import FleetError, plan_fleet
from stoker.server.sleep import MAX_IDLE_SECONDS, SleepChoices, parse_sleep_choices

pytestmark = pytest.mark.timeout(300)

PROMPT = [{"role": "user", "content": "Say something about ships."}]
KEYS: dict[str, str] = {}
ADAPTERS: dict[str, Path] = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("sleep-server")
    dozy = make_tiny_hf_model("llama", tmp, seed=3)
    awake = make_tiny_hf_model("qwen2", tmp, seed=4)
    ADAPTERS["styled"] = make_peft_adapter(dozy, tmp / "styled", rank=4, targets=ALL_MODULES, seed=5, magnitude=0.5)
    ADAPTERS["late"] = make_peft_adapter(dozy, tmp / "late", rank=8, targets=ATTENTION, seed=6, magnitude=0.5)
    db = str(tmp / "keys.db")
    store = KeyStore(open_db(db))
    KEYS["admin"] = store.create("root", admin=True)[1]
    KEYS["user"] = store.create("user")[1]
    server = start_server(
        ["--no-embedding-model", "--max-model-len", "256", "--model", f"dozy={dozy}", "--model", f"awake={awake}"]
        # No speculation: an engine's start (each wake) skips measuring its steps.
        + ["--lora-modules", f"dozy:styled={ADAPTERS['styled']}"]
        + ["--sleep-idle-seconds", "dozy=1", "--speculative-method", "none"],
        str(tmp),
        env={"STOKER_DB": db},
    )
    server.key = KEYS["admin"]
    try:
        yield server
    finally:
        server.stop()


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS['admin']}"}


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["user"], max_retries=0, timeout=120)


def _greedy(server: ServerProcess, model: str = "dozy") -> str:
    answer = _client(server).chat.completions.create(model=model, messages=PROMPT, max_tokens=12, temperature=0)
    return answer.choices[0].message.content or ""


def _stable(server: ServerProcess, name: str) -> dict:
    listing = httpx.get(f"{server.url}/admin/models", headers=_admin(), timeout=10).json()
    return next(m["stable"] for m in listing["data"] if m["name"] == name)


def _wait_asleep(server: ServerProcess, name: str = "dozy", timeout: float = 60) -> dict:
    """The version once asleep: its gate shut and its engine process gone."""
    deadline = time.monotonic() + timeout
    while not (stable := _stable(server, name))["sleeping"] or stable["engine_pid"] is not None:
        assert time.monotonic() < deadline, f"{name} did not fall asleep in {timeout} s"
        time.sleep(0.1)
    return stable


def _metric(server: ServerProcess, sample: str, model: str) -> float:
    body = httpx.get(f"{server.url}/metrics", headers=_admin(), timeout=10).text
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == sample and s.labels.get("model_name") == model:
                return s.value
    return 0.0


def _models_cli(server: ServerProcess, *args: str) -> str:
    command = [sys.executable, "-m", "stoker.cli", "models", "--url", server.url, *args]
    env = {"STOKER_API_KEY": KEYS["admin"], "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _engines_rss(server: ServerProcess) -> int:
    """Resident bytes of the server's engine processes (its children, the resource tracker aside)."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    return sum(c.memory_info().rss for c in children if "resource_tracker" not in " ".join(c.cmdline()))


def test_an_idle_model_sleeps_and_the_next_request_wakes_it_with_the_same_answer(server: ServerProcess) -> None:
    other_pid = _stable(server, "awake")["engine_pid"]
    before = _greedy(server)
    pid, rss = _stable(server, "dozy")["engine_pid"], _engines_rss(server)  # up: it just answered
    assert pid is not None
    stable = _wait_asleep(server)
    assert stable["ready"] and stable["status"] == "serving"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert _engines_rss(server) < rss - 20 * 2**20  # one engine process fewer
    assert httpx.get(f"{server.url}/ready").status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    listed = {m["id"]: m for m in _client(server).models.list().model_dump()["data"]}
    assert listed["dozy"]["sleeping"] is True and listed["awake"]["sleeping"] is False
    # The metrics feed runs every 0.25 s; its tick that shows dozy asleep also counted its wakes so far.
    asleep = poll_until(lambda: _metric(server, "stoker:model_sleeping", "dozy"), lambda v: v == 1.0, 5)
    assert asleep == 1.0
    assert _metric(server, "stoker:model_sleeping", "awake") == 0.0
    wakes = _metric(server, "stoker:model_wake_seconds_count", "dozy")

    assert _greedy(server) == before  # the woken engine answers as the first one did
    stable = _stable(server, "dozy")
    assert stable["engine_pid"] not in (None, pid) and stable["last_wake_seconds"] > 0
    assert _stable(server, "awake")["engine_pid"] == other_pid  # the never-sleeping model kept its engine
    woken = poll_until(lambda: _metric(server, "stoker:model_wake_seconds_count", "dozy"), lambda v: v >= wakes + 1, 5)
    assert woken >= wakes + 1


def test_concurrent_requests_during_a_wake_all_succeed_with_one_wake(server: ServerProcess) -> None:
    wakes = _wait_asleep(server)["wakes"]

    async def ask_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEYS["user"], max_retries=0, timeout=120)
        asks = [
            client.chat.completions.create(model="dozy", messages=PROMPT, max_tokens=6, temperature=0) for _ in range(6)
        ] + [client.completions.create(model="dozy", prompt="Once upon a time", max_tokens=4, temperature=0)]
        answers = await asyncio.gather(*asks)
        await client.close()
        return [a.choices[0].finish_reason for a in answers]

    assert set(asyncio.run(ask_all())) <= {"stop", "length"}
    assert _stable(server, "dozy")["wakes"] == wakes + 1


def test_sleep_drains_first_and_a_request_arriving_meanwhile_waits_and_wakes_it(server: ServerProcess) -> None:
    user = {"Authorization": f"Bearer {KEYS['user']}"}
    # 200 tokens (~0.4 s of the tiny model): 40 took 70 ms, and a request that ended
    # between two looks at the state left the first wait below spinning until the timeout.
    long = {"model": "awake", "messages": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    short = {"model": "awake", "messages": PROMPT, "max_tokens": 4, "temperature": 0}

    async def state(client: httpx.AsyncClient) -> dict:
        """awake's state, asked without blocking the loop that sends the requests."""
        listing = (await client.get("/admin/models", headers=_admin())).json()
        return next(m["stable"] for m in listing["data"] if m["name"] == "awake")

    async def race() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            deadline = time.monotonic() + 60
            in_flight = asyncio.create_task(client.post("/v1/chat/completions", json=long, headers=user))
            while not (await state(client))["in_flight"]:
                assert not in_flight.done(), "the long request ended before it was seen in flight"
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            sleeping = asyncio.create_task(client.post("/sleep", params={"model": "awake"}, headers=_admin()))
            while not (await state(client))["sleeping"]:  # the gate is shut; the engine still runs
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            late = await client.post("/v1/chat/completions", json=short, headers=user)
            return await in_flight, await sleeping, late

    wakes = _stable(server, "awake")["wakes"]
    in_flight, sleeping, late = asyncio.run(race())
    assert in_flight.status_code == 200 and in_flight.json()["usage"]["completion_tokens"] == 200
    assert sleeping.status_code == 200, sleeping.text
    assert late.status_code == 200, late.text
    stable = _stable(server, "awake")
    assert stable["wakes"] == wakes + 1 and not stable["sleeping"]  # it slept, and the late request woke it


def test_operators_sleep_and_wake_models_and_nobody_else_may(server: ServerProcess) -> None:
    url = server.url
    for who, expected in ((None, 401), (KEYS["user"], 403)):
        headers = {"Authorization": f"Bearer {who}"} if who else {}
        assert httpx.post(f"{url}/sleep", headers=headers).status_code == expected
        assert httpx.post(f"{url}/wake_up", headers=headers).status_code == expected
        assert httpx.get(f"{url}/is_sleeping", headers=headers).status_code == expected
        assert httpx.post(f"{url}/admin/models/awake/sleep", headers=headers).status_code == expected
    assert not _stable(server, "awake")["sleeping"]

    answer = httpx.post(f"{url}/sleep", params={"level": 1}, headers=_admin(), timeout=60)  # every model
    assert answer.status_code == 200 and answer.json()["is_sleeping"] is True, answer.text
    assert httpx.get(f"{url}/is_sleeping", params={"model": "awake"}, headers=_admin()).json()["is_sleeping"]
    assert _stable(server, "awake")["engine_pid"] is None and _stable(server, "dozy")["engine_pid"] is None
    assert httpx.get(f"{url}/ready").status_code == 200
    flushed = httpx.post(f"{url}/flush_cache", headers=_admin())  # a router's fan-out finds nothing to flush
    assert flushed.status_code == 200 and flushed.json() == {"flushed": True, "num_blocks": 0}, flushed.text
    woke = httpx.post(f"{url}/wake_up", params={"model": "awake"}, headers=_admin(), timeout=120)
    assert woke.status_code == 200 and woke.json()["is_sleeping"] is False
    assert _stable(server, "awake")["engine_pid"] is not None

    # The admin API's verbs, through `stoker models sleep|list`.
    slept = _models_cli(server, "sleep", "awake")
    assert json.loads(slept) == {"name": "awake", "is_sleeping": True, "models": {"awake": {"is_sleeping": True}}}
    assert any(line.split()[:3] == ["awake", "v1", "sleeping"] for line in _models_cli(server, "list").splitlines())
    assert _greedy(server, "awake")  # a request wakes it as well
    assert httpx.post(f"{url}/admin/models/awake/wake", headers=_admin(), timeout=60).json()["is_sleeping"] is False

    missing = httpx.post(f"{url}/sleep", params={"model": "nope"}, headers=_admin())
    assert missing.status_code == 404 and "dozy, awake" in missing.json()["error"]["message"]
    assert httpx.post(f"{url}/sleep", params={"level": 3}, headers=_admin()).status_code == 400
    assert httpx.delete(f"{url}/admin/models/awake/sleep", headers=_admin()).status_code == 405


def test_a_deadline_passing_during_a_wake_is_a_504_and_the_wake_goes_on(server: ServerProcess) -> None:
    wakes = _wait_asleep(server)["wakes"]
    body = {"model": "dozy", "messages": PROMPT, "max_tokens": 4}
    headers = {"Authorization": f"Bearer {KEYS['user']}", "x-stoker-deadline-ms": "50"}
    late = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded", late.text
    assert "woke from sleep" in late.json()["error"]["message"]
    deadline = time.monotonic() + 60
    while _stable(server, "dozy")["wakes"] == wakes:  # nobody waits for it any more, and it still finishes
        assert time.monotonic() < deadline, "the wake stopped with the request that started it"
        time.sleep(0.1)


def test_a_swap_to_a_sleeping_models_name_replaces_it(server: ServerProcess) -> None:
    before = _wait_asleep(server)
    swap = {"name": "dozy", "path": before["path"]}
    answer = httpx.post(f"{server.url}/admin/models", json=swap, headers=_admin(), timeout=300)
    assert answer.status_code == 200, answer.text
    assert answer.json()["version"] != before["version"] and not answer.json()["sleeping"]
    assert _client(server).models.retrieve("dozy").model_dump()["version"] == answer.json()["version"]


def _registered(server: ServerProcess, expected: int) -> int:
    """Adapters dozy's engine holds registered (dozy is the first model: /ready's engine), as its
    stats say once they caught up with the request just answered (before it sleeps again)."""
    deadline = time.monotonic() + 0.5
    while True:
        stats = httpx.get(f"{server.url}/ready", headers=_admin(), timeout=10).json()["engine_stats"]
        if stats["lora_registered"] == expected or time.monotonic() > deadline:
            return int(stats["lora_registered"])
        time.sleep(0.02)


def test_adapters_serve_after_a_wake_and_load_and_unload_while_their_base_sleeps(server: ServerProcess) -> None:
    styled = _greedy(server, "styled")
    assert styled != _greedy(server)
    _wait_asleep(server)
    assert _greedy(server, "styled") == styled  # the woken engine registered the adapter again

    _wait_asleep(server)
    late = {"lora_name": "late", "lora_path": str(ADAPTERS["late"]), "base_model_name": "dozy"}
    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json=late, headers=_admin(), timeout=120)
    assert loaded.status_code == 200, loaded.text  # its base woke to check it
    assert _greedy(server, "late") not in (styled, _greedy(server))
    assert _registered(server, 2) == 2

    _wait_asleep(server)
    gone = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=_admin())
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError):
        _greedy(server, "late")
    assert _greedy(server, "styled") == styled  # wakes it: the unloaded adapter stays gone
    assert _registered(server, 1) == 1


def test_idle_seconds_are_parsed_and_bounded() -> None:
    assert parse_sleep_choices(["600", "big=30", "small=0"]) == SleepChoices(600.0, {"big": 30.0, "small": 0.0})
    for bad in ("-1", "big=soon", "=5", f"{MAX_IDLE_SECONDS + 1}", "nan", "inf"):
        with pytest.raises(ValueError, match="sleep-idle-seconds"):
            parse_sleep_choices([bad])
    assert ServerConfig(sleep_idle_seconds=600).sleep_idle_seconds == ["600"]  # YAML's number
    assert ServerConfig(sleep_idle_seconds="a=1 b=2").sleep_idle_seconds == ["a=1", "b=2"]


def test_a_per_model_idle_time_must_name_a_model(tmp_path: Path) -> None:
    from stoker.config import EngineConfig, default_model_path

    config = ServerConfig(models=[f"one={default_model_path()}"], sleep_idle_seconds=["two=5"])
    with pytest.raises(FleetError, match="--sleep-idle-seconds names two"):
        plan_fleet(config, EngineConfig())


def test_a_reranker_sleeps_by_dropping_its_arrays_and_wakes_scoring_the_same(tmp_path: Path) -> None:
    from tiny_rerankers import make_tiny_cross_encoder

    from stoker.config import EngineConfig
    from stoker.engine.pooling import PoolingEngine
    from stoker.server.fleet import ModelSpec, ModelVersion
    from stoker.server.sleep import begin_sleep, wake_for

    path = str(make_tiny_cross_encoder("bert", tmp_path / "rr"))
    engine = PoolingEngine(EngineConfig(model=path, served_model_name="rr"))
    version = ModelVersion("rr", 1, ModelSpec("rr", path, kind="rerank"), engine, lambda _: None, status="serving")

    async def scores() -> list[float]:
        assert engine.batcher is not None
        pairs = [engine.batcher.model.pair("where is Paris?", text, True) for text in ("France", "a lazy dog")]
        return await engine.batcher.score(pairs)

    async def cycle() -> None:
        spawn = asyncio.create_task
        await engine.start()
        before = await scores()
        task = begin_sleep(version, 5.0, lambda v: v.holds, spawn)
        assert task is not None and version.sleep.asleep
        await task
        assert engine.batcher is None and not engine.ready and version.ready  # asleep, still taking requests
        await asyncio.gather(*(wake_for(version, None, spawn) for _ in range(3)))
        assert not version.sleep.asleep and version.sleep.wakes == 1  # three callers, one wake
        assert await scores() == before
        await engine.shutdown()

    asyncio.run(cycle())
