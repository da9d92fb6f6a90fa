"""KV cache events, published the way vLLM publishes them, so a router that
tracks which replica holds which prefix (vllm-router's kv_aware policy) can
send a request to the replica that already has its prompt's blocks.

Wire format (vLLM's, as vllm-router 0.1.17 decodes it): a ZeroMQ PUB socket
sending three-frame messages [topic, 8-byte big-endian sequence number,
msgpack payload]. The payload is a KVEventBatch encoded as an array
[ts, events, data_parallel_rank]; each event is a map tagged with its class
name under "type" (BlockStored, BlockRemoved, AllBlocksCleared), every
field present even when null: the router refuses an event that lacks one,
and refuses events encoded as arrays.

What the router does with them (read from its source and checked against the
binary): it indexes the *token ids* of each BlockStored event, block by block,
in a radix tree whose edges follow parent_block_hash; a request's own token
ids (which it asks the replica for, at /v1/completions/render or
/v1/chat/completions/render) are walked down that tree. The block hashes are
opaque keys for parent links and removals only, so stoker's own sha256 chain
hashes serve, sent as their first 8 bytes as an unsigned integer (vLLM's
default form). Block size must agree: --kv-event-block-size on the router,
--block-size here.

Replay (vLLM's replay_endpoint): a subscriber that sees a gap in the
sequence numbers asks a ROUTER socket (--kv-events-replay-endpoint) for the
batches from the first one it missed: it sends that number as 8 bytes,
big-endian, and gets back each batch still held from there on as
[sequence, payload], then [-1 (signed), empty payload] to end. The latest
--kv-events-buffer-steps batches are held, dropped ones included (a replay
is how a slow subscriber gets them after all).

Exposure: the events carry every prompt's token ids (the text, tokenized),
and ZeroMQ authenticates nobody: whoever reaches the port reads them. So an
endpoint given as a port alone binds 127.0.0.1, a wider bind is the
operator's explicit choice (tcp://HOST:PORT, tcp://*:PORT; logged as a
warning), and --no-kv-events-include-token-ids publishes block hashes only
(vllm-router's kv_aware needs the token ids, other subscribers may not).
Both sockets take input (subscriptions on the publisher, requests on the
replay socket): an inbound message over MAX_INBOUND_BYTES disconnects its
sender inside ZeroMQ, before anything here reads or allocates it.

Cost: nothing when --kv-events-endpoint is unset (the block pool holds None
and checks it where a key is set or dropped). When set: a few list appends
per cached block, one encode and one non-blocking send per engine step that
changed the cache; a send that would block (the high-water mark reached, a
slow subscriber) drops the batch and counts it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import msgspec
import zmq

from stoker.zmq_address import is_local

log = logging.getLogger("stoker.engine.kv_events")

MEDIUM = "GPU"
"""The tier vLLM names its device cache. The router files blocks by medium and
ranks anything else as a slower tier, so stoker's RAM tier (CPU memory or GPU)
is reported as vLLM's primary one; blocks on the disk tier (--kv-cache-disk)
are stored and removed under medium "DISK" (kv_disk_tier.DISK_MEDIUM)."""

SEND_HWM = 10_000
"""Batches ZeroMQ may queue per subscriber before a send would block; beyond it, batches are dropped."""

MAX_INBOUND_BYTES = 4096
"""Largest message either socket accepts from a peer (ZeroMQ's MAXMSGSIZE): a
subscription is 1 byte and a topic prefix (topics are at most 256 bytes), a
replay request 8 bytes. A bigger one disconnects its sender."""


class KVCacheEvent(msgspec.Struct, tag=True, gc=False):
    """Base of the three events; tag=True writes the class name under "type"."""


class BlockStored(KVCacheEvent):
    """Full blocks that became prefix-cache hits, in chain order: block_hashes[0]'s
    parent is parent_block_hash (None: the first block of a prompt), each next one's
    the one before it. token_ids holds block_size tokens per hash."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer hittable (evicted for reuse, or flushed)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache is empty (a fresh engine, or a flush with nothing running)."""


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = 0


def wire_hash(block_hash: bytes) -> int:
    """A block's key on the wire: the first 8 bytes of stoker's sha256 chain hash,
    unsigned (the router refuses negative integers)."""
    return int.from_bytes(block_hash[:8], "big")


class KVEventLog:
    """What the block pool changed since the last publish, merged as it comes:
    a block stored right after its parent extends the same BlockStored event,
    consecutive removals share one BlockRemoved."""

    def __init__(self, block_size: int, include_token_ids: bool = True) -> None:
        self.block_size = block_size
        self.include_token_ids = include_token_ids
        """False: BlockStored events carry an empty token_ids (the field stays: subscribers require it)."""
        self.events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def stored(
        self,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids: tuple[int, ...],
        medium: str = MEDIUM,
        lora_name: str | None = None,
    ) -> None:
        """lora_name: the LoRA adapter whose request computed the block (its chain is that adapter's alone)."""
        key = wire_hash(block_hash)
        parent = wire_hash(parent_hash) if parent_hash is not None else None
        last = self.events[-1] if self.events else None
        if (
            isinstance(last, BlockStored)
            and last.medium == medium
            and last.lora_name == lora_name
            and parent is not None
            and last.block_hashes[-1] == parent
        ):
            last.block_hashes.append(key)
            if self.include_token_ids:
                last.token_ids.extend(token_ids)
        else:
            tokens = list(token_ids) if self.include_token_ids else []
            self.events.append(BlockStored([key], parent, tokens, self.block_size, medium=medium, lora_name=lora_name))

    def removed(self, block_hash: bytes, medium: str = MEDIUM) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(wire_hash(block_hash))
        else:
            self.events.append(BlockRemoved([wire_hash(block_hash)], medium=medium))

    def cleared(self) -> None:
        # Whatever came before is moot once everything is gone.
        self.events = [AllBlocksCleared()]

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        events, self.events = self.events, []
        return events


class KVEventPublisher:
    """A publishing socket bound at endpoint; one message per publish(), never
    blocking. With replay_endpoint, the latest buffer_steps batches are held and
    a thread answers replay requests there."""

    def __init__(
        self, endpoint: str, topic: str = "", replay_endpoint: str | None = None, buffer_steps: int = 10_000
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.seq = 0
        self.num_published = 0
        self.num_dropped = 0
        self.num_replays = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context(io_threads=1)
        self._history: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._history_lock = threading.Lock()
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        # XPUB rather than PUB: a PUB socket drops silently at its high-water mark,
        # XPUB with NODROP answers EAGAIN instead, so a dropped batch can be counted.
        # Subscribers (SUB sockets) cannot tell the difference.
        self._socket = self._ctx.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.XPUB_NODROP, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
        self._bind(self._socket, endpoint, "--kv-events-endpoint")
        if replay_endpoint:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
            self._bind(replay, replay_endpoint, "--kv-events-replay-endpoint")
            # The thread owns the ROUTER socket from here on (ZeroMQ sockets are not thread-safe).
            self._replay_thread = threading.Thread(
                target=self._serve_replays, args=(replay,), name="kv-events-replay", daemon=True
            )
            self._replay_thread.start()
            log.info("replaying up to %d KV event batches on %s", buffer_steps, replay_endpoint)
        log.info("publishing KV cache events on %s (topic %r)", endpoint, topic)

    def _bind(self, socket: zmq.Socket[bytes], endpoint: str, flag: str) -> None:
        try:
            socket.bind(endpoint)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            self.close()
            # ValueError: the engine process reports it as the one line it fails with.
            raise ValueError(f"{flag} {endpoint}: cannot bind: {exc}") from None
        if not is_local(endpoint):
            log.warning(
                "%s %s: reachable beyond this machine, with no authentication; KV events carry prompt token "
                "ids: keep this port on a private network (docs/routers.md)",
                flag,
                endpoint,
            )

    def publish(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> bool:
        """Send one batch; False (and counted) if ZeroMQ would have had to block."""
        self._drain_subscriptions()
        payload = self._encoder.encode(KVEventBatch(time.time(), events))
        if self._replay_thread is not None:
            with self._history_lock:
                self._history.append((self.seq, payload))
        try:
            self._socket.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                log.warning("KV event batches dropped (a subscriber is not keeping up): %d", self.num_dropped)
            return False
        finally:
            # A dropped batch still takes its number: the gap tells subscribers they missed one.
            self.seq += 1
        self.num_published += 1
        return True

    def _drain_subscriptions(self) -> None:
        """XPUB hands (un)subscription messages up; read them so they never pile up."""
        while True:
            try:
                self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def held_since(self, start: int) -> list[tuple[int, bytes]]:
        """The held batches numbered start or later, oldest first."""
        with self._history_lock:
            return [(seq, payload) for seq, payload in self._history if seq >= start]

    def _serve_replays(self, socket: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if not socket.poll(100):
                    continue
                frames = socket.recv_multipart()
                # [identity, start] from a DEALER; [identity, b"", start] from a REQ socket,
                # whose replies must carry the same empty delimiter.
                envelope, start = frames[:-1], frames[-1]
                end = [*envelope, (-1).to_bytes(8, "big", signed=True), b""]
                if len(envelope) not in (1, 2) or len(start) != 8:
                    log.warning("KV event replay: a request that is not one 8-byte sequence number, ignored")
                    socket.send_multipart(end)
                    continue
                self.num_replays += 1
                for seq, payload in self.held_since(int.from_bytes(start, "big")):
                    socket.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
                socket.send_multipart(end)
        except zmq.ZMQError as exc:
            if not self._stop.is_set():
                log.error("KV event replay stopped: %s", exc)
        finally:
            socket.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=5)
        self._socket.close(linger=0)
        self._ctx.term()
