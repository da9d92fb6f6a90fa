"""Prefill and decode apart (issue 40), engine side: a decode engine fed by a
prefill engine over the KV transfer's TCP protocol gives the colocated greedy
tokens for every KV dtype and with a LoRA adapter; blocks the decode side holds
are not sent; every failure (a peer gone mid-stream, an unknown room, a slow
prefill, another layout, a corrupted block) ends in recompute with the same
tokens; aborts and expiry give every block back on both sides.

Two EngineCores in this process on a tiny random-weight Llama: the prefill
engine's step loop runs on a thread of its own (Worker), as in its process,
while the test steps the decode engine."""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

import pytest
from conftest import poll_until
from tiny_loras import ATTENTION, make_peft_adapter
from tiny_models import make_tiny_hf_model

from stoker.config import EngineConfig
from stoker.engine import kv_transfer_server
from stoker.engine.core import EngineCore
from stoker.engine.kv_disk_format import StoredBlock
from stoker.engine.kv_transfer import check_peer, probe_peer
from stoker.engine.kv_transfer_wire import Kind
from stoker.engine.params import EngineCoreRequest, EngineStats, KVTransferParams, LoraCommand, SamplingParams
from stoker.models.kv_quant import KV_FORMATS

BLOCK_SIZE = 4
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPT = [(31 * i + 7) % 500 + 3 for i in range(41)]  # 10 full blocks and one token
KV_DTYPES = ["float32", "bfloat16", "float16", "int8", "fp8_e4m3"]
T = TypeVar("T")
_rooms = iter(range(1, 1 << 30))


def test_every_kv_dtype_is_covered() -> None:
    assert len(KV_DTYPES) == len(KV_FORMATS)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv-transfer")
    base = make_tiny_hf_model("llama", root / "base")
    return {"base": base, "lora": make_peft_adapter(base, root / "lora", rank=4, targets=ATTENTION, seed=3)}


def engine(files: dict[str, Path], role: str, kv_cache_dtype: str = "float32", **overrides: object) -> EngineCore:
    args: dict[str, object] = {
        "model": str(files["base"]),
        "dtype": "float32",
        "kv_cache_dtype": kv_cache_dtype,
        "num_kv_blocks": 64,
        "block_size": BLOCK_SIZE,
        "max_num_batched_tokens": 16,  # the prompt in chunks: blocks are parked while later ones compute
        "speculative_method": "none",
        "kv_role": role,
        "kv_transfer_port": 0,
        "kv_transfer_timeout": 10.0,
        **overrides,
    }
    return EngineCore(EngineConfig.model_validate(args))


class Worker:
    """An engine's step loop on a thread of its own; the test reaches the engine through call()."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._calls: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self.finished: dict[str, threading.Event] = {}
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._calls.get(timeout=0.005)()
            except queue.Empty:
                pass
            if self.core.has_unfinished_requests():
                for delta in self.core.step():
                    if delta.finished:
                        self.finished.setdefault(delta.request_id, threading.Event()).set()
            else:
                self.core.housekeep()

    def call(self, fn: Callable[[], T]) -> T:
        """fn's result, run on the loop's thread between steps."""
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

        self._calls.put(run)
        return future.result(timeout=30)

    def then(self, fn: Callable[[], None]) -> None:
        """fn on the loop's thread, not waiting for it (a stall: the loop steps nothing meanwhile)."""
        self._calls.put(fn)

    def add(self, request: EngineCoreRequest) -> None:
        self.finished.setdefault(request.request_id, threading.Event())
        self.call(lambda: self.core.add_request(request))

    def wait(self, request_id: str) -> None:
        assert self.finished[request_id].wait(30), f"{request_id} never finished"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.core.close()


@pytest.fixture(scope="module")
def shared_prefill(files: dict[str, Path]) -> Iterator[Worker]:
    worker = Worker(engine(files, "prefill"))
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def shared_decode(files: dict[str, Path]) -> Iterator[EngineCore]:
    core = engine(files, "decode")
    yield core
    core.close()


_baselines: dict[int, EngineStats] = {}


@pytest.fixture
def prefill(shared_prefill: Worker) -> Worker:
    """The module's prefill engine, its prefix cache empty and its counters read from here (counted)."""
    shared_prefill.call(shared_prefill.core.reset_prefix_cache)
    _baselines[id(shared_prefill.core)] = shared_prefill.call(shared_prefill.core.stats)
    return shared_prefill


