"""The endpoints routers call on a replica (stoker/server/routes/workers.py),
the fields they add to requests, and their HTTP/2 probe, on `stoker serve`
processes over the fake engine core: the shared open one (sglang load shape)
and one with API keys and the vllm load shape."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from conftest import FAKE_CORE, REPO, TESTS_DIR, ServerProcess, free_port, start_server

from stoker.control.db import open_db
from stoker.control.keys import KeyStore
from stoker.engine.params import EngineStats
from stoker.server.http_protocol import GOAWAY_HTTP_1_1_REQUIRED, HTTP2_PREFACE
from stoker.server.routes.workers import load_tokens

pytestmark = pytest.mark.timeout(120)
CHAT = [{"role": "user", "content": "hi"}]
# What the routers were seen adding to a client's request (docs/routers.md).
SGLANG_ROUTER_CHAT_FIELDS = {
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
VLLM_ROUTER_CHAT_FIELDS = {**SGLANG_ROUTER_CHAT_FIELDS, "include_reasoning": True}
SGLANG_ROUTER_COMPLETION_FIELDS = {
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
# Fields routers or SGLang clients may set to non-default values; accepted and ignored.
OTHER_ROUTER_FIELDS = {
    "rid": "router-request-1",
    "no_stop_trim": True,
    "return_hidden_states": False,
    "bootstrap_room": 7,
}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A replica with API keys (admin, user, router) answering /get_load in vllm-router's shape."""
    tmp = tmp_path_factory.mktemp("workers-keyed")
    db = str(tmp / "stoker.db")
    store = KeyStore(open_db(db))
    secrets = {name: store.create(name, admin=name == "admin")[1] for name in ("admin", "user")}
    secrets["router"] = store.create("router", scopes=["router"])[1]
    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256", "--get-load-format", "vllm"],
        str(tmp),
        env={"STOKER_DB": db, "STOKER_FAKE_STEP_S": "0.005"},
    )
    try:
        yield server, secrets
    finally:
        server.stop()


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_load_counts_kv_in_use_and_waiting_prompt_tokens() -> None:
    stats = EngineStats(kv_blocks_used=3, block_size=16, num_waiting_tokens=5)
    assert load_tokens(stats) == 53
    assert load_tokens(EngineStats()) == 0


def test_get_load_in_sglang_shape_follows_the_engine(fake_server) -> None:
    with httpx.Client(base_url=fake_server.url, timeout=30) as http:
        idle = http.get("/get_load")
        assert idle.status_code == 200
        (entry,) = idle.json()
        assert entry["dp_rank"] == 0 and isinstance(entry["num_tokens"], int)
        # A 2-second stream (50 tokens/s) holds KV blocks while it runs.
        with http.stream(
            "POST", "/v1/completions", json={"prompt": "x" * 40, "max_tokens": 100, "stream": True}
        ) as stream:
            assert stream.status_code == 200
            deadline = time.monotonic() + 5
            busy = 0
            while busy == 0 and time.monotonic() < deadline:
                busy = http.get("/get_load").json()[0]["num_tokens"]
                time.sleep(0.05)
            assert busy >= 40, "the load never showed the running request"
            assert http.get("/get_load").json()[0]["num_reqs"] >= 1


def test_get_load_in_vllm_shape_takes_a_router_key(keyed) -> None:
    server, secrets = keyed
    assert httpx.get(f"{server.url}/get_load", timeout=10).status_code == 401
    response = httpx.get(f"{server.url}/get_load", headers=bearer(secrets["router"]), timeout=10)
    assert response.status_code == 200
    assert response.json() == {"load": 0}


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info", "/server_info", "/get_server_info"])
def test_model_and_server_info_name_local_model_and_tokenizer(fake_server, path: str) -> None:
    body = httpx.get(f"{fake_server.url}{path}", timeout=10).json()
    assert body["served_model_name"] == "fake-model"
    assert os.path.isabs(body["model_path"]) and os.path.exists(body["model_path"])
    assert body["tokenizer_path"] and os.path.isabs(body["tokenizer_path"])
    assert body["is_generation"] is True
    assert body["max_model_len"] == 256
    if "server" in path:
        assert body["max_total_num_tokens"] > 0
        assert body["page_size"] == 16
        assert body["get_load_format"] == "sglang"
        assert body["engine_config"]["max_model_len"] == 256


