"""What POST /admin/models may load, and that no load can hang the server
(issue 34 item 6), against `stoker serve` processes on the fake engine core
with an admin key: /dev/zero, a FIFO and a folder holding one are refused at
once; paths outside the model roots get one message whether or not they
exist; a symlink out of a root is refused; reading a model's files is
bounded by --model-check-timeout and holds up neither another load nor
SIGTERM; --max-models caps the models; an unload while a new version of the
model loads leaves no engine process behind."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from conftest import FAKE_CORE, ServerProcess, start_server

from stoker.control.db import open_db
from stoker.control.keys import KeyStore

pytestmark = pytest.mark.timeout(240)
HUGE = 1 << 40
"""A sparse file this big takes minutes to hash: a load that reads it stays busy."""


def _key(db: str) -> dict[str, str]:
    _, secret = KeyStore(open_db(db)).create("root", admin=True)
    return {"Authorization": f"Bearer {secret}"}


def _file(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def _huge(path: Path) -> tuple[Path, str]:
    with open(path, "wb") as f:
        f.truncate(HUGE)
    return path, "sha256:" + "0" * 64  # pinned: hashed before its engine would start


def _serve(tmp: Path, models: dict[str, Path], *args: str, core: str = FAKE_CORE, env: dict | None = None) -> Any:
    db = str(tmp / "keys.db")
    headers = _key(db)
    flags = ["--engine-core", core, "--no-embedding-model", "--max-model-len", "256"]
    for name, path in models.items():
        flags += ["--model", f"{name}={path}"]
    server = start_server([*flags, *args], str(tmp), env={"STOKER_DB": db, "STOKER_FAKE_STEP_S": "0.01", **(env or {})})
    return server, headers


def _engines(server: ServerProcess) -> list[psutil.Process]:
    """The server's engine processes (multiprocessing spawn children, not its resource tracker)."""
    out = []
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "spawn_main" in cmdline and child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
            out.append(child)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("model-root")
    for name in ("a", "b", "c", "d", "e"):
        _file(folder / f"{name}.bin", name.encode() * 64)
    return folder