@pytest.fixture
def decode(shared_decode: EngineCore) -> EngineCore:
    """The module's decode engine, its prefix cache empty and its counters read from here (counted)."""
    shared_decode.reset_prefix_cache()
    _baselines[id(shared_decode)] = shared_decode.stats()
    return shared_decode


def counted(core: EngineCore, stats: EngineStats | None = None) -> dict[str, float]:
    """The engine's kv_transfer_* counters since its fixture handed it to this test (all of them for an
    engine of the test's own), without the prefix."""
    now = stats or core.stats()
    before = _baselines.get(id(core), EngineStats())
    return {
        name.removeprefix("kv_transfer_"): getattr(now, name) - getattr(before, name)
        for name in vars(now)
        if name.startswith("kv_transfer_")
    }


def run(core: EngineCore, request: EngineCoreRequest, timeout: float = 30) -> tuple[list[int], int]:
    """Its tokens and cached prompt tokens, stepping `core` alone."""
    core.add_request(request)
    tokens: list[int] = []
    cached = -1
    deadline = time.monotonic() + timeout
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the decode engine hung"
        for delta in core.step():
            tokens += delta.new_token_ids
            cached = max(cached, delta.num_cached_tokens)
    return tokens, cached


def split(
    prefill: Worker,
    decode: EngineCore,
    prompt: list[int] = PROMPT,
    lora: str | None = None,
    room: int | None = None,
    send: bool = True,
) -> tuple[list[int], int]:
    """One request as a PD router sends it: to both at once; the decode side's tokens and cached tokens."""
    room = next(_rooms) if room is None else room
    now = time.time()
    if send:
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        prefill.add(
            EngineCoreRequest(f"p{room}", prompt, one, now, lora_name=lora, kv_transfer=KVTransferParams(room, True))
        )
    port = prefill.core.kv_server.port if prefill.core.kv_server else 0
    pull = KVTransferParams(room, False, "127.0.0.1", port)
    return run(decode, EngineCoreRequest(f"d{room}", prompt, GREEDY, now, lora_name=lora, kv_transfer=pull))


def colocated(core: EngineCore, prompt: list[int] = PROMPT) -> list[int]:
    """Its greedy tokens computed whole on `core` (any role serves a request without a room whole), cold."""
    core.reset_prefix_cache()
    tokens, cached = run(core, EngineCoreRequest(f"c{next(_rooms)}", prompt, GREEDY, time.time()))
    assert cached == 0
    return tokens


def block_bytes(core: EngineCore) -> int:
    assert core.kv_layout is not None
    return core.kv_layout.block_bytes


