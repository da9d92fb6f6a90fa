"""Several models in one server, on the fake core (tests/server_fakes.py): each
model its own engine process; routing by `model`; pinned digests; hot swap
and canary through /admin/models under load; fallback when a model's engine
is killed; per-model metrics; bad admin calls and bad model sets at start."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import FAKE_CORE, REPO, TESTS_DIR, ServerProcess, poll_until, start_server

from stoker.control.db import open_db
from stoker.control.keys import KeyStore

CHAT = [{"role": "user", "content": "hi"}]
ADMIN: dict[str, str] = {}
"""The fleet server's admin key, as a header (the admin API is shut without keys)."""


def _model_file(folder: Path, name: str, content: bytes) -> tuple[Path, str]:
    path = folder / name
    path.write_bytes(content)
    return path, "sha256:" + hashlib.sha256(content).hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    folder = tmp_path_factory.mktemp("fleet-models")
    return {name: _model_file(folder, f"{name}.bin", name.encode() * 100) for name in ("big", "small", "tiny", "new")}


@pytest.fixture(scope="module")
def fleet(files: dict[str, tuple[Path, str]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    (big, big_digest), (small, _), (tiny, _) = files["big"], files["small"], files["tiny"]
    tmp = tmp_path_factory.mktemp("fleet-server")
    db = str(tmp / "keys.db")
    _, secret = KeyStore(open_db(db)).create("root", admin=True)
    ADMIN["Authorization"] = f"Bearer {secret}"
    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256"]
        + ["--model", f"big={big}@{big_digest}", "--model", f"small={small}", "--model", f"tiny={tiny}"]
        + ["--fallback", "big=small,tiny", "--cost-per-hour", "3.6"],
        str(tmp),
        env={"STOKER_FAKE_STEP_S": "0.02", "STOKER_DB": db},
    )
    try:
        yield server
    finally:
        server.stop()


def chat(server: ServerProcess, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": CHAT, "max_tokens": 3, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30, headers=ADMIN)


def admin(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/admin/models", timeout=10, headers=ADMIN).json()


def version_of(server: ServerProcess, name: str) -> dict:
    return next(m for m in admin(server)["data"] if m["name"] == name)


def test_each_model_answers_under_its_own_name(fleet: ServerProcess, files: dict) -> None:
    listed = httpx.get(f"{fleet.url}/v1/models", headers=ADMIN).json()["data"]
    assert [m["id"] for m in listed] == ["big", "small", "tiny"]
    assert listed[0]["digest"] == files["big"][1] and listed[0]["version"] == "v1"
    assert listed[1]["root"] == str(files["small"][0])
    pids = set()
    for name in ("big", "small", "tiny"):
        response = chat(fleet, name)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == name and response.headers["x-stoker-model-served"] == name
        pids.add(version_of(fleet, name)["stable"]["engine_pid"])
    assert len(pids) == 3  # one engine process each
    missing = chat(fleet, "huge")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert "big, small, tiny" in missing.json()["error"]["message"]
    default = httpx.post(f"{fleet.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=ADMIN).json()
    assert default["model"] == "big"  # no `model`: the first one
    metrics = httpx.get(f"{fleet.url}/metrics", headers=ADMIN).text
    assert 'vllm:request_success_total{finished_reason="length",model_name="small"}' in metrics
    assert f'digest="{files["big"][1]}"' in metrics and "stoker:model_version_info" in metrics

    def costs() -> list[str]:
        metrics = httpx.get(f"{fleet.url}/metrics", headers=ADMIN).text
        return [line for line in metrics.splitlines() if line.startswith("stoker:cost_per_million_tokens{")]

    def small_costs(lines: list[str]) -> bool:
        return any('kind="generation",model_name="small"' in line and float(line.split()[-1]) > 0 for line in lines)

    assert small_costs(poll_until(costs, small_costs, 5))  # the stats feed runs every 0.25 s


def test_kill_9_falls_back_and_leaves_the_others_alone(fleet: ServerProcess) -> None:
    pid = version_of(fleet, "big")["stable"]["engine_pid"]
    small_pid = version_of(fleet, "small")["stable"]["engine_pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while httpx.get(f"{fleet.url}/ready", headers=ADMIN).json().get("models", {}).get("big", {}).get("ready", True):
        assert time.monotonic() < deadline, "the server did not notice the engine died"
        time.sleep(0.01)
    response = chat(fleet, "big")
    assert response.status_code == 200, response.text
    assert response.headers["x-stoker-model-served"] == "small" and response.json()["model"] == "small"
    assert chat(fleet, "tiny").headers["x-stoker-model-served"] == "tiny"
    assert version_of(fleet, "small")["stable"]["engine_pid"] == small_pid
    metrics = httpx.get(f"{fleet.url}/metrics", headers=ADMIN).text
    assert 'stoker:fallbacks_total{from="big",reason="unavailable",to="small"}' in metrics
    deadline = time.monotonic() + 60  # the engine comes back by itself, and big answers again
    while chat(fleet, "big").headers["x-stoker-model-served"] != "big":
        assert time.monotonic() < deadline, "big never came back"
        time.sleep(0.2)


async def _stream(client: httpx.AsyncClient, url: str, model: str) -> tuple[int, str, str, str | None]:
    body = {"model": model, "messages": CHAT, "max_tokens": 25, "stream": True}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        finish, done = None, False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return response.status_code, "", "error", None
                for choice in event.get("choices", []):
                    finish = choice.get("finish_reason") or finish
        version = response.headers.get("x-stoker-model-version", "")
        return response.status_code, version, "done" if done else "cut", finish


def test_hot_swap_under_streams_fails_nothing(fleet: ServerProcess, files: dict) -> None:
    new_path, new_digest = files["new"]

    async def scenario() -> tuple[list, httpx.Response]:
        async with httpx.AsyncClient(timeout=60, headers=ADMIN) as client:
            stop = asyncio.Event()
            results: list = []

            async def worker() -> None:
                while not stop.is_set():
                    results.append(await _stream(client, fleet.url, "small"))

            workers = [asyncio.create_task(worker()) for _ in range(8)]
            await asyncio.sleep(0.5)
            swap = await client.post(
                f"{fleet.url}/admin/models", json={"name": "small", "path": str(new_path), "digest": new_digest}
            )
            await asyncio.sleep(1.5)
            stop.set()
            await asyncio.gather(*workers)
            return results, swap

    results, swap = asyncio.run(scenario())
    assert swap.status_code == 200, swap.text
    assert swap.json()["version"] == "v2" and swap.json()["digest"] == new_digest
    assert len(results) >= 16
    assert all(r[0] == 200 and r[2] == "done" and r[3] == "length" for r in results), results
    assert {r[1] for r in results} == {"v1", "v2"}
    after = chat(fleet, "small")
    assert after.headers["x-stoker-model-version"] == "v2"
    deadline = time.monotonic() + 30  # the old version drains, then its process ends
    while admin(fleet)["retiring"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)

    wrong = httpx.post(
        f"{fleet.url}/admin/models",
        json={"name": "small", "path": str(files["tiny"][0]), "digest": new_digest},
        timeout=60,
        headers=ADMIN,
    )
    assert wrong.status_code == 400 and "digest mismatch" in wrong.json()["error"]["message"]
    assert f"expected {new_digest}, got {files['tiny'][1]}" in wrong.json()["error"]["message"]
    assert chat(fleet, "small").headers["x-stoker-model-version"] == "v2"  # the failed swap changed nothing


def test_canary_takes_its_share_then_promotes(fleet: ServerProcess, files: dict) -> None:
    loaded = httpx.post(
        f"{fleet.url}/admin/models",
        json={"name": "tiny", "path": str(files["new"][0]), "canary_percent": 10},
        timeout=60,
        headers=ADMIN,
    )
    assert loaded.status_code == 200, loaded.text
    canary = loaded.json()["version"]
    assert httpx.get(f"{fleet.url}/v1/models", headers=ADMIN).json()["data"][2]["canary"]["percent"] == 10

    async def burst() -> list[str]:
        async with httpx.AsyncClient(timeout=60, headers=ADMIN, limits=httpx.Limits(max_connections=16)) as client:
            body = {"model": "tiny", "messages": CHAT, "max_tokens": 1}
            sem = asyncio.Semaphore(16)

            async def one() -> str:
                async with sem:
                    r = await client.post(f"{fleet.url}/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    return r.headers["x-stoker-model-version"]

            return await asyncio.gather(*(one() for _ in range(200)))

    versions = asyncio.run(burst())
    assert abs(versions.count(canary) - 20) <= 10  # within 5 points of 10 %
    metrics = httpx.get(f"{fleet.url}/metrics", headers=ADMIN).text
    assert f'stoker:model_version_requests_total{{model_name="tiny",outcome="ok",version="{canary}"}}' in metrics
    promoted = httpx.post(f"{fleet.url}/admin/models/tiny/promote", timeout=10, headers=ADMIN)
    assert promoted.status_code == 200 and promoted.json()["version"] == canary
    assert {chat(fleet, "tiny").headers["x-stoker-model-version"] for _ in range(5)} == {canary}
    again = httpx.post(f"{fleet.url}/admin/models/tiny/rollback", timeout=10, headers=ADMIN)
    assert again.status_code == 409 and "no canary" in again.json()["error"]["message"]


def test_bad_admin_calls_change_nothing(fleet: ServerProcess, files: dict) -> None:
    url = f"{fleet.url}/admin/models"
    cases = [
        ({"name": "x"}, 400, "path"),
        ({"name": "x", "path": "/nowhere.gguf"}, 403, "is not under an allowed model root"),
        ({"name": "x", "path": str(files["new"][0].parent / "nowhere.gguf")}, 400, "no model at"),
        ({"name": "x", "path": str(files["new"][0]), "digest": "md5:1"}, 400, "sha256:"),
        ({"name": "bad name", "path": str(files["new"][0])}, 400, "model name"),
        ({"name": "x", "path": str(files["new"][0]), "canary_percent": 10}, 400, "is not loaded"),
        ({"name": "x", "path": str(files["new"][0]), "canary_percent": 150}, 400, "canary_percent"),
        ({"name": "x", "path": str(files["new"][0]), "color": "red"}, 400, "color"),
    ]
    for body, status, says in cases:
        response = httpx.post(url, json=body, timeout=30, headers=ADMIN)
        assert response.status_code == status, (body, response.text)
        assert says in response.json()["error"]["message"], (body, response.text)
    assert httpx.delete(f"{url}/huge", headers=ADMIN).status_code == 404
    assert httpx.put(f"{url}/big/canary", json={"percent": 5}, headers=ADMIN).status_code == 409
    assert [m["name"] for m in admin(fleet)["data"]] == ["big", "small", "tiny"]
    for name in ("big", "small", "tiny"):
        assert chat(fleet, name).status_code == 200


def test_load_and_unload_a_model_with_the_cli(fleet: ServerProcess, files: dict) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO])}
    env["STOKER_API_KEY"] = ADMIN["Authorization"].removeprefix("Bearer ")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "stoker.cli", "models", "--url", fleet.url, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )

    loaded = cli("load", "extra", str(files["new"][0]), "--digest", files["new"][1])
    assert loaded.returncode == 0, loaded.stderr
    assert chat(fleet, "extra").json()["model"] == "extra"
    listing = cli("list")
    assert listing.returncode == 0 and "extra" in listing.stdout and files["new"][1] in listing.stdout
    assert cli("unload", "extra").returncode == 0
    assert chat(fleet, "extra").status_code == 404
    failed = cli("unload", "extra")
    assert failed.returncode == 1 and "404" in failed.stderr


def test_an_overloaded_model_hands_its_requests_to_its_fallback(files: dict, tmp_path: Path) -> None:
    """One running and one queued request fill `a` (--max-num-seqs 1, --max-queued-requests 1 per model):
    more of a burst is answered by `b`, counted as overloaded."""
    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-num-seqs", "1", "--max-queued-requests", "1"]
        + ["--model", f"a={files['big'][0]}", "--model", f"b={files['small'][0]}", "--fallback", "a=b"],
        str(tmp_path),
        env={"STOKER_FAKE_STEP_S": "0.02"},
    )
    try:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": "a", "messages": CHAT, "max_tokens": 20}
                return await asyncio.gather(
                    *(client.post(f"{server.url}/v1/chat/completions", json=body) for _ in range(6))
                )

        responses = asyncio.run(burst())
        # Past both models' bounds a request gets a's own 503 (the chain is spent), never a 500.
        assert all(r.status_code in (200, 503) for r in responses), [r.text for r in responses]
        assert all(r.json()["error"]["code"] == "overloaded" for r in responses if r.status_code == 503)
        answered = [r for r in responses if r.status_code == 200]
        served = [r.headers["x-stoker-model-served"] for r in answered]
        assert "a" in served and "b" in served
        assert all(r.json()["model"] == h for r, h in zip(answered, served))
        time.sleep(0.3)
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'stoker:fallbacks_total{from="a",reason="overloaded",to="b"}' in metrics
    finally:
        server.stop()


def _serve_fails(tmp_path: Path, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "serve", "--engine-core", FAKE_CORE, "--no-embedding-model"]
        + ["--port", "0", "--db", str(tmp_path / "k.db"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO])},
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("stoker serve:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_wrong_digest_refuses_to_start(tmp_path: Path, files: dict) -> None:
    """One line naming both digests, no traceback. (Duplicate names, unknown
    fallbacks, cycles and the memory budget are refused by the same one-line
    path before or during loading: test_fleet.py checks their messages.)"""
    big, digest = files["big"]
    wrong = "sha256:" + "0" * 64
    line = _serve_fails(tmp_path, "--model", f"big={big}@{wrong}")
    assert f"expected {wrong}, got {digest}" in line