@pytest.fixture(scope="module")
def served(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    """Default options: the model root is the folder of a and b."""
    server, headers = _serve(tmp_path_factory.mktemp("model-paths-server"), {"a": root / "a.bin", "b": root / "b.bin"})
    try:
        yield server, headers
    finally:
        server.stop()


@pytest.fixture(scope="module")
def bounded(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    server, headers = _serve(
        tmp_path_factory.mktemp("model-bounds-server"),
        {"a": root / "a.bin", "b": root / "b.bin"},
        *("--model-check-timeout", "6", "--max-models", "4"),
    )
    try:
        yield server, headers
    finally:
        server.stop()


def _load(server: ServerProcess, headers: dict, body: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{server.url}/admin/models", json=body, headers=headers, timeout=timeout)


def _names(server: ServerProcess, headers: dict) -> list[str]:
    return [m["name"] for m in httpx.get(f"{server.url}/admin/models", headers=headers, timeout=10).json()["data"]]


def test_dev_zero_a_fifo_and_a_folder_holding_one_are_refused_at_once(
    served: tuple[ServerProcess, dict], root: Path, tmp_path: Path
) -> None:
    server, headers = served
    fifo = root / "pipe.gguf"
    os.mkfifo(fifo)
    folder = root / "hf-with-a-fifo"
    folder.mkdir()
    _file(folder / "config.json", b"{}")
    os.mkfifo(folder / "model.safetensors")
    (root / "zero.gguf").symlink_to("/dev/zero")
    cases = [
        ("/dev/zero", 403, "is not under an allowed model root"),
        (str(root / "zero.gguf"), 403, "is not under an allowed model root"),  # the link's target counts
        (str(fifo), 400, "is not a regular file or a folder"),
        (str(folder), 400, "is not a regular file"),
    ]
    for path, status, says in cases:
        started = time.monotonic()
        response = _load(server, headers, {"name": "x", "path": path}, timeout=8)
        assert time.monotonic() - started < 5, path
        assert response.status_code == status, (path, response.text)
        assert says in response.json()["error"]["message"], (path, response.text)
    assert httpx.get(f"{server.url}/health", timeout=2).status_code == 200
    assert _names(server, headers) == ["a", "b"]  # nothing changed


def test_outside_the_roots_one_message_whether_or_not_the_path_exists(
    served: tuple[ServerProcess, dict], tmp_path: Path
) -> None:
    server, headers = served
    real = _file(tmp_path / "elsewhere.bin", b"weights" * 10)
    answers = []
    for path in (str(real), str(tmp_path / "missing.bin"), "/etc/passwd", "/etc/no-such-file", "/nowhere/x.gguf"):
        response = _load(server, headers, {"name": "x", "path": path})
        assert response.status_code == 403, (path, response.text)
        assert response.json()["error"]["param"] == "path"
        answers.append(response.json()["error"])
    assert all(a == answers[0] for a in answers), answers  # nothing tells which exist
    assert "is not under an allowed model root" in answers[0]["message"]
    assert "--model-root" in answers[0]["message"]
    assert _names(server, headers) == ["a", "b"]


def test_a_symlink_or_a_dotdot_out_of_a_root_is_refused(
    served: tuple[ServerProcess, dict], root: Path, tmp_path: Path
) -> None:
    server, headers = served
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = _file(outside / "secret.bin", b"not a model for you")
    (root / "escape.bin").symlink_to(secret)
    (root / "escape-dir").symlink_to(outside)
    for path in (root / "escape.bin", root / "escape-dir", root / "escape-dir" / "secret.bin", root / ".." / "x.bin"):
        response = _load(server, headers, {"name": "x", "path": str(path)})
        assert response.status_code == 403, (path, response.text)
        assert "is not under an allowed model root" in response.json()["error"]["message"]
    assert _names(server, headers) == ["a", "b"]


def test_a_slow_read_holds_up_no_other_load_and_times_out(bounded: tuple[ServerProcess, dict], root: Path) -> None:
    """A load busy hashing (a huge file, pinned) does not hold the fleet's lock:
    another model loads meanwhile; the slow one ends at --model-check-timeout
    (6 s here) with a 400 naming it; the next load is not blocked."""
    server, headers = bounded
    huge, pin = _huge(root / "huge.gguf")
    slow: dict[str, Any] = {}

    def slow_load() -> None:
        started = time.monotonic()
        slow["response"] = _load(server, headers, {"name": "huge", "path": str(huge), "digest": pin}, timeout=60)
        slow["took"] = time.monotonic() - started

    thread = threading.Thread(target=slow_load)
    thread.start()
    time.sleep(0.5)
    assert "response" not in slow  # sent while the slow one reads: no 409 "another model is loading"
    other = _load(server, headers, {"name": "c", "path": str(root / "c.bin")}, timeout=60)
    assert other.status_code == 200, other.text
    thread.join(60)
    response, took = slow["response"], slow["took"]
    assert response.status_code == 400, response.text
    assert "--model-check-timeout (6 s)" in response.json()["error"]["message"]
    assert 5 < took < 20
    after = _load(server, headers, {"name": "d", "path": str(root / "d.bin")})
    assert after.status_code == 200, after.text
    assert httpx.delete(f"{server.url}/admin/models/d", headers=headers, timeout=10).status_code == 200


def test_max_models_caps_the_models_loaded(bounded: tuple[ServerProcess, dict], root: Path) -> None:
    server, headers = bounded
    names = _names(server, headers)
    spare = [n for n in ("c", "d", "e") if n not in names]
    while len(names) < 4:
        name = spare.pop(0)
        assert _load(server, headers, {"name": name, "path": str(root / f"{name}.bin")}).status_code == 200
        names.append(name)
    refused = _load(server, headers, {"name": "over", "path": str(root / "e.bin")})
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "too_many_models" and "--max-models (4)" in error["message"]
    assert len(_names(server, headers)) == 4
    swap = _load(server, headers, {"name": "a", "path": str(root / "e.bin")})  # a new version is no new model
    assert swap.status_code == 200, swap.text


@pytest.fixture(scope="module")
def slow_engines(
    root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    """Engines that take 4 s to load, like big models."""
    server, headers = _serve(
        tmp_path_factory.mktemp("slow-engines-server"),
        {"a": root / "a.bin", "b": root / "b.bin"},
        core="server_fakes:SlowLoadingEngineCore",
        env={"STOKER_FAKE_LOAD_S": "4"},
    )
    try:
        yield server, headers
    finally:
        server.stop()


def test_unload_while_a_new_version_loads_leaves_no_engine_behind(
    slow_engines: tuple[ServerProcess, dict], root: Path
) -> None:
    server, headers = slow_engines
    assert len(_engines(server)) == 2
    new = _file(root / "b-v2.bin", b"b, second version" * 10)
    digest = "sha256:" + hashlib.sha256(new.read_bytes()).hexdigest()
    answer: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: answer.update(
            response=_load(server, headers, {"name": "b", "path": str(new), "digest": digest}, timeout=60)
        )
    )
    thread.start()
    deadline = time.monotonic() + 10
    while len(_engines(server)) < 3:  # the new version's engine process is up, still loading
        assert time.monotonic() < deadline, "the new version's engine never started"
        time.sleep(0.05)
    unloaded = httpx.delete(f"{server.url}/admin/models/b", headers=headers, timeout=10)
    assert unloaded.status_code == 200, unloaded.text
    thread.join(30)
    response = answer["response"]
    assert response.status_code == 409, response.text
    assert "unloaded" in response.json()["error"]["message"]
    deadline = time.monotonic() + 15
    while len(_engines(server)) != 1:  # b's old version drains and ends; the new one ended at once
        assert time.monotonic() < deadline, f"engine processes left: {[p.pid for p in _engines(server)]}"
        time.sleep(0.1)
    assert _names(server, headers) == ["a"]
    assert httpx.get(f"{server.url}/admin/models", headers=headers, timeout=10).json()["retiring"] == []


def test_sigterm_during_a_load_stops_the_server_promptly(slow_engines: tuple[ServerProcess, dict], root: Path) -> None:
    """Last on its server: it stops it."""
    server, headers = slow_engines
    _, pin = _huge(root / "huge-2.gguf")
    answer: dict[str, Any] = {}

    def slow_load() -> None:
        try:
            answer["response"] = _load(
                server, headers, {"name": "huge", "path": str(root / "huge-2.gguf"), "digest": pin}, timeout=120
            )
        except httpx.HTTPError as exc:
            answer["error"] = exc

    thread = threading.Thread(target=slow_load)
    try:
        engines = _engines(server)
        assert engines
        thread.start()
        deadline = time.monotonic() + 20
        while not any(f.path.endswith("huge-2.gguf") for f in psutil.Process(server.proc.pid).open_files()):
            assert time.monotonic() < deadline and thread.is_alive(), f"the load never read the file: {answer}"
            time.sleep(0.05)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(30)
        except Exception:
            pass
        took = time.monotonic() - started
        # An idle server stops in about 3 s here, more on a busy machine; before, a load hashing stopped it not at all.
        assert server.proc.returncode is not None and took < 15, f"SIGTERM took {took:.1f} s:\n{server.log()[-3000:]}"
        thread.join(10)
        if "response" in answer:
            assert answer["response"].status_code == 503, answer["response"].text
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engines)
    finally:
        thread.join(5)


def test_model_roots_repeat_as_flags_and_split_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.cli import build_parser
    from stoker.server.cli import resolve_configs

    def server(argv: list[str]) -> Any:
        return resolve_configs(build_parser().parse_args(["serve", *argv]))[1]

    config = server(["--model-root", "/srv/a", "--model-root", "/srv/b", "--max-models", "2"])
    assert config.model_root == ["/srv/a", "/srv/b"] and config.max_models == 2
    assert config.model_check_timeout == 900.0
    monkeypatch.setenv("STOKER_MODEL_ROOT", "/srv/c /srv/d")
    assert server([]).model_root == ["/srv/c", "/srv/d"]