def test_render_gives_the_token_ids_a_request_would_be_served_with(fake_server) -> None:
    """vLLM's render endpoints, which vllm-router's kv_aware policy asks for a request's tokens."""
    with httpx.Client(base_url=fake_server.url, timeout=30) as http:
        chat = http.post("/v1/chat/completions/render", json={"messages": CHAT, **VLLM_ROUTER_CHAT_FIELDS})
        assert chat.status_code == 200, chat.text
        templated = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": True}).json()
        assert chat.json()["token_ids"] == templated["tokens"]
        assert chat.json()["model"] == "fake-model"
        done = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
        assert done["usage"]["prompt_tokens"] == len(templated["tokens"])
        texts = http.post("/v1/completions/render", json={"prompt": ["one two", "three"], "max_tokens": 4})
        assert texts.status_code == 200, texts.text
        encoded = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in ("one two", "three")]
        assert [entry["token_ids"] for entry in texts.json()] == encoded
        assert http.post("/v1/completions/render", json={"prompt": [[5, 6, 7]]}).json()[0]["token_ids"] == [5, 6, 7]
        # ids the model has not: refused as /v1/completions refuses them, not rendered
        outside = http.post("/v1/completions/render", json={"prompt": [[5, 10**6]]})
        assert outside.status_code == 400 and outside.json()["error"]["param"] == "prompt", outside.text
        # and a body serving would refuse is refused here too
        unservable = http.post("/v1/completions/render", json={"prompt": "x", "min_tokens": 20, "max_tokens": 4})
        assert unservable.status_code == 400 and unservable.json()["error"]["param"] == "min_tokens", unservable.text
        untemplated = http.post("/tokenize", json={"messages": [{"role": "tool"}]})
        assert untemplated.status_code == 400, untemplated.text


def test_flush_cache_drops_the_unused_prefix_blocks_once(keyed) -> None:
    server, secrets = keyed
    with httpx.Client(base_url=server.url, timeout=30, headers=bearer(secrets["router"])) as http:
        done = http.post("/v1/completions", json={"prompt": "y" * 40, "max_tokens": 2}, headers=bearer(secrets["user"]))
        assert done.status_code == 200
        first = http.post("/flush_cache")
        assert first.status_code == 200, first.text
        assert first.json()["flushed"] is True
        assert first.json()["num_blocks"] >= 2  # the 40-token prompt's two full blocks
        assert http.post("/flush_cache").json()["num_blocks"] == 0


def test_flush_cache_takes_a_router_or_admin_key_and_is_shut_in_open_mode(keyed, fake_server) -> None:
    server, secrets = keyed
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/flush_cache").status_code == 401
        refused = http.post("/flush_cache", headers=bearer(secrets["user"]))
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "insufficient_permissions"
        assert http.post("/flush_cache", headers=bearer(secrets["router"])).status_code == 200
        assert http.post("/flush_cache", headers=bearer(secrets["admin"])).status_code == 200
        # Identity takes the router scope too; the probes do not.
        assert http.get("/server_info").status_code == 401
        assert http.get("/server_info", headers=bearer(secrets["router"])).status_code == 200
        assert http.get("/ready").status_code == 200
    open_mode = httpx.post(f"{fake_server.url}/flush_cache", timeout=30)  # no key exists: no operator action
    assert open_mode.status_code == 403 and "stoker keys create" in open_mode.text


