"""Disaggregated serving on the server side (stoker/server/kv_roles.py): the
bootstrap fields sglang-router's PD mode adds, the --role and --kv-peers flags,
what a request becomes on a prefill and on a decode worker and who may send
the fields, and the prefill half charging nothing (stoker/control/gate.py).
The end to end run behind the real router is tests/integration/test_pd_router.py."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from conftest import FAKE_CORE, ServerProcess, auth, free_port, start_server
from pydantic import ValidationError

from stoker.config import EngineConfig
from stoker.control.admission import AdmissionController
from stoker.control.db import open_db
from stoker.control.gate import RequestGate
from stoker.control.keys import KeyStore
from stoker.control.ledger import UsageLedger
from stoker.control.limits import RateLimiter
from stoker.engine.params import KVTransferParams, RequestTimes, SamplingParams
from stoker.errors import APIError
from stoker.server import cli
from stoker.server.config import ServerConfig, parse_peers
from stoker.server.hooks import FinishedRecord
from stoker.server.kv_roles import check_peers, split_request
from stoker.server.protocol import ChatCompletionRequest, CompletionRequest
from stoker.server.serving.job import Job

CHAT = [{"role": "user", "content": "hi"}]
ROOM = 2**64 - 1


# ---- the body fields ----------------------------------------------------------


def test_bootstrap_fields_as_sglang_router_sends_them() -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": CHAT, "bootstrap_host": "10.0.0.5", "bootstrap_port": 8998, "bootstrap_room": ROOM}
    )
    assert (body.bootstrap_host, body.bootstrap_port, body.bootstrap_room) == ("10.0.0.5", 8998, ROOM)
    # A --prefill URL without a bootstrap port: the router sends null.
    completion = CompletionRequest.model_validate({"prompt": "x", "bootstrap_host": "h", "bootstrap_port": None})
    assert completion.bootstrap_port is None and completion.bootstrap_room is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"bootstrap_room": [1, 2]}, "a list of rooms (SGLang's batched /generate) is not supported"),
        ({"bootstrap_room": 2**64}, "less than or equal to 18446744073709551615"),
        ({"bootstrap_room": -1}, "greater than or equal to 0"),
        ({"bootstrap_room": "7"}, "valid integer"),
        ({"bootstrap_port": 0}, "greater than or equal to 1"),
        ({"bootstrap_port": 65536}, "less than or equal to 65535"),
        ({"bootstrap_host": "h" * 254}, "at most 253 characters"),
        ({"bootstrap_host": ""}, "at least 1 character"),
    ],
)
def test_bad_bootstrap_fields_are_refused(fields: dict[str, Any], message: str) -> None:
    for model, body in ((ChatCompletionRequest, {"messages": CHAT}), (CompletionRequest, {"prompt": "x"})):
        with pytest.raises(ValidationError, match=re.escape(message)):
            model.model_validate({**body, **fields})


# ---- flags --------------------------------------------------------------------


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_role_flag_and_its_sources(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    assert cli.resolve_configs(serve_args())[0].kv_role == "both"
    assert cli.resolve_configs(serve_args("--role", "prefill"))[0].kv_role == "prefill"
    assert cli.resolve_configs(serve_args("--kv-role", "decode"))[0].kv_role == "decode"
    monkeypatch.setenv("STOKER_KV_ROLE", "decode")
    assert cli.resolve_configs(serve_args())[0].kv_role == "decode"
    monkeypatch.delenv("STOKER_KV_ROLE")
    config = tmp_path / "stoker.yaml"
    config.write_text("kv_role: prefill\nkv_transfer_port: 9100\nkv_peers: [10.0.0.5:8998]\n")
    engine, server = cli.resolve_configs(serve_args("--config", str(config)))
    assert (engine.kv_role, engine.kv_transfer_port, server.kv_peers) == ("prefill", 9100, ["10.0.0.5:8998"])
    with pytest.raises(SystemExit):
        serve_args("--role", "router")


def test_kv_peers_forms_and_bounds() -> None:
    assert ServerConfig(kv_peers=["a:1,b:2", "[::1]:8998"]).kv_peers == ["a:1", "b:2", "[::1]:8998"]
    assert ServerConfig(kv_peers="a:1 b:2").kv_peers == ["a:1", "b:2"]  # STOKER_KV_PEERS
    assert parse_peers(["[::1]:8998"]) == [("::1", 8998)]
    for bad in ("a", "a:0", ":80", "a:http", "a:70000"):
        with pytest.raises(ValidationError, match="is not HOST:PORT"):
            ServerConfig(kv_peers=[bad])
    with pytest.raises(ValidationError, match="65 peers; at most 64"):
        ServerConfig(kv_peers=[f"h{i}:1" for i in range(65)])


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--kv-peers", "a:1"], "stoker serve: --kv-peers names the prefill workers a decode worker pulls from"),
        (["--role", "decode", "--kv-peers", "a:0"], "stoker serve: --kv-peers: 'a:0' is not HOST:PORT"),
        (["--role", "prefill", "--kv-transfer-port", "70000"], "stoker serve: --kv-transfer-port: Input should be"),
        (["--role", "decode", "--kv-transfer-timeout", "0"], "stoker serve: --kv-transfer-timeout: Input should be"),
    ],
)
def test_bad_settings_stop_the_start_in_one_line(argv: list[str], line: str, capsys: pytest.CaptureFixture) -> None:
    assert cli.run(serve_args(*argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err


# ---- what a request becomes ----------------------------------------------------


class Plane:
    def __init__(self, keys: bool) -> None:
        self.keys = keys

    def auth_enabled(self) -> bool:
        return self.keys


def http_request(key: Any = None, keys: bool = True) -> Any:
    """What split_request reads of a request: the control plane, and the key authentication found."""
    return SimpleNamespace(
        app=SimpleNamespace(state=SimpleNamespace(control=Plane(keys))), state=SimpleNamespace(api_key=key)
    )


def scoped(*scopes: str) -> Any:
    return SimpleNamespace(has_scope=lambda scope: scope in scopes)


def job(prompts: int = 1) -> Job:
    return Job("chat", "m", [[1, 2, 3]] * prompts, SamplingParams(max_tokens=50, min_tokens=5), [None] * prompts)


def body(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


PAIRED = {"bootstrap_host": "10.0.0.5", "bootstrap_port": 9000, "bootstrap_room": 42}
ROUTER = scoped("inference", "router")


def test_prefill_half_runs_the_prompt_for_one_token_and_charges_nothing() -> None:
    split = job()
    split_request(http_request(ROUTER), body(**PAIRED), split, EngineConfig(kv_role="prefill"), [])
    assert split.kv_transfer == KVTransferParams(room=42, send=True)
    assert (split.params.max_tokens, split.params.min_tokens, split.charged) == (1, 1, False)


def test_decode_half_pulls_from_the_named_worker() -> None:
    split = job()
    split_request(http_request(ROUTER), body(**PAIRED), split, EngineConfig(kv_role="decode"), [])
    assert split.kv_transfer == KVTransferParams(room=42, send=False, peer_host="10.0.0.5", peer_port=9000)
    assert (split.params.max_tokens, split.charged) == (50, True)
    # bootstrap_port null (--prefill URL without a port): this worker's --kv-transfer-port.
    split = job()
    no_port = body(**{**PAIRED, "bootstrap_port": None})
    split_request(http_request(ROUTER), no_port, split, EngineConfig(kv_role="decode", kv_transfer_port=9100), [])
    assert split.kv_transfer is not None and split.kv_transfer.peer_port == 9100


def test_role_both_and_requests_without_a_room_are_served_whole() -> None:
    for role, fields in (("both", PAIRED), ("prefill", {}), ("decode", {"bootstrap_host": "h"})):
        whole = job()
        # Even a key without the router scope: the fields are not used.
        split_request(http_request(scoped("inference")), body(**fields), whole, EngineConfig(kv_role=role), [])
        assert (whole.kv_transfer, whole.params.max_tokens, whole.charged) == (None, 50, True)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_only_a_router_key_may_pair_workers(role: str) -> None:
    with pytest.raises(APIError) as refused:
        split_request(http_request(scoped("inference")), body(**PAIRED), job(), EngineConfig(kv_role=role), [])
    assert refused.value.status == 403 and "'router' scope" in refused.value.message
    # Open mode (no key exists): nobody to ask for a scope.
    split_request(http_request(None, keys=False), body(**PAIRED), job(), EngineConfig(kv_role=role), [])


def test_kv_peers_bound_where_a_decode_worker_connects() -> None:
    decode = EngineConfig(kv_role="decode", kv_transfer_port=9000)
    allowed = ["10.0.0.5:9000"]
    for key, keys in ((ROUTER, True), (None, False)):  # with keys and in open mode alike
        split_request(http_request(key, keys), body(**PAIRED), job(), decode, allowed)
        split_request(http_request(key, keys), body(**{**PAIRED, "bootstrap_port": None}), job(), decode, allowed)
        with pytest.raises(APIError) as refused:
            split_request(http_request(key, keys), body(**{**PAIRED, "bootstrap_host": "evil"}), job(), decode, allowed)
        assert refused.value.status == 403 and "evil:9000 is not one of this decode worker's --kv-peers" in str(
            refused.value.message
        )


def test_a_room_pairs_one_prompt() -> None:
    with pytest.raises(APIError) as refused:
        split_request(http_request(ROUTER), body(**PAIRED), job(prompts=2), EngineConfig(kv_role="prefill"), [])
    assert refused.value.status == 400 and refused.value.param == "bootstrap_room"
    with pytest.raises(APIError) as refused:
        no_host = body(bootstrap_room=1)
        split_request(http_request(ROUTER), no_host, job(), EngineConfig(kv_role="decode"), [])
    assert refused.value.status == 400 and refused.value.param == "bootstrap_host"


# ---- charged once ----------------------------------------------------------------


async def test_prefill_half_is_refunded_and_leaves_no_usage_row(tmp_path) -> None:
    engine = open_db(str(tmp_path / "g.db"))
    keys, ledger = KeyStore(engine), UsageLedger(engine)
    gate = RequestGate(RateLimiter(), AdmissionController(max_queued_requests=10), ledger)
    key, _ = keys.create("router", scopes=["inference", "router"], rpm=10, tpm=1000, budget_tokens=100)
    ran = [RequestTimes(arrival=1.0, scheduled=1.0, first_token=2.0, finished=2.0)]
    for charged in (False, True):
        adm = await gate.admit(request_id=f"r{charged}", key=key, model="m", prompt_tokens=30, max_tokens=20)
        record = FinishedRecord(
            request_id=adm.request_id,
            endpoint="completion",
            model="m",
            status=200,
            prompt_tokens=30,
            completion_tokens=1 if not charged else 20,
            times=ran,
            charged=charged,
        )
        gate.finish(adm, record)
        ledger.flush()
        used = ledger.summary(key.id)
        headers = gate.limiter.headers(key)
        if not charged:  # as if it never came: the decode worker's half pays for both
            assert used["requests"] == 0 and used["total_tokens"] == 0
            assert headers["x-ratelimit-remaining-tokens"] == "1000"
            assert headers["x-ratelimit-remaining-requests"] == "10"
    assert used["requests"] == 1 and used["total_tokens"] == 50
    assert headers["x-ratelimit-remaining-tokens"] == "950"


# ---- a prefill worker over HTTP (the fake engine core) ---------------------------


@pytest.fixture(scope="module")
def prefill_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("pd-prefill")
    db = str(tmp / "stoker.db")
    store = KeyStore(open_db(db))
    secrets = {"client": store.create("client")[1], "router": store.create("r", scopes=["inference", "router"])[1]}
    store.engine.dispose()
    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256", "--role", "prefill"],
        str(tmp),
        env={"STOKER_DB": db, "STOKER_FAKE_STEP_S": "0.005"},
    )
    try:
        yield server, secrets
    finally:
        server.stop()


def test_prefill_worker_over_http(prefill_worker: tuple[ServerProcess, dict[str, str]]) -> None:
    server, secrets = prefill_worker
    paired = {"prompt": "hello", "max_tokens": 10, **PAIRED}
    url = f"{server.url}/v1/completions"
    refused = httpx.post(url, json=paired, headers=auth(secrets["client"]), timeout=30)
    assert refused.status_code == 403 and "'router' scope" in refused.json()["error"]["message"]
    half = httpx.post(url, json=paired, headers=auth(secrets["router"]), timeout=30)
    assert half.status_code == 200 and half.json()["usage"]["completion_tokens"] == 1, half.text
    chat = {"messages": CHAT, "max_tokens": 10, "stream": True, **PAIRED}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat, headers=auth(secrets["router"])) as s:
        assert s.status_code == 200 and "[DONE]" in s.read().decode()
    whole = httpx.post(url, json={"prompt": "hello", "max_tokens": 10}, headers=auth(secrets["client"]), timeout=30)
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 10
    rooms = httpx.post(url, json={**paired, "bootstrap_room": [1, 2]}, headers=auth(secrets["router"]), timeout=30)
    assert rooms.status_code == 400 and "a list of rooms" in rooms.text
    info = httpx.get(f"{server.url}/get_server_info", headers=auth(secrets["router"]), timeout=30).json()
    assert info["disaggregation_mode"] == "prefill"


# ---- the start-up check of --kv-peers ------------------------------------------------

LAYOUT = {"model_digest": "sha256:" + "0" * 64, "kv_dtype": "bfloat16", "block_size": 16, "block_bytes": 4096,
          "layout_version": 1}  # fmt: skip


async def test_an_unreachable_peer_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    nobody = free_port()  # nothing listens there
    with caplog.at_level("WARNING", logger="stoker.server"):
        await check_peers([("127.0.0.1", nobody)], [LAYOUT], timeout=2)
    assert f"prefill worker 127.0.0.1:{nobody}" in caplog.text and "computed here until it answers" in caplog.text
    with pytest.raises(ValueError, match="reports no KV layout"):
        await check_peers([("127.0.0.1", nobody)], [], timeout=2)
