"""stoker unchanged behind the routers people run: two `stoker serve` replicas
on the default model, sglang-router and vllm-router (their PyPI wheels) as
real subprocesses in front, and the official openai client talking to the
router. Checks that chat, streamed chat and completions succeed, that round
robin spread them over both replicas, and that the routers' probes left no
warnings in the replicas' logs; and that vllm-router's kv_aware policy, fed the
replicas' KV events, sends a request to the replica holding its prefix.
The replicas run with keys, as deploy/ does: a key with the router scope (and
inference, since sglang-router sends its one --api-key on every call) for
sglang-router, and the client's own key passed through vllm-router.
Skipped only when a router binary cannot run here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import ServerProcess, auth, engine_stats, free_port, on_free_ports, start_server_once

from stoker.control.db import open_db
from stoker.control.keys import KeyStore

# Each test gets 90 s; the replicas' start is bounded on its own (REPLICA_READY_S,
# in parallel): on a loaded 2-core machine loading the model alone took 50 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(90, func_only=True)]
REPLICA_READY_S = 150
MODEL = "smollm2-135m-instruct"
# Small replicas start fast: few KV blocks, few sequences, a short context.
# One engine thread each: two replicas share the two cores without oversubscribing them.
REPLICA_ARGS = ["--no-embedding-model", "--num-kv-blocks", "64", "--max-num-seqs", "4", "--max-model-len", "512",
                "--num-threads", "1"]  # fmt: skip
BIN = os.path.dirname(sys.executable)


# The replicas' keys (docs/routers.md, "Keys"): "router" has the router and inference
# scopes (sglang-router's --api-key), "client" is an application's inference key.
KEYS: dict[str, str] = {}


def router_command(kind: str, port: int, workers: list[str], policy: str = "round_robin") -> list[str]:
    """The command docs/routers.md gives, on free ports, with round robin. Both
    routers also serve Prometheus metrics on a port of their own (29000 by
    default, sglang-router's on every interface): a free one here. kv_aware
    (vllm-router) subscribes to each worker's KV events."""
    if kind == "sglang":
        return [os.path.join(BIN, "sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *workers, "--policy", "round_robin",
                "--health-check-endpoint", "/ready",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                *(["--api-key", KEYS["router"]] if KEYS else [])]  # fmt: skip
    command = [os.path.join(BIN, "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *workers, "--policy", policy,
               "--health-check-endpoint", "/ready", "--prometheus-port", str(free_port())]  # fmt: skip
    if policy == "kv_aware":
        for worker in workers:
            command += ["--kv-event-source", f"{worker}={KV_EVENTS[worker]}"]
        command += ["--kv-event-block-size", "16", "--kv-event-model", MODEL]
    return command


def require_router(kind: str) -> None:
    """Skip, saying why, when this router's binary is missing or cannot run on this machine."""
    command = router_command(kind, 0, [])[:1] + (["launch"] if kind == "sglang" else []) + ["--help"]
    if not os.path.exists(command[0]):
        pytest.skip(f"{kind}-router is not installed (pip install the test extra: {kind}-router)")
    try:
        probe = subprocess.run(command, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"{kind}-router cannot run on this machine: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"{kind}-router cannot run on this machine: {probe.stderr.decode(errors='replace')[-500:]}")


# Each replica's KV event endpoint (--kv-events-endpoint), by its URL.
KV_EVENTS: dict[str, str] = {}


def start_replica(tmp: str, db: str) -> tuple[ServerProcess, str]:
    """A replica publishing its KV events on a free port, and that endpoint: both its
    ports chosen afresh if either was taken before the replica bound it."""

    def once() -> tuple[ServerProcess, str]:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        args = [*REPLICA_ARGS, "--kv-events-endpoint", endpoint]
        return start_server_once(args, tmp, {"STOKER_DB": db}, REPLICA_READY_S), endpoint

    return on_free_ports(once)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    tmp = str(tmp_path_factory.mktemp("router-replicas"))
    db = os.path.join(tmp, "keys.db")  # one key database for both replicas
    store = KeyStore(open_db(db))
    KEYS["router"] = store.create("router", scopes=["inference", "router"])[1]
    KEYS["client"] = store.create("client")[1]
    store.engine.dispose()
    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(start_replica, tmp, db) for _ in range(2)]
        servers = []
        try:
            for future in starting:
                server, endpoint = future.result()
                servers.append(server)
                server.key = KEYS["router"]
                KV_EVENTS[server.url] = endpoint
            yield servers
        finally:
            for server in servers:
                server.stop()


def served_requests(server: ServerProcess, since: int) -> int:
    """Successful generation requests in a replica's request log after byte `since`
    (vllm-router also forwards GET /v1/models, which is logged too)."""
    lines = server.log()[since:].splitlines()
    generation = ('"path":"/v1/chat/completions"', '"path":"/v1/completions"')
    return sum(1 for line in lines if '"status":200' in line and any(path in line for path in generation))


def client_key(kind: str) -> str:
    """What a client sends: sglang-router demands its own --api-key (and sends it on);
    vllm-router passes the client's own key through."""
    return KEYS["router"] if kind == "sglang" else KEYS["client"]


def start_router(
    kind: str, workers: list[str], log_path: str, policy: str = "round_robin"
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(router_command(kind, port, workers, policy), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                raise RuntimeError(f"{kind}-router exited with {proc.returncode}:\n{f.read()[-3000:]}")
        try:
            models = httpx.get(f"{url}/v1/models", headers=auth(client_key(kind)), timeout=2)
            if models.status_code == 200 and MODEL in models.text:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"{kind}-router did not list {MODEL} within 40 s")


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_openai_client_through_router(kind: str, replicas: list[ServerProcess], tmp_path) -> None:
    require_router(kind)
    marks = [len(server.log()) for server in replicas]
    proc, url = start_router(kind, [server.url for server in replicas], str(tmp_path / f"{kind}-router.log"))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=client_key(kind), max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Say hello."}]
        for _ in range(2):
            chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
            assert chat.choices[0].message.content
            assert chat.usage is not None and chat.usage.completion_tokens <= 4
        # sglang-router turns max_tokens into max_completion_tokens: either way the limit holds.
        limited = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3)
        assert limited.usage is not None and limited.usage.completion_tokens <= 3
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text
        completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4)
        assert completion.choices[0].text
        flushed = httpx.post(f"{url}/flush_cache", headers=auth(KEYS["router"]), timeout=30)
        if kind == "sglang":  # it sends its --api-key, a router-scope key, to every replica
            assert flushed.status_code == 200, flushed.text
        else:  # vllm-router sends no key of its own: the replicas refuse (docs/routers.md, "Keys")
            assert "401" in flushed.text or flushed.status_code != 200, flushed.text
    finally:
        proc.terminate()
        proc.wait(10)
    counts = [served_requests(server, mark) for server, mark in zip(replicas, marks)]
    assert sum(counts) == 5, counts
    assert all(count >= 1 for count in counts), f"round robin left a replica idle: {counts}"
    for server, mark in zip(replicas, marks):
        new_log = server.log()[mark:]
        assert "Invalid HTTP request" not in new_log  # sglang-router's HTTP/2 probe is refused quietly
        assert "Traceback" not in new_log


def test_kv_aware_routes_to_the_replica_holding_the_prefix(replicas: list[ServerProcess], tmp_path) -> None:
    """Each replica is given one long prefix directly (the router learns it only from
    that replica's KV events); then requests sharing a prefix, sent to vllm-router
    with --policy kv_aware, must all reach the replica that holds it, and hit its cache."""
    require_router("vllm")
    for server in replicas:
        assert httpx.post(f"{server.url}/flush_cache", headers=server.headers(), timeout=30).status_code == 200
    proc, url = start_router("vllm", [server.url for server in replicas], str(tmp_path / "kv-router.log"), "kv_aware")
    try:
        # Events published before the router subscribed are lost to it (PUB keeps nothing for late joiners).
        time.sleep(1.0)
        # ~170 tokens each (10 KV blocks of 16), different from the first word on.
        prefixes = [" ".join(f"{word}{i}" for i in range(60)) for word in ("alpha", "omega")]
        for server, prefix in zip(replicas, prefixes):
            done = httpx.post(
                f"{server.url}/v1/completions",
                json={"prompt": prefix, "max_tokens": 1},
                headers=server.headers(),
                timeout=60,
            )
            assert done.status_code == 200, done.text
        time.sleep(0.5)  # the router's subscriber polls every 10 ms
        marks = [len(server.log()) for server in replicas]
        hits = [engine_stats(server)["prefix_cache_hits"] for server in replicas]
        # Replica 1's prefix first: a router that ignored the events would pick replica 0 for an idle tie.
        for holder in (1, 0, 1, 0):
            body = {"model": MODEL, "prompt": f"{prefixes[holder]} and then {holder}", "max_tokens": 1}
            routed = httpx.post(f"{url}/v1/completions", json=body, headers=auth(KEYS["client"]), timeout=60)
            assert routed.status_code == 200, routed.text
    finally:
        proc.terminate()
        proc.wait(10)
    served = [served_requests(server, mark) for server, mark in zip(replicas, marks)]
    assert served == [2, 2], f"kv_aware sent the prefixes elsewhere: {served}"
    for server, prefix, before in zip(replicas, prefixes, hits):
        counted = httpx.post(f"{server.url}/tokenize", json={"prompt": prefix}, headers=server.headers(), timeout=10)
        tokens = counted.json()["count"]
        assert tokens >= 8 * 16
        # Both requests reused the prefix's full blocks (but perhaps the last, its tokenization may change).
        assert engine_stats(server)["prefix_cache_hits"] - before >= 2 * (tokens // 16 - 1) * 16
