"""Shared test helpers. tests/ is put on sys.path so that spawned engine
processes can import the fake core in tests/server_fakes.py."""

from __future__ import annotations

import os
import sys

# Under pytest-xdist (`make test` runs two workers) each worker, and every server
# or engine it starts, computes on one thread: two workers of two threads each on
# two cores made an in-process test on the default model 7x slower (OpenMP's
# threads spin waiting for one another), where one thread each keeps both cores
# busy and overlaps one worker's waits (servers starting, timeouts, polls) with
# the other's arithmetic. Set before torch is imported: it reads it once.
IN_XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if IN_XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

import asyncio
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import httpx
import pytest

from stoker.bench.server_ready import wait_until_ready

if TYPE_CHECKING:
    from transformers import PreTrainedModel

REPO = os.path.dirname(TESTS_DIR)
T = TypeVar("T")
FAKE_CORE = "server_fakes:FakeEngineCore"


def cache_sharing_kernels(cache: str | os.PathLike[str]) -> str:
    """`cache` made a STOKER_CACHE_DIR of its own (GGUF headers, tokenizers, model
    identities) whose compiled C kernels are the usual cache's: each library there
    is keyed by its sources, flags and CPU, so it is what a fresh build would give,
    and building them all anew takes a minute on 2 cores. Returns `cache`."""
    usual = os.path.join(os.environ.get("STOKER_CACHE_DIR") or os.path.expanduser("~/.cache/stoker"), "kernels")
    os.makedirs(usual, exist_ok=True)
    os.makedirs(cache, exist_ok=True)
    kernels = os.path.join(cache, "kernels")
    if not os.path.lexists(kernels):
        os.symlink(os.path.realpath(usual), kernels)
    return os.fspath(cache)


def pytest_collection_finish(session: pytest.Session) -> None:
    """A run of much of the suite loads every ISA build of the C kernels (tests force
    each path), one after another where each is first needed: ~67 s of compiling on
    2 cores whenever ggml_quant.c changed or the cache is new. Compiled here instead,
    one per core at a time, before the first test."""
    if len(session.items) >= 500 and not IN_XDIST_WORKER:  # an xdist controller built them (pytest_configure)
        _prebuild_kernels()


def _prebuild_kernels() -> None:
    if os.environ.get("STOKER_DISABLE_C_KERNELS") == "1":
        return
    from stoker.models.quant.kernels import prebuild_every_isa

    prebuild_every_isa(workers=os.cpu_count() or 1)


