"""Prefill and decode apart behind the real sglang-router (docs/disaggregation.md):
a `--role prefill` and a `--role decode` stoker on a tiny random-weight model,
`sglang-router launch --pd-disaggregation` in front with a router-scope key,
and the official openai client talking to the router.

Checked: chat, streamed chat and completions give the decode worker's own
greedy tokens served whole (its prefix cache flushed in between, so it computes
them itself); the prompt's KV blocks crossed (sent on the prefill worker,
received on the decode worker, in /metrics); a prompt sharing a prefix with one
already pulled asks only for the rest (blocks skipped); a key without the
router scope cannot pair workers on either role; a client leaving mid-stream
leaves no KV blocks held on either side; a decode worker whose KV dtype differs
from its --kv-peers stops at start with one line; and kill -9 of the prefill
worker while a decode worker waits for its blocks: the request completes by
recompute, the router's next request fails cleanly and the decode worker serves
the one after. Skipped only when the router binary cannot run here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
from conftest import REPO, TESTS_DIR, ServerProcess, auth, engine_stats, free_port, start_server
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import make_tiny_hf_model

from stoker.bench.server_ready import wait_until_ready
from stoker.control.db import open_db
from stoker.control.keys import KeyStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120, func_only=True)]
READY_S = 240
BIN = os.path.dirname(sys.executable)
# Small workers: few blocks and sequences, one engine thread each (two share the two cores).
WORKER_ARGS = ["--no-embedding-model", "--no-ui", "--num-kv-blocks", "64", "--max-num-seqs", "4",
               "--max-model-len", "512", "--num-threads", "1", "--speculative-method", "none"]  # fmt: skip
# ~170 tokens: 10 full KV blocks of 16.
PROMPT = " ".join(f"word{i}" for i in range(60))


@dataclass
class Workers:
    prefill: ServerProcess
    decode: ServerProcess
    router: str
    router_proc: subprocess.Popen[bytes]
    model: str
    model_path: str
    transfer_port: int
    keys: dict[str, str]
    tmp: str


def metric(server: ServerProcess, name: str) -> float:
    """One stoker:kv_transfer_* counter (or gauge) of a worker, summed over its labels."""
    body = httpx.get(f"{server.url}/metrics", headers=server.headers(), timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == name
    )


def settled(server: ServerProcess, name: str) -> float:
    """The counter once it stopped moving: the engine's stats reach /metrics a few hundred ms late."""
    value = metric(server, name)
    while True:
        time.sleep(0.6)
        again = metric(server, name)
        if again == value:
            return value
        value = again


def grown(server: ServerProcess, name: str, since: float, at_least: float) -> float:
    """How much the counter grew since `since`, waiting (up to 10 s) for it to grow by at_least."""
    deadline = time.monotonic() + 10
    while (value := metric(server, name)) - since < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    return value - since