def settled(worker: Worker, free: int) -> bool:
    """Whether the prefill engine's rooms are all released and `free` blocks are free again (waits a little)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if worker.call(
            lambda: (worker.core.kv_rooms.num_parked if worker.core.kv_rooms else 0, worker.core.kv.pool.num_free)
        ) == (0, free):
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_split_greedy_tokens_are_the_colocated_ones(
    files: dict[str, Path], kv_cache_dtype: str, request: pytest.FixtureRequest
) -> None:
    own = kv_cache_dtype != "float32"  # the module's engines are float32
    prefill: Worker = Worker(engine(files, "prefill", kv_cache_dtype)) if own else request.getfixturevalue("prefill")
    decode: EngineCore = engine(files, "decode", kv_cache_dtype) if own else request.getfixturevalue("decode")
    try:
        tokens, cached = split(prefill, decode)
        assert tokens == colocated(decode)
        assert cached == 40  # every full block but the last token's came from the prefill worker
        received = counted(decode)
        assert (received["blocks_received"], received["pulls"]) == (10, 1)
        assert received["pulls_failed"] == received["pulls_timed_out"] == 0
        sent = counted(prefill.core, prefill.call(prefill.core.stats))
        assert sent["blocks_sent"] == 10
        assert sent["bytes_sent"] == received["bytes_received"] > 10 * block_bytes(decode)
        assert settled(prefill, prefill.core.kv.num_blocks)
        assert decode.kv.pool.num_free == decode.kv.num_blocks
    finally:
        if own:
            prefill.stop()
            decode.close()


def test_split_with_a_lora_adapter(files: dict[str, Path], prefill: Worker, decode: EngineCore) -> None:
    def register(core: EngineCore) -> None:
        core.lora_command(LoraCommand(1, "add", "attn", str(files["lora"])))
        while core.loras_loading():
            core.take_lora_answers()
            time.sleep(0.01)

    prefill.call(lambda: register(prefill.core))
    register(decode)
    tokens, cached = split(prefill, decode, lora="attn")
    decode.reset_prefix_cache()
    want, _ = run(decode, EngineCoreRequest("c", PROMPT, GREEDY, time.time(), lora_name="attn"))
    decode.reset_prefix_cache()
    base, _ = split(prefill, decode)
    assert tokens == want != base
    assert cached == 40
    assert counted(decode)["blocks_received"] == 20  # the base's chain is another: sent in full


def test_the_samples_of_n_share_the_pulled_blocks(prefill: Worker, decode: EngineCore) -> None:
    room = next(_rooms)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefill.add(EngineCoreRequest("p", PROMPT, one, time.time(), kv_transfer=KVTransferParams(room, True)))
    port = prefill.core.kv_server.port if prefill.core.kv_server else 0
    two = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=2)
    pull = KVTransferParams(room, False, "127.0.0.1", port)
    decode.add_request(EngineCoreRequest("d", PROMPT, two, time.time(), kv_transfer=pull))
    tokens: dict[int, list[int]] = {0: [], 1: []}
    cached: dict[int, int] = {}
    while decode.has_unfinished_requests():
        for delta in decode.step():
            tokens[delta.index] += delta.new_token_ids
            cached[delta.index] = max(cached.get(delta.index, -1), delta.num_cached_tokens)
    # Sample 1 waited for sample 0's blocks rather than computing the prompt itself.
    assert cached == {0: 40, 1: 40}
    assert tokens[0] == tokens[1] == colocated(decode)


def test_blocks_the_decode_side_holds_are_not_sent(prefill: Worker, decode: EngineCore) -> None:
    run(decode, EngineCoreRequest("warm", PROMPT[:25], GREEDY, time.time()))  # 6 full blocks cached here
    tokens, cached = split(prefill, decode)
    moved = counted(decode)
    assert (moved["blocks_skipped"], moved["blocks_received"]) == (6, 4)
    assert cached == 40
    assert moved["bytes_received"] < 5 * block_bytes(decode)
    # The whole prompt held here: nothing pulled, and the prefill worker's room let go at once, not at expiry.
    again, _ = split(prefill, decode)
    assert again == tokens
    assert counted(decode)["blocks_received"] == 4
    assert settled(prefill, prefill.core.kv.num_blocks)


def test_fewer_free_blocks_than_the_prompt_needs_pulls_what_fits(prefill: Worker, decode: EngineCore) -> None:
    taken = decode.kv.pool.allocate(decode.kv.pool.num_free - 3)  # others' blocks: 3 left free
    room = next(_rooms)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefill.add(EngineCoreRequest("p", PROMPT, one, time.time(), kv_transfer=KVTransferParams(room, True)))
    port = prefill.core.kv_server.port if prefill.core.kv_server else 0
    pull = KVTransferParams(room, False, "127.0.0.1", port)
    decode.add_request(EngineCoreRequest("d", PROMPT, GREEDY, time.time(), kv_transfer=pull))
    decode.step()  # the pull starts into the 3 free blocks
    decode.kv.pool.free(list(reversed(taken)))
    tokens: list[int] = []
    cached = -1
    while decode.has_unfinished_requests():
        for delta in decode.step():
            tokens += delta.new_token_ids
            cached = max(cached, delta.num_cached_tokens)
    assert (cached, counted(decode)["blocks_received"]) == (12, 3)  # what did not fit was computed
    assert tokens == colocated(decode)
    assert decode.kv.pool.num_free == decode.kv.num_blocks
    assert settled(prefill, prefill.core.kv.num_blocks)


def test_a_prompt_shorter_than_a_block_sends_nothing(
    files: dict[str, Path], prefill: Worker, decode: EngineCore
) -> None:
    tokens, cached = split(prefill, decode, PROMPT[:3])
    assert tokens == colocated(decode, PROMPT[:3])
    assert cached == 0 and counted(decode)["pulls"] == 0
    assert settled(prefill, prefill.core.kv.num_blocks)


def pause(worker: Worker, seconds: float) -> None:
    """Hold the worker's step loop (a prefill that is slow to compute), not waiting for it here."""
    worker.then(lambda: time.sleep(seconds))