# Files whose session fixtures are costly, kept on one xdist worker so that the
# fixture is made once: transformers' float32 default model (~20 s to load on one
# thread) and the real server the e2e tests share.
_SHARED_FIXTURE_GROUPS = {
    "transformers-default-model": (
        "tests/integration/test_fidelity.py",
        "tests/integration/test_default_model_load.py",
        "tests/integration/test_lora_default_model.py",
    ),
    "real-server": (
        "tests/e2e/test_openai_client.py",
        "tests/e2e/test_structured_output.py",
        "tests/e2e/test_anthropic_client.py",
        "tests/unit/control/test_control_server.py",
        "tests/unit/security/test_security_bounds.py",
        "tests/unit/bench/test_bench_stoker_server.py",
    ),
}
_GROUP_OF_FILE = {path: group for group, paths in _SHARED_FIXTURE_GROUPS.items() for path in paths}


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile` (as `make test` runs), with the files of each
    _SHARED_FIXTURE_GROUPS group sent to one worker as if they were one file.
    (xdist's own `loadgroup` cannot do it under pytest 9: it renames nodeids
    through an attribute pytest no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndSharedFixtures(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _GROUP_OF_FILE.get(path, path)

    return FilesAndSharedFixtures(config, log)


def pytest_configure(config: pytest.Config) -> None:
    """The controller of an xdist run collects nothing itself: it prebuilds the
    kernels (see pytest_collection_finish) before its workers start, once."""
    if getattr(config.option, "numprocesses", None) and not IN_XDIST_WORKER:
        _prebuild_kernels()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A `stoker serve` child process on 127.0.0.1, stopped by stop() whatever happens."""

    proc: subprocess.Popen
    port: int
    log_path: str
    key: str | None = None
    """On a server with keys: the key engine_stats and store_failures read /ready's
    details and /metrics with (an admin key, or one with the metrics scope)."""

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float) -> None:
        why = wait_until_ready(self.url, self.proc, timeout, interval=0.1)
        if why is None:
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"server {why}:\n{self.log()[-4000:]}")
        self.stop()
        raise TimeoutError(f"server {why}:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def on_free_ports(start: Callable[[], T]) -> T:
    """start() (which takes its ports from free_port()), called again, up to three times
    in all, while the server failed because one of those ports was taken before it bound
    it: free_port() releases the port it found, and another test's process can get there
    in between."""
    for attempt in range(3):
        try:
            return start()
        except RuntimeError as error:
            if "already in use" not in str(error).lower() or attempt == 2:
                raise
    raise AssertionError("unreachable")


def start_server(
    args: list[str], tmp_dir: str, env: dict[str, str] | None = None, ready_timeout: float = 120
) -> ServerProcess:
    """A server on a free port (another, if that one was taken meanwhile: on_free_ports)."""
    return on_free_ports(lambda: start_server_once(args, tmp_dir, env, ready_timeout))


def start_server_once(
    args: list[str], tmp_dir: str, env: dict[str, str] | None = None, ready_timeout: float = 120
) -> ServerProcess:
    """A server on the port free_port() gives, once."""
    port = free_port()
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    # A fresh key/usage database per server unless the test brings its own:
    # tests must never write ~/.stoker (nor see keys someone created there).
    full_env = {
        **os.environ,
        "STOKER_DB": os.path.join(tmp_dir, f"stoker-{port}.db"),
        "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO]),
        **(env or {}),
    }
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stoker.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=REPO,
        )
    server = ServerProcess(proc, port, log_path)
    server.wait_ready(ready_timeout)
    return server


@pytest.fixture(scope="session")
def fake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server over the fake core, shared by the fast server tests."""
    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256", "--max-body-bytes", "65536"],
        str(tmp_path_factory.mktemp("fake-server")),
        env={"STOKER_FAKE_STEP_S": "0.02"},  # 50 tokens/s: long requests are easy to catch in flight
    )
    try:
        yield server
    finally:
        server.stop()


REAL_SERVER_ARGS = ["--max-model-len", "1024", "--max-num-seqs", "32"]


@pytest.fixture(scope="session")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server on the default model (and the embedding model), shared by every e2e test."""
    if not os.path.exists(os.path.join(REPO, "stoker", "engine", "core.py")):
        pytest.skip("the engine core is not in the tree yet")
    server = start_server(REAL_SERVER_ARGS, str(tmp_path_factory.mktemp("real-server")), ready_timeout=600)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def transformers_default_model() -> PreTrainedModel:
    """transformers' float32 model of the default GGUF, loaded once: its GGUF
    reader dequantizes every tensor in Python (~10 s on 2 cores), and the
    loader's bit-for-bit weight check, the fidelity test's reference generations
    and the LoRA test's peft base (a copy) read the same model (none changes it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from stoker.config import default_model_path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32, local_files_only=True
    ).eval()


def auth(secret: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}", **headers}


def engine_stats(server: ServerProcess) -> dict:
    """The engine's latest stats snapshot, as /ready reports it."""
    return httpx.get(f"{server.url}/ready", headers=server.headers(), timeout=5).json()["engine_stats"]


def store_failures(server: ServerProcess, store: str) -> dict[str, float]:
    """stoker:store_failures_total{store=...} by operation, as the server's /metrics shows it."""
    from prometheus_client.parser import text_string_to_metric_families

    body = httpx.get(f"{server.url}/metrics", headers=server.headers(), timeout=5).text
    return {
        sample.labels["operation"]: sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == "stoker:store_failures_total" and sample.labels["store"] == store
    }


def poll_until(read: Callable[[], T], done: Callable[[T], bool], timeout: float, interval: float = 0.05) -> T:
    """read() again every `interval` until done(value) or `timeout` passes; the last value.
    For figures a periodic feed publishes (the engine's stats, /metrics every 0.25 s): the
    caller asserts on the value returned, as it did after a fixed sleep past the feed's
    period, and a value that never comes fails the same assertion once the timeout is out."""
    deadline = time.monotonic() + timeout
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(interval)
        value = read()
    return value


async def wait_for(predicate, timeout: float, what: str, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        await asyncio.sleep(interval)


@pytest.fixture(autouse=True)
def _torch_threads_put_back() -> Iterator[None]:
    """An in-process engine started with num_threads=2 (tests/unit/models/test_fused_decoder.py)
    sets torch's thread count for the whole worker. Left there, every later test on that
    worker computed on two threads beside the other worker: CI once ran
    test_fidelity.py's first test past its 600 s timeout (~80 s on one thread), its
    main thread waiting at an OpenMP barrier. Put back after each test."""
    yield
    torch = sys.modules.get("torch")
    wanted = os.environ.get("OMP_NUM_THREADS", "") if IN_XDIST_WORKER else ""
    if torch is not None and wanted.isdigit() and torch.get_num_threads() != int(wanted):
        torch.set_num_threads(int(wanted))
