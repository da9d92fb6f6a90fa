"""The prefix cache's disk tier across processes (issue 36 items 2-4), on real
`stoker serve` processes of a tiny random-weight llama, with the official
openai client: two replicas share one --kv-cache-disk folder (a prefix one of
them computed is a disk hit for the other); pins made through /admin/prefixes
are seen by both, outlive the LRU and a restart; a server killed with SIGKILL
while it writes blocks, then restarted over truncated and byte-flipped block
files, serves no corrupt block: its greedy output equals the cold one."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from conftest import ServerProcess, auth, engine_stats, start_server
from tiny_models import make_tiny_hf_model

from stoker.control.db import open_db
from stoker.control.keys import KeyStore
from stoker.engine.kv_cache import chain_hash

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120, func_only=True)]
BLOCK = 16
VOCAB = 49152
DISK_SIZE = 512 * 1024
"""Small enough that a few dozen prompts overflow it (the LRU must evict), large enough for the rest."""
MODEL = "tiny"
ARGS = ["--no-embedding-model", "--num-kv-blocks", "64", "--max-model-len", "512", "--max-num-seqs", "4",
        "--num-threads", "1", "--kv-cache-disk-size", str(DISK_SIZE)]  # fmt: skip


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.disk = tmp / "kv"
        self.disk.mkdir()
        self.model = str(make_tiny_hf_model("llama", tmp))
        db = str(tmp / "keys.db")
        store = KeyStore(open_db(db))
        self.key = store.create("root", admin=True)[1]
        store.engine.dispose()
        self.env = {"STOKER_DB": db}
        self.servers: list[ServerProcess] = []

    def start(self) -> ServerProcess:
        args = ["--model", f"{MODEL}={self.model}", *ARGS, "--kv-cache-disk", str(self.disk)]
        server = start_server(args, str(self.tmp), self.env, ready_timeout=150)
        server.key = self.key
        return server

    def client(self, server: ServerProcess) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key=self.key, max_retries=0, timeout=60)

    def admin(self, server: ServerProcess, method: str, path: str = "", **kwargs: object) -> httpx.Response:
        url = f"{server.url}/admin/prefixes{path}"
        return httpx.request(method, url, headers=auth(self.key), timeout=120, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("kv-disk-replicas"))
    try:
        with ThreadPoolExecutor(2) as pool:  # both replicas load at once
            cluster.servers = list(pool.map(lambda _: cluster.start(), range(2)))
        yield cluster
    finally:
        for server in cluster.servers:
            server.stop()


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def complete(cluster: Cluster, server: ServerProcess, ids: list[int]) -> tuple[str, int]:
    """The greedy answer to a token-id prompt, and its cached prompt tokens."""
    answer = cluster.client(server).completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    usage = answer.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return answer.choices[0].text, usage.prompt_tokens_details.cached_tokens or 0


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.05)


def block_files(cluster: Cluster, ids: list[int]) -> list[Path]:
    """Where the full blocks of ids are filed (whatever layout folder holds them), present or not."""
    (layout,) = [p for p in cluster.disk.iterdir() if p.is_dir()]
    paths, parent = [], None
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        parent = chain_hash(parent, tuple(ids[start : start + BLOCK]))
        paths.append(layout / parent[:1].hex() / f"{parent.hex()}.kv")
    return paths


def wait_written(cluster: Cluster, ids: list[int]) -> None:
    """Until every full block of the prompt ids is on disk (the writer works after the answer)."""
    wait_until(lambda: all(p.exists() for p in block_files(cluster, ids)), "the blocks on disk")


SHARED = prompt(1, 200)
PINNED = prompt(2, 100)


def test_a_prefix_one_replica_computed_is_a_disk_hit_for_the_other(cluster: Cluster) -> None:
    a, b = cluster.servers
    cold, cached = complete(cluster, a, SHARED)
    assert cached == 0
    wait_written(cluster, SHARED)
    # The writer works after the engine went idle: the front end's stats still catch up with it.
    wait_until(
        lambda: (s := engine_stats(a))["kv_disk_pending_writes"] == 0 and s["kv_disk_bytes_written"] > 0, "stats"
    )
    warm, cached = complete(cluster, b, SHARED)
    assert cached == (len(SHARED) - 1) // BLOCK * BLOCK  # every full block but the one holding the last token
    assert warm == cold
    assert engine_stats(b)["kv_disk_hits"] >= cached // BLOCK


def test_a_pin_is_computed_once_and_seen_by_every_replica(cluster: Cluster) -> None:
    a, b = cluster.servers
    response = cluster.admin(a, "POST", json={"label": "few-shot", "token_ids": PINNED})
    assert response.status_code == 201, response.text
    pin = response.json()
    assert (pin["label"], pin["num_tokens"], pin["num_blocks"]) == ("few-shot", 100, 100 // BLOCK)

    def listed(server: ServerProcess) -> dict:
        (entry,) = [p for p in cluster.admin(server, "GET").json()["data"] if p["label"] == "few-shot"]
        return entry

    wait_until(lambda: listed(a)["blocks_on_disk"] == pin["num_blocks"], "the pinned blocks on disk")
    assert listed(b)["blocks_on_disk"] == pin["num_blocks"]  # the other replica shares the folder, pins included
    # A request that starts with the pinned prefix gets it from the cache.
    _, cached = complete(cluster, b, [*PINNED, *prompt(3, 40)])
    assert cached >= pin["num_blocks"] * BLOCK


def test_a_pinned_chat_prefix_is_what_a_chat_request_starts_with(cluster: Cluster) -> None:
    a, _ = cluster.servers
    system = {"role": "system", "content": " ".join(["Answer in the voice of a ship's captain."] * 12)}
    response = cluster.admin(a, "POST", json={"label": "captain", "messages": [system]})
    assert response.status_code == 201, response.text
    blocks = response.json()["num_blocks"]
    assert blocks >= 4
    chat = cluster.client(a).chat.completions.create(
        model=MODEL,
        messages=[system, {"role": "user", "content": "Where are we?"}],  # type: ignore[list-item]
        max_tokens=4,
        temperature=0,
    )
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert (chat.usage.prompt_tokens_details.cached_tokens or 0) >= blocks * BLOCK


def test_pin_bounds(cluster: Cluster) -> None:
    a, _ = cluster.servers
    too_long = cluster.admin(a, "POST", json={"label": "long", "token_ids": prompt(4, 512)})
    assert too_long.status_code == 400 and "512" in too_long.json()["error"]["message"]
    short = cluster.admin(a, "POST", json={"label": "short", "token_ids": prompt(4, BLOCK - 1)})
    assert short.status_code == 400 and "--block-size" in short.json()["error"]["message"]
    assert cluster.admin(a, "DELETE", "/never-pinned").status_code == 404
    assert cluster.admin(a, "POST", json={"label": "gone", "token_ids": prompt(5, 40)}).status_code == 201
    assert cluster.admin(a, "DELETE", "/gone").json()["deleted"] is True
    assert "gone" not in [p["label"] for p in cluster.admin(a, "GET").json()["data"]]


def test_kill_9_while_writing_then_corrupt_files_serve_no_corrupt_block_and_pins_survive(cluster: Cluster) -> None:
    a, _ = cluster.servers
    # Overflow the folder's size: the LRU evicts, never a pinned block.
    seed = 100
    while engine_stats(a)["kv_disk_evictions"] == 0:
        assert seed < 140, "the disk tier never evicted"
        complete(cluster, a, prompt(seed, 160))
        seed += 1
    pins = {p["label"]: p for p in cluster.admin(a, "GET").json()["data"]}
    assert all(p["blocks_on_disk"] == p["num_blocks"] for p in pins.values()), pins
    # Two prompts computed cold and written, the newest in the LRU.
    first, second = prompt(200, 96), prompt(201, 96)
    cold = [complete(cluster, a, ids)[0] for ids in (first, second)]
    wait_written(cluster, first)
    wait_written(cluster, second)
    # kill -9 the front end and its engine while requests finish and their blocks are written.
    engine_pid = httpx.get(f"{a.url}/admin/models", headers=auth(cluster.key)).json()["data"][0]["stable"]["engine_pid"]
    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(complete, cluster, a, prompt(300 + i, 160)) for i in range(3)]
        wait_until(lambda: any(f.done() for f in running), "an answer, whose blocks are being written")
        os.kill(a.proc.pid, signal.SIGKILL)
        os.kill(engine_pid, signal.SIGKILL)
        for future in running:
            future.exception()  # the ones cut off fail; only the files matter here
    a.proc.wait(10)
    # A torn file and a flipped byte in blocks the restarted server will look up.
    truncated, flipped = block_files(cluster, first)[2], block_files(cluster, second)[1]
    whole = {path: path.read_bytes() for path in (truncated, flipped)}
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x40
    flipped.write_bytes(bytes(data))

    cluster.servers[0] = restarted = cluster.start()
    answers = [complete(cluster, restarted, ids) for ids in (first, second)]
    assert [text for text, _ in answers] == cold  # recomputed where the chain broke, never served corrupt
    assert [cached for _, cached in answers] == [2 * BLOCK, 1 * BLOCK]  # the blocks before the bad one only
    assert engine_stats(restarted)["kv_disk_corrupt_dropped"] == 2
    # The bad files were removed, and the recomputed blocks filed again in their place.
    wait_written(cluster, first)
    wait_written(cluster, second)
    assert {path: path.read_bytes() for path in whole} == whole
    after = {p["label"]: p for p in cluster.admin(restarted, "GET").json()["data"]}
    assert after.keys() == pins.keys()
    assert all(p["blocks_on_disk"] == p["num_blocks"] for p in after.values()), after


def test_the_cli_pins_lists_and_unpins(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from stoker.cli import main

    a, _ = cluster.servers
    monkeypatch.setenv("STOKER_API_KEY", cluster.key)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(prompt(6, 50)))
    base = ["prefixes", "--url", a.url, "--model", MODEL]
    assert main([*base, "pin", "from-cli", "--token-ids-file", str(ids)]) == 0
    assert json.loads(capsys.readouterr().out)["num_blocks"] == 50 // BLOCK
    assert main([*base, "list"]) == 0
    assert "from-cli" in capsys.readouterr().out
    assert main([*base, "unpin", "from-cli"]) == 0
    assert main([*base, "unpin", "from-cli"]) == 1
    assert "404" in capsys.readouterr().err