def require_router() -> None:
    binary = os.path.join(BIN, "sglang-router")
    if not os.path.exists(binary):
        pytest.skip("sglang-router is not installed (pip install the test extra)")
    probe = subprocess.run([binary, "launch", "--help"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"sglang-router cannot run on this machine: {probe.stderr.decode(errors='replace')[-300:]}")


def start_router(
    prefill: str, transfer_port: int, decode: str, api_key: str, log_path: str
) -> tuple[subprocess.Popen[bytes], str]:
    """docs/disaggregation.md's router command, on free ports."""
    port = free_port()
    command = [os.path.join(BIN, "sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port),
               "--pd-disaggregation", "--prefill", prefill, str(transfer_port), "--decode", decode,
               "--policy", "round_robin", "--health-check-endpoint", "/ready", "--api-key", api_key,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    why = wait_until_ready(url, proc, 40, interval=0.2, path="/v1/models", headers=auth(api_key))
    if why is None:
        return proc, url
    if proc.poll() is not None:
        with open(log_path, errors="replace") as f:
            raise RuntimeError(f"sglang-router exited with {proc.returncode}:\n{f.read()[-3000:]}")
    proc.kill()
    raise TimeoutError("sglang-router did not answer /v1/models within 40 s")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    require_router()
    tmp = str(tmp_path_factory.mktemp("pd"))
    model = str(make_tiny_hf_model("llama", tmp))
    db = os.path.join(tmp, "keys.db")  # one key database for both workers
    store = KeyStore(open_db(db))
    keys = {
        "router": store.create("pd-router", scopes=["inference", "router"])[1],
        "client": store.create("client")[1],
        "ops": store.create("ops", admin=True)[1],
    }
    store.engine.dispose()
    transfer_port = free_port()
    env = {"STOKER_DB": db}
    with ThreadPoolExecutor(2) as pool:
        prefill_start = pool.submit(
            start_server, [model, *WORKER_ARGS, "--role", "prefill", "--kv-transfer-port", str(transfer_port)],
            tmp, env, READY_S,
        )  # fmt: skip
        # Its peer check may run before the prefill worker listens: a warning, not a failure.
        decode_start = pool.submit(
            start_server, [model, *WORKER_ARGS, "--role", "decode", "--kv-peers", f"127.0.0.1:{transfer_port}"],
            tmp, env, READY_S,
        )  # fmt: skip
        servers = [prefill_start.result(), decode_start.result()]
    for server in servers:
        server.key = keys["ops"]
    prefill, decode = servers
    proc, url = start_router(prefill.url, transfer_port, decode.url, keys["router"], os.path.join(tmp, "router.log"))
    name = os.path.basename(model)
    try:
        yield Workers(prefill, decode, url, proc, name, model, transfer_port, keys, tmp)
    finally:
        proc.terminate()
        proc.wait(10)
        for server in servers:
            server.stop()


def through_router(fleet: Workers) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.router}/v1", api_key=fleet.keys["router"], max_retries=0, timeout=60)


def directly(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def flush(server: ServerProcess, key: str) -> None:
    assert httpx.post(f"{server.url}/flush_cache", headers=auth(key), timeout=30).status_code == 200


def answers(client: openai.OpenAI, model: str, prompt: str) -> list[str]:
    """Greedy completion, chat and streamed chat of one prompt."""
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    return [completion.choices[0].text, chat.choices[0].message.content or "", streamed]


def test_split_gives_the_colocated_tokens_and_moves_the_blocks(fleet: Workers) -> None:
    received = settled(fleet.decode, "stoker:kv_transfer_blocks_received_total")
    sent = settled(fleet.prefill, "stoker:kv_transfer_blocks_sent_total")
    split = answers(through_router(fleet), fleet.model, PROMPT)
    # The prompt's 10 full blocks (chat's a few more) crossed once each.
    assert grown(fleet.decode, "stoker:kv_transfer_blocks_received_total", received, 10) >= 10
    assert grown(fleet.prefill, "stoker:kv_transfer_blocks_sent_total", sent, 10) >= 10
    assert metric(fleet.decode, "stoker:kv_transfer_pulls_failed_total") == 0
    # The same requests served whole by the decode worker, computing the prompt itself.
    flush(fleet.decode, fleet.keys["router"])
    assert answers(directly(fleet.decode, fleet.keys["router"]), fleet.model, PROMPT) == split


def test_a_shared_prefix_is_not_sent_again(fleet: Workers) -> None:
    client = through_router(fleet)
    prefix = " ".join(f"shared{i}" for i in range(60))
    client.completions.create(model=fleet.model, prompt=prefix + " first", max_tokens=2, temperature=0)
    skipped = settled(fleet.decode, "stoker:kv_transfer_blocks_skipped_total")
    received = settled(fleet.decode, "stoker:kv_transfer_blocks_received_total")
    client.completions.create(model=fleet.model, prompt=prefix + " second one", max_tokens=2, temperature=0)
    # Its first 9 blocks or more were the decode worker's already: not asked for; at most its tail crossed.
    assert grown(fleet.decode, "stoker:kv_transfer_blocks_skipped_total", skipped, 9) >= 9
    assert settled(fleet.decode, "stoker:kv_transfer_blocks_received_total") - received <= 2


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_key_without_the_router_scope_cannot_pair_workers(fleet: Workers, role: str) -> None:
    server = fleet.prefill if role == "prefill" else fleet.decode
    body = {"prompt": "hi", "max_tokens": 2, "bootstrap_host": "127.0.0.1", "bootstrap_port": fleet.transfer_port,
            "bootstrap_room": 12345}  # fmt: skip
    refused = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(fleet.keys["client"]), timeout=30)
    assert refused.status_code == 403, refused.text
    assert "'router' scope" in refused.json()["error"]["message"]
    # The same key without the fields is served whole.
    del body["bootstrap_room"]
    served = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(fleet.keys["client"]), timeout=30)
    assert served.status_code == 200, served.text


def idle(server: ServerProcess) -> bool:
    stats = engine_stats(server)
    return stats["kv_blocks_used"] == 0 and stats["kv_transfer_rooms_parked"] == 0 and stats["num_running"] == 0


def wait_idle(fleet: Workers, within: float) -> None:
    deadline = time.monotonic() + within
    while not (idle(fleet.prefill) and idle(fleet.decode)):
        assert time.monotonic() < deadline, (engine_stats(fleet.prefill), engine_stats(fleet.decode))
        time.sleep(0.2)


def test_a_client_leaving_mid_stream_leaves_no_blocks_held(fleet: Workers) -> None:
    body = {"model": fleet.model, "prompt": PROMPT + " leave", "max_tokens": 300, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream(
        "POST", f"{fleet.router}/v1/completions", json=body, headers=auth(fleet.keys["router"]), timeout=60
    ) as stream:
        assert stream.status_code == 200
        assert next(line for line in stream.iter_lines() if line.startswith("data:"))
    # The router closes both workers' connections; each engine aborts what is left and frees it.
    wait_idle(fleet, 10)
    # A decode half whose prefill half never came waits for its blocks (up to --kv-transfer-timeout,
    # 30 s); its client leaving meanwhile ends the wait and frees what it held, long before that.
    fresh = " ".join(f"never{i}" for i in range(60))  # no block of it is on the decode worker
    paired = {**body, "prompt": fresh, "bootstrap_host": "127.0.0.1",
              "bootstrap_port": fleet.transfer_port, "bootstrap_room": 99}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{fleet.decode.url}/v1/completions", json=paired, headers=auth(fleet.keys["router"]), timeout=1.0)
    wait_idle(fleet, 5)


def test_a_decode_worker_of_another_kv_dtype_is_refused_at_start(fleet: Workers) -> None:
    port = free_port()
    command = [sys.executable, "-m", "stoker.cli", "serve", fleet.model_path, *WORKER_ARGS, "--port", str(port),
               "--role", "decode", "--kv-cache-dtype", "int8", "--kv-peers", f"127.0.0.1:{fleet.transfer_port}"]  # fmt: skip
    env = {
        **os.environ,
        "STOKER_DB": os.path.join(fleet.tmp, "other.db"),
        "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO]),
    }
    done = subprocess.run(command, capture_output=True, text=True, timeout=110, env=env, cwd=REPO)
    assert done.returncode == 1, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("stoker serve:")]
    assert len(lines) == 1, done.stderr[-2000:]
    assert f"prefill worker 127.0.0.1:{fleet.transfer_port}" in lines[0] and "int8" in lines[0], lines


def test_kill_9_of_the_prefill_worker_while_its_blocks_are_awaited(fleet: Workers) -> None:
    """Last: it ends the prefill worker. A decode worker given a room the prefill worker has not
    seen waits for its blocks; the prefill worker dies meanwhile: the request is computed here."""
    reference = directly(fleet.decode, fleet.keys["router"]).completions.create(
        model=fleet.model, prompt=PROMPT + " killed", max_tokens=8, temperature=0
    )
    flush(fleet.decode, fleet.keys["router"])
    body = {"model": fleet.model, "prompt": PROMPT + " killed", "max_tokens": 8, "temperature": 0,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": fleet.transfer_port, "bootstrap_room": 2**63 + 7}  # fmt: skip
    answer: dict[str, httpx.Response] = {}

    def send() -> None:
        answer["r"] = httpx.post(
            f"{fleet.decode.url}/v1/completions", json=body, headers=auth(fleet.keys["router"]), timeout=60
        )

    sender = threading.Thread(target=send)
    started = time.monotonic()
    sender.start()
    time.sleep(1.0)  # the pull is waiting on the prefill worker for a room it never got
    assert sender.is_alive(), "the decode worker did not wait for the prefill worker's blocks"
    fleet.prefill.proc.send_signal(signal.SIGKILL)
    sender.join(60)
    assert not sender.is_alive(), "the decode worker hung on a dead prefill worker"
    done = answer["r"]
    assert done.status_code == 200, done.text
    assert done.json()["choices"][0]["text"] == reference.choices[0].text
    assert time.monotonic() - started < 30
    # Through the router the prefill half now fails: an error status, soon.
    routed = httpx.post(
        f"{fleet.router}/v1/completions",
        json={"model": fleet.model, "prompt": "after", "max_tokens": 2},
        headers=auth(fleet.keys["router"]),
        timeout=60,
    )
    assert routed.status_code >= 500
    # The decode worker serves the next request as any server would.
    after = directly(fleet.decode, fleet.keys["client"]).completions.create(
        model=fleet.model, prompt="after", max_tokens=2
    )
    assert after.choices[0].text is not None and after.usage is not None and after.usage.completion_tokens == 2
    assert idle(fleet.decode)