@pytest.mark.parametrize("where", ["between blocks", "mid-block"])
def test_a_peer_gone_mid_stream_means_recompute(
    prefill: Worker, decode: EngineCore, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    send = kv_transfer_server.send_frame
    blocks = []

    def dying(conn: socket.socket, kind: Kind, payload: bytes | bytearray | memoryview = b"") -> int:
        if kind is Kind.BLOCK:
            blocks.append(kind)
            if len(blocks) == 3:
                if where == "mid-block":
                    conn.sendall(bytes([kind]) + len(payload).to_bytes(4, "little") + bytes(payload)[:100])
                conn.shutdown(socket.SHUT_RDWR)  # what the peer sees of a prefill worker killed with -9
                raise ConnectionResetError("killed")
        return send(conn, kind, payload)

    monkeypatch.setattr(kv_transfer_server, "send_frame", dying)
    tokens, cached = split(prefill, decode)
    assert cached == 8  # the two blocks before it died
    assert tokens == colocated(decode)
    assert counted(decode)["pulls_failed"] == 1
    assert settled(prefill, prefill.core.kv.num_blocks)
    assert decode.kv.pool.num_free == decode.kv.num_blocks


def test_an_unknown_room_means_recompute(files: dict[str, Path], decode: EngineCore) -> None:
    prefill = Worker(engine(files, "prefill", kv_transfer_timeout=0.3))
    try:
        started = time.monotonic()
        tokens, cached = split(prefill, decode, send=False)
        assert time.monotonic() - started < 5
        assert (cached, counted(decode)["pulls_failed"]) == (0, 1)
        assert tokens == colocated(decode)
    finally:
        prefill.stop()


def test_a_slow_prefill_past_the_timeout_means_recompute(files: dict[str, Path], prefill: Worker) -> None:
    decode = engine(files, "decode", kv_transfer_timeout=1.0)
    try:
        room = next(_rooms)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        request = EngineCoreRequest("p", PROMPT, one, time.time(), kv_transfer=KVTransferParams(room, True))
        prefill.finished["p"] = threading.Event()

        def first_chunk_then_stall() -> None:
            prefill.core.add_request(request)
            assert not prefill.core.step()  # 16 of its 41 tokens: 4 blocks parked
            time.sleep(2.5)

        prefill.then(first_chunk_then_stall)
        started = time.monotonic()
        tokens, cached = split(prefill, decode, room=room, send=False)
        assert time.monotonic() - started < 2.5  # it did not wait for the prefill worker
        # The blocks computed before the stall came (the pull streams while the prompt computes); the rest not.
        assert (cached, counted(decode)["pulls_timed_out"]) == (16, 1)
        assert tokens == colocated(decode)
        assert decode.kv.pool.num_free == decode.kv.num_blocks
        # The prefill worker finishes later; the room its puller left is released, not parked.
        prefill.wait("p")
        assert settled(prefill, prefill.core.kv.num_blocks)
    finally:
        decode.close()


def test_another_layout_is_refused(files: dict[str, Path], prefill: Worker) -> None:
    decode = engine(files, "decode", "bfloat16")
    try:
        port = prefill.core.kv_server.port if prefill.core.kv_server else 0
        assert decode.kv_layout is not None
        layout = decode.kv_layout.__dict__
        assert (
            check_peer("127.0.0.1", port, layout, 5)
            == f"prefill worker 127.0.0.1:{port}: KV dtype bfloat16 here, float32 there"
        )
        assert prefill.core.kv_layout is not None
        assert check_peer("127.0.0.1", port, prefill.core.kv_layout.__dict__, 5) is None
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            closed = unused.getsockname()[1]
        gone = probe_peer("127.0.0.1", closed, layout, 5)
        assert not gone.reachable and gone.problem is not None and "unreachable" in gone.problem
        # Refused at the handshake, before any room is asked for (none is opened here: it would wait to expire).
        tokens, cached = split(prefill, decode, send=False)
        assert (cached, counted(decode)["pulls_failed"]) == (0, 1)
        assert tokens == colocated(decode)
    finally:
        decode.close()


@pytest.mark.parametrize("damage", ["checksum", "hash"])
def test_a_corrupted_block_is_refused(
    prefill: Worker, decode: EngineCore, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    encode = kv_transfer_server.encode_block
    count = []

    def corrupting(key: bytes, block: StoredBlock) -> bytes:
        count.append(block)
        if len(count) != 2:
            return encode(key, block)
        if damage == "hash":  # a well-formed block whose tokens are not the ones its hash chains
            tokens = (block.token_ids[0] + 1, *block.token_ids[1:])
            return encode(key, StoredBlock(block.block_hash, block.parent_hash, tokens, block.payload))
        data = bytearray(encode(key, block))
        data[-10] ^= 0xFF  # a flipped byte in the payload
        return bytes(data)

    monkeypatch.setattr(kv_transfer_server, "encode_block", corrupting)
    tokens, cached = split(prefill, decode)
    assert (cached, counted(decode)["pulls_failed"]) == (4, 1)
    assert tokens == colocated(decode)
    assert settled(prefill, prefill.core.kv.num_blocks)


def test_a_decode_request_aborted_while_it_waits_frees_both_sides(prefill: Worker, decode: EngineCore) -> None:
    room = next(_rooms)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefill.add(EngineCoreRequest("p", PROMPT, one, time.time(), kv_transfer=KVTransferParams(room, True)))
    pause(prefill, 1.0)
    port = prefill.core.kv_server.port if prefill.core.kv_server else 0
    pull = KVTransferParams(room, False, "127.0.0.1", port)
    decode.add_request(EngineCoreRequest("d", PROMPT, GREEDY, time.time(), kv_transfer=pull))
    decode.step()
    assert decode.kv_peers is not None and decode.kv_peers.loading
    assert decode.kv.pool.num_free < decode.kv.num_blocks  # blocks held for the pull
    # Its PULL must have reached the prefill worker: a decode request aborted before
    # that leaves an unclaimed room, which ends only when it expires (kv_transfer_timeout).
    rooms = prefill.core.kv_rooms
    assert rooms is not None
    claimed = poll_until(lambda: rooms.is_claimed(room), bool, timeout=5, interval=0.01)
    assert claimed, "the decode worker's pull never reached the prefill worker"
    decode.abort_requests(["d"])
    deadline = time.monotonic() + 5
    while decode.kv.pool.num_free < decode.kv.num_blocks:
        assert time.monotonic() < deadline, "the aborted pull kept its blocks"
        decode.housekeep()
        time.sleep(0.01)
    prefill.wait("p")
    assert settled(prefill, prefill.core.kv.num_blocks)


def test_a_prefill_aborted_while_its_blocks_are_awaited_answers_the_pull_at_once(
    prefill: Worker, decode: EngineCore
) -> None:
    room = next(_rooms)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    request = EngineCoreRequest("p", PROMPT, one, time.time(), kv_transfer=KVTransferParams(room, True))

    def stall_then_abort() -> None:
        prefill.core.add_request(request)
        time.sleep(0.5)  # the decode worker's pull claims the room meanwhile and waits for block 0
        prefill.core.abort_requests(["p"])

    prefill.then(stall_then_abort)
    started = time.monotonic()
    tokens, cached = split(prefill, decode, room=room, send=False)
    assert time.monotonic() - started < 5  # answered FAILED at the abort, not at the 10 s timeout
    assert (cached, counted(decode)["pulls_failed"], counted(decode)["pulls_timed_out"]) == (0, 1, 0)
    assert tokens == colocated(decode)
    assert settled(prefill, prefill.core.kv.num_blocks)


def test_unpulled_rooms_expire(files: dict[str, Path]) -> None:
    prefill = Worker(engine(files, "prefill", kv_transfer_timeout=0.3))
    try:
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        prefill.add(EngineCoreRequest("p", PROMPT, one, time.time(), kv_transfer=KVTransferParams(7, True)))
        prefill.wait("p")
        assert prefill.call(prefill.core.stats).kv_transfer_rooms_parked == 1
        with pytest.raises(ValueError, match="bootstrap_room 7 is already in use"):
            prefill.add(EngineCoreRequest("q", PROMPT, one, time.time(), kv_transfer=KVTransferParams(7, True)))
        assert settled(prefill, prefill.core.kv.num_blocks)
        assert prefill.call(prefill.core.stats).kv_transfer_rooms_expired == 1
    finally:
        prefill.stop()


def test_a_room_on_an_engine_of_another_role_is_refused(decode: EngineCore) -> None:
    one = SamplingParams(temperature=0.0, max_tokens=1)
    with pytest.raises(ValueError, match="no prefill worker"):
        decode.add_request(EngineCoreRequest("p", PROMPT, one, time.time(), kv_transfer=KVTransferParams(1, True)))
    with pytest.raises(ValueError, match="bootstrap_room"):
        decode.add_request(EngineCoreRequest("d", PROMPT, one, time.time(), kv_transfer=KVTransferParams(2**64, False)))