@pytest.mark.parametrize("extra", [SGLANG_ROUTER_CHAT_FIELDS, VLLM_ROUTER_CHAT_FIELDS, OTHER_ROUTER_FIELDS])
def test_router_added_chat_fields_are_accepted(fake_server, extra: dict) -> None:
    response = httpx.post(
        f"{fake_server.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, **extra}, timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("extra", [SGLANG_ROUTER_COMPLETION_FIELDS, OTHER_ROUTER_FIELDS])
def test_router_added_completion_fields_are_accepted(fake_server, extra: dict) -> None:
    response = httpx.post(
        f"{fake_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, **extra}, timeout=30
    )
    assert response.status_code == 200, response.text


def test_max_completion_tokens_is_honoured(fake_server) -> None:
    # sglang-router rewrites a chat request's max_tokens into max_completion_tokens.
    body = {"messages": CHAT, "max_completion_tokens": 4, **SGLANG_ROUTER_CHAT_FIELDS}
    response = httpx.post(f"{fake_server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert response.json()["choices"][0]["finish_reason"] == "length"


def _send_raw(port: int, *chunks: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for chunk in chunks:
            sock.sendall(chunk)
            time.sleep(0.05)
        received = b""
        while True:
            data = sock.recv(4096)
            if not data:
                return received
            received += data


def test_http2_preface_gets_goaway_and_no_warning(fake_server) -> None:
    before = fake_server.log()
    # Whole, and split inside the preface: both are refused the same way.
    assert _send_raw(fake_server.port, HTTP2_PREFACE) == GOAWAY_HTTP_1_1_REQUIRED
    assert _send_raw(fake_server.port, HTTP2_PREFACE[:7], HTTP2_PREFACE[7:]) == GOAWAY_HTTP_1_1_REQUIRED
    # HTTP/1.1 on the same port is untouched, including a request split at any byte.
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    assert _send_raw(fake_server.port, request[:2], request[2:]).startswith(b"HTTP/1.1 200 OK")
    assert httpx.get(f"{fake_server.url}/health", timeout=5).status_code == 200
    new_log = fake_server.log()[len(before) :]
    assert "Invalid HTTP request" not in new_log
    assert "WARNING" not in new_log


def test_identity_is_answered_while_the_model_loads(tmp_path) -> None:
    """sglang-router registers a worker as soon as /health answers and keeps the
    labels it read then: /server_info must name the model before it is loaded."""
    port = free_port()
    admin = bearer(KeyStore(open_db(str(tmp_path / "stoker.db"))).create("admin", admin=True)[1])
    env = {
        **os.environ,
        "STOKER_DB": str(tmp_path / "stoker.db"),
        "STOKER_FAKE_LOAD_S": "4",
        "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO]),
    }
    args = ["--engine-core", "server_fakes:SlowLoadingEngineCore", "--no-embedding-model", "--max-model-len", "256",
            "--served-model-name", "fake-model", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "stoker.cli", "serve", *args], stdout=log, stderr=log, env=env)
    server = ServerProcess(proc, port, str(tmp_path / "server.log"))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                ready = httpx.get(f"{server.url}/ready", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None, server.log()[-2000:]
                time.sleep(0.1)
        assert ready.status_code == 503  # still loading
        info = httpx.get(f"{server.url}/server_info", headers=admin, timeout=10)
        assert info.status_code == 200, info.text
        assert info.json()["served_model_name"] == "fake-model"
        assert info.json()["loaded"] is False and info.json()["max_model_len"] is None
        assert os.path.isabs(info.json()["model_path"])
        assert httpx.get(f"{server.url}/get_load", headers=admin, timeout=10).status_code == 200
        assert httpx.post(f"{server.url}/flush_cache", headers=admin, timeout=10).status_code == 503
        server.wait_ready(60)
        loaded = httpx.get(f"{server.url}/model_info", headers=admin, timeout=10).json()
        assert loaded["served_model_name"] == "fake-model" and loaded["loaded"] is True
        assert loaded["max_model_len"] == 256
    finally:
        server.stop()
