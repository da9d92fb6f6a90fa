"""KV events without leaking prompts (issue 34 item 8): an endpoint given as a
port alone binds 127.0.0.1 only; --no-kv-events-include-token-ids publishes
block hashes without the prompt's token ids; an oversized inbound message
(a subscription on the publisher, a request on the replay socket)
disconnects its sender without stalling either socket. The first two run
against a `stoker serve` process on a tiny random-weight model."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import psutil
import pytest
import zmq
from conftest import ServerProcess, free_port, start_server
from tiny_models import make_tiny_hf_model

from stoker.config import EngineConfig
from stoker.engine import kv_events
from stoker.engine.kv_events import KVEventPublisher

pytestmark = pytest.mark.timeout(300)
BS = 4
MAX_INBOUND_BYTES = 4096
"""The documented cap on a message into either socket (docs/routers.md)."""


def _listen_addresses(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    }


def _outside_address() -> str | None:
    """An address of this machine other than loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, int]]:
    tmp = tmp_path_factory.mktemp("kv-events-server")
    folder = make_tiny_hf_model("llama", tmp)
    port = free_port()
    args = ["--model", str(folder), "--dtype", "float32", "--no-embedding-model", "--num-kv-blocks", "64"]
    args += ["--block-size", str(BS), "--max-model-len", "128", "--speculative-method", "none"]
    args += ["--kv-events-endpoint", str(port), "--no-kv-events-include-token-ids"]
    server = start_server(args, str(tmp), ready_timeout=300)
    try:
        yield server, port
    finally:
        server.stop()


def test_a_port_alone_binds_loopback_only(served: tuple[ServerProcess, int]) -> None:
    server, port = served
    assert _listen_addresses(port) == {"127.0.0.1"}, server.log()[-2000:]
    outside = _outside_address()
    if outside is not None:  # nothing listens there: a subscriber from another machine is refused
        with pytest.raises(OSError), socket.create_connection((outside, port), timeout=2):
            pass
    config = EngineConfig.model_validate({"kv_events_endpoint": "tcp://:5557", "kv_events_replay_endpoint": "5558"})
    assert config.kv_events_endpoint == "tcp://127.0.0.1:5557"
    assert config.kv_events_replay_endpoint == "tcp://127.0.0.1:5558"


def test_block_hashes_without_token_ids_when_configured(served: tuple[ServerProcess, int]) -> None:
    server, port = served
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.3)  # the subscription reaches the publisher first
        prompt = list(range(100, 100 + 5 * BS))
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        stored: list[dict[str, Any]] = []
        while sub.poll(3000):
            _topic, _seq, payload = sub.recv_multipart()
            stored += [e for e in msgspec.msgpack.decode(payload)[1] if e["type"] == "BlockStored"]
        assert stored, "no BlockStored event was published"
        assert sum(len(e["block_hashes"]) for e in stored) >= 5
        assert all(e["token_ids"] == [] and "token_ids" in e for e in stored), stored
        assert all(e["block_size"] == BS for e in stored)
    finally:
        sub.close(linger=0)
        ctx.term()


def test_an_oversized_replay_request_is_dropped_and_replay_still_answers() -> None:
    port, replay_port = free_port(), free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", "", f"tcp://127.0.0.1:{replay_port}", buffer_steps=8)
    ctx = zmq.Context()
    sockets: list[zmq.Socket[bytes]] = []

    def dealer() -> zmq.Socket[bytes]:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{replay_port}")
        sockets.append(s)
        return s

    try:
        for i in range(3):
            pub.publish([kv_events.BlockRemoved([i])])
        hostile = dealer()
        started = time.monotonic()
        hostile.send_multipart([b"", b"\x00" * (64 * MAX_INBOUND_BYTES)])
        assert not hostile.poll(1500), "an oversized replay request was read and answered"
        honest = dealer()
        honest.send_multipart([b"", (1).to_bytes(8, "big")])
        got = []
        while True:
            assert honest.poll(5000), "the replay socket stopped answering"
            _, seq, payload = honest.recv_multipart()
            if not payload:
                break
            got.append(int.from_bytes(seq, "big"))
        assert got == [1, 2] and time.monotonic() - started < 10
        assert pub.publish([kv_events.AllBlocksCleared()])
    finally:
        for s in sockets:
            s.close(linger=0)
        ctx.term()
        pub.close()


def test_an_oversized_subscription_is_dropped_and_others_still_receive() -> None:
    """A subscription is 1 byte and a topic prefix: one of 64 KiB disconnects its
    sender (which gets nothing), a well-formed subscriber gets every batch."""
    port = free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}")
    ctx = zmq.Context()
    hostile = ctx.socket(zmq.XSUB)
    honest = ctx.socket(zmq.SUB)
    try:
        for s in (hostile, honest):
            s.setsockopt(zmq.LINGER, 0)
        hostile.connect(f"tcp://127.0.0.1:{port}")
        hostile.send(b"\x01" + b"x" * (16 * MAX_INBOUND_BYTES))
        hostile.send(b"\x01")  # and everything: it would get every batch if the first were read
        honest.setsockopt(zmq.SUBSCRIBE, b"")
        honest.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.5)
        started = time.monotonic()
        sent = [pub.publish([kv_events.BlockRemoved([i])]) for i in range(5)]
        assert all(sent) and time.monotonic() - started < 3  # no send waited on the hostile subscriber
        received = []
        while honest.poll(2000):
            received.append(int.from_bytes(honest.recv_multipart()[1], "big"))
            if len(received) == 5:
                break
        assert received == [0, 1, 2, 3, 4]
        assert not hostile.poll(1000), "a subscriber that sent an oversized subscription still receives"
    finally:
        hostile.close(linger=0)
        honest.close(linger=0)
        ctx.term()
        pub.close()


def test_a_wider_bind_is_logged_as_reachable(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    with caplog.at_level("WARNING", logger="stoker.engine.kv_events"):
        pub = KVEventPublisher(f"tcp://*:{port}")
        pub.close()
        local = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}")
        local.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"tcp://*:{port}" in warnings[0] and "prompt token ids" in warnings[0]
