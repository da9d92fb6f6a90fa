"""KV cache events (stoker/engine/kv_events.py): an engine on a tiny random-weight
model publishes on a real ZeroMQ socket, and a SUB socket decodes the messages
generically (plain msgpack, no stoker structs) in the shape vllm-router reads:
[topic, 8-byte big-endian seq, [ts, [ {type: ..., field: ...}, ...], rank]].
Stored blocks carry their tokens and chain by parent hash; evicted blocks are
removed; a flush of an idle engine clears everything."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from conftest import free_port
from pydantic import ValidationError
from tiny_models import make_tiny_hf_model

from stoker.config import EngineConfig
from stoker.engine import kv_events
from stoker.engine.core import EngineCore
from stoker.engine.kv_cache import chain_hash
from stoker.engine.kv_events import KVEventLog, KVEventPublisher, wire_hash
from stoker.engine.params import EngineCoreRequest, SamplingParams
from stoker.server.config import ServerConfig
from stoker.server.fleet import FleetError, plan_fleet
from stoker.zmq_address import check_endpoint

BS = 4
TOPIC = "kv@test"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("kv-events"))


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sock.connect(endpoint)
        self.seqs: list[int] = []
        time.sleep(0.3)  # let the subscription reach the publisher before anything is sent

    def events(self, timeout: float = 2.0) -> list[dict[str, Any]]:
        """Every event published so far, in order, checking each message's frames."""
        out: list[dict[str, Any]] = []
        while self.sock.poll(int(timeout * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == TOPIC.encode()
            assert len(seq) == 8
            self.seqs.append(int.from_bytes(seq, "big"))
            batch = msgspec.msgpack.decode(payload)
            assert isinstance(batch, list) and len(batch) == 3, batch
            ts, events, rank = batch
            assert isinstance(ts, float) and abs(ts - time.time()) < 60
            assert rank == 0
            out.extend(events)
            timeout = 0.2  # the rest of what is queued
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def engine(tiny: Path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = EngineConfig.model_validate(
        {
            "model": str(tiny),
            "dtype": "float32",
            "num_kv_blocks": 12,  # 11 usable: a second long prompt evicts the first one's blocks
            "block_size": BS,
            "max_model_len": 64,
            "speculative_method": "none",
            "kv_events_endpoint": endpoint,
            "kv_events_topic": TOPIC,
        }
    )
    core = EngineCore(config)
    sub = Subscriber(endpoint)
    try:
        yield core, sub
    finally:
        sub.close()
        assert core.kv_events is not None
        core.kv_events.close()


def run(core: EngineCore, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(EngineCoreRequest(rid, prompt, params, time.time()))
    generated: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step():
            generated.extend(out.new_token_ids)
    return generated


def stored_chain(events: list[dict[str, Any]]) -> tuple[list[int], list[int], list[int | None]]:
    """All BlockStored events' hashes and tokens in order, and each event's parent."""
    hashes: list[int] = []
    tokens: list[int] = []
    parents: list[int | None] = []
    for e in events:
        if e["type"] == "BlockStored":
            assert e["block_size"] == BS and e["medium"] == "GPU"
            assert {"lora_id", "lora_name"} <= e.keys()  # the router refuses an event without them
            assert len(e["token_ids"]) == BS * len(e["block_hashes"])
            hashes += e["block_hashes"]
            tokens += e["token_ids"]
            parents.append(e["parent_block_hash"])
    return hashes, tokens, parents


def expected_hashes(tokens: list[int]) -> list[int]:
    out, parent = [], None
    for i in range(len(tokens) // BS):
        parent = chain_hash(parent, tuple(tokens[i * BS : (i + 1) * BS]))
        out.append(wire_hash(parent))
    return out


def test_stored_blocks_carry_tokens_and_chain_by_parent(engine) -> None:
    core, sub = engine
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks at prefill
    generated = run(core, "a", prompt, 3)
    events = sub.events()
    assert events[0] == {"type": "AllBlocksCleared"}  # a fresh engine says its cache is empty
    hashes, tokens, parents = stored_chain(events)
    sequence = prompt + generated
    # The prompt's 2 blocks, then the third as decoding fills it (KV written for 12 tokens of 13).
    assert tokens == sequence[:12]
    assert hashes == expected_hashes(sequence[:12])
    # One event per step: the prompt's blocks from the root, the decoded block under the prompt's last.
    assert parents == [None, hashes[1]]
    assert sub.seqs == list(range(len(sub.seqs)))

    # The same prompt again: its blocks are hits, nothing new is stored for them.
    run(core, "b", prompt, 1)
    assert all(e["type"] != "BlockStored" or e["parent_block_hash"] is not None for e in sub.events(0.5))


def test_evicted_blocks_are_removed_and_a_flush_clears(engine) -> None:
    core, sub = engine
    run(core, "a", list(range(200, 212)), 1)  # 3 full prompt blocks, cached once freed
    first, _, _ = stored_chain(sub.events())
    assert len(first) == 3
    # 43 prompt tokens take all 11 blocks: every cached block of "a" is reused.
    run(core, "b", list(range(300, 343)), 1)
    events = sub.events()
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert sorted(removed) == sorted(first)
    assert all(e["medium"] == "GPU" for e in events if e["type"] == "BlockRemoved")
    second, _, _ = stored_chain(events)
    assert second == expected_hashes(list(range(300, 343)))  # its 10 full blocks

    # A flush with nothing running empties the cache: one AllBlocksCleared, not a removal per block.
    assert core.reset_prefix_cache() == 10
    assert sub.events() == [{"type": "AllBlocksCleared"}]
    assert sub.seqs == list(range(len(sub.seqs)))
    assert core.stats().kv_events_published == len(sub.seqs)
    assert core.stats().kv_events_dropped == 0


def test_log_merges_a_chain_and_removals() -> None:
    log = KVEventLog(BS)
    h = [chain_hash(None, (1, 2, 3, 4))]
    h.append(chain_hash(h[0], (5, 6, 7, 8)))
    log.stored(h[0], None, (1, 2, 3, 4))
    log.stored(h[1], h[0], (5, 6, 7, 8))
    log.stored(h[0], None, (1, 2, 3, 4))  # a new root starts a new event
    log.removed(h[0])
    log.removed(h[1])
    events = log.take()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored", "BlockRemoved"]
    assert events[0].block_hashes == [wire_hash(h[0]), wire_hash(h[1])]
    assert events[0].token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert events[2].block_hashes == [wire_hash(h[0]), wire_hash(h[1])]
    assert log.take() == []
    assert all(0 <= wire_hash(x) < 2**64 for x in h)


def test_a_full_queue_drops_and_counts_instead_of_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_events, "SEND_HWM", 2)
    pub = KVEventPublisher("inproc://kv-events-drop", TOPIC)
    ctx = pub._ctx  # inproc needs the publisher's context
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 2)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect("inproc://kv-events-drop")
    time.sleep(0.1)
    try:
        started = time.monotonic()
        results = [pub.publish([kv_events.AllBlocksCleared()]) for _ in range(200)]  # nobody reads
        assert time.monotonic() - started < 5
        assert pub.num_dropped == results.count(False) > 0
        assert pub.num_published == results.count(True) > 0
        assert pub.seq == 200
    finally:
        sub.close(linger=0)
        pub.close()


@pytest.mark.parametrize("client_type", [zmq.REQ, zmq.DEALER], ids=["req", "dealer"])
def test_replay_sends_the_held_batches_from_the_asked_number(client_type: int) -> None:
    """vLLM's replay protocol: 8-byte start, then [seq, payload] per held batch, then [-1, b""].
    Only the latest buffer_steps are held; an ill-formed request gets the end marker alone."""
    port, replay_port = free_port(), free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", TOPIC, f"tcp://127.0.0.1:{replay_port}", buffer_steps=3)
    client = pub._ctx.socket(client_type)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"tcp://127.0.0.1:{replay_port}")
    decoder = msgspec.msgpack.Decoder()

    def replay(request: bytes) -> list[tuple[int, Any]]:
        client.send_multipart([b"", request] if client_type == zmq.DEALER else [request])
        got = []
        while True:
            assert client.poll(5000), "no reply from the replay socket"
            frames = client.recv_multipart()
            seq, payload = frames[-2:]
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1
                return got
            got.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
            if client_type == zmq.REQ:  # a REQ socket takes one reply per request
                return got

    try:
        for i in range(5):
            pub.publish([kv_events.BlockRemoved([i])])
        if client_type == zmq.DEALER:
            got = replay((3).to_bytes(8, "big"))
            assert [seq for seq, _ in got] == [3, 4]
            assert got[0][1][1][0]["block_hashes"] == [3]
            assert [seq for seq, _ in replay((0).to_bytes(8, "big"))] == [2, 3, 4]  # only 3 held
            assert replay((9).to_bytes(8, "big")) == []
            assert replay(b"junk") == []
        else:
            assert [seq for seq, _ in replay((4).to_bytes(8, "big"))] == [4]
        assert pub.num_replays >= 1
    finally:
        client.close(linger=0)
        pub.close()


def test_replay_needs_the_publisher_and_its_own_address() -> None:
    with pytest.raises(ValidationError, match="needs kv_events_endpoint"):
        EngineConfig.model_validate({"kv_events_replay_endpoint": "tcp://*:5558"})
    with pytest.raises(ValidationError, match="must differ"):
        EngineConfig.model_validate({"kv_events_endpoint": "tcp://*:5557", "kv_events_replay_endpoint": "tcp://*:5557"})
    with pytest.raises(ValidationError, match="ZeroMQ address"):
        EngineConfig.model_validate({"kv_events_endpoint": "tcp://*:5557", "kv_events_replay_endpoint": "udp://h:5558"})


def test_disabled_records_nothing(tiny: Path) -> None:
    config = EngineConfig.model_validate(
        {"model": str(tiny), "dtype": "float32", "num_kv_blocks": 12, "block_size": BS, "speculative_method": "none"}
    )
    core = EngineCore(config)
    assert core.kv_events is None and core.kv.pool.events is None
    run(core, "a", list(range(100, 110)), 2)
    assert core.stats().kv_events_published == 0


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://127.0.0.1:1", "tcp://[::1]:5557", "ipc:///tmp/kv"])
def test_endpoints_accepted(endpoint: str) -> None:
    assert check_endpoint(endpoint) == endpoint


@pytest.mark.parametrize("endpoint", ["tcp://*", "tcp://*:0", "tcp://*:70000", "http://h:1", "tcp://a b:1", "0"])
def test_bad_endpoint_is_refused_naming_the_setting(endpoint: str) -> None:
    with pytest.raises(ValidationError, match="kv_events_endpoint"):
        EngineConfig.model_validate({"kv_events_endpoint": endpoint})


def test_endpoint_in_use_fails_in_one_line() -> None:
    port = free_port()
    first = KVEventPublisher(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(ValueError, match=rf"^--kv-events-endpoint tcp://127.0.0.1:{port}: cannot bind"):
            KVEventPublisher(f"tcp://127.0.0.1:{port}")
    finally:
        first.close()


def test_several_models_are_refused_with_one_endpoint(tiny: Path) -> None:
    engine = EngineConfig.model_validate({"model": str(tiny), "kv_events_endpoint": "tcp://*:5557"})
    server = ServerConfig.model_validate({"models": [f"other={tiny}"]})
    with pytest.raises(FleetError, match="run one stoker serve per model"):
        plan_fleet(server, engine)
    assert len(plan_fleet(ServerConfig.model_validate({}), engine)[0]) == 1
