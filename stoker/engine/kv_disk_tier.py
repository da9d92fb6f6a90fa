"""The engine's side of the disk tier: moving blocks between the KV tensors and
a DiskBlockStore (stoker/engine/kv_disk.py), for the block pool and the scheduler.

Spill: when a hashed block leaves RAM (its last holder frees it, or the free
queue hands it to someone else) and the store does not know it yet, its bytes
are copied out of the KV tensors on the step loop (K then V of each layer, the
cache's own dtype and rows, scales included) and queued; the store's writer
thread does the file work.

Fetch: a waiting request whose prompt continues past its RAM hits with a block
the store holds gets free blocks held for it, and a reader thread reads the
chain's files and copies each block's bytes straight into them (no other
request can see those blocks, so the step loop runs on meanwhile). The request
waits (others are scheduled) until the read is done or LOAD_TIMEOUT_S passes;
then the blocks read are indexed in the RAM prefix cache with their hashes, so
the scheduler's ordinary lookup finds them: they count as cached tokens like
any hit. A read that fails or times out only means the request computes those
tokens; while a timed-out read is still stuck, no other is started.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from enum import Enum, auto

import torch

from stoker.engine.kv_block_bytes import KVBlockBytes
from stoker.engine.kv_cache import Block, BlockPool, hashes_past
from stoker.engine.kv_disk import DiskBlockStore, StoredBlock
from stoker.engine.kv_events import KVEventLog
from stoker.engine.outputs import RequestKey
from stoker.engine.request import Request

log = logging.getLogger("stoker.engine.kv_disk")

LOAD_TIMEOUT_S = 10.0
"""Longest a request waits for its blocks from disk before computing them instead (a slow or hung disk)."""

DISK_MEDIUM = "DISK"
"""The medium KV events name for blocks on the disk tier (the RAM tier is kv_events.MEDIUM)."""


class Fetch(Enum):
    NOTHING = auto()
    """No blocks to read: schedule the request as it is."""
    WAITING = auto()
    """Its blocks are being read: leave it waiting this step."""
    LOADED = auto()
    """Blocks were added to the RAM prefix cache: look its prefix up again."""


@dataclass
class _Load:
    future: Future[list[StoredBlock]]
    cancel: threading.Event
    started: float
    held: list[Block]
    """The request's RAM hits, a reference taken so they stay while it waits."""
    targets: list[Block]
    """Blocks taken from the free queue for the reader to copy into, in chain order."""
    lora_name: str | None = None
    hash_root: bytes | None = None
    """The request's chain root (a LoRA adapter's; None for the base), for the blocks' KV events."""


class DiskTier:
    def __init__(
        self,
        store: DiskBlockStore,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        pool: BlockPool,
        block_size: int,
        events: KVEventLog | None = None,
    ) -> None:
        self.store = store
        self.pool = pool
        self.block_size = block_size
        self._loads: dict[RequestKey, _Load] = {}
        self._tried: dict[RequestKey, int] = {}
        """The RAM hit count a request's disk lookup started from; not looked up again from there."""
        self.num_hit_blocks = 0
        """Blocks loaded into RAM for requests (cumulative)."""
        self.num_load_timeouts = 0
        self._abandoned: list[_Load] = []
        """Reads given up (timed out, request gone) that may still be copying into their blocks."""
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stoker-kv-load")
        self._events = events
        self._disk_events: deque[tuple[bytes, StoredBlock | None]] = deque()
        """From the writer thread: (hash, block written) or (hash, None) evicted; drained on the step loop."""
        if events is not None:
            store.on_written = lambda block: self._disk_events.append((block.block_hash, block))
            store.on_evicted = lambda block_hash: self._disk_events.append((block_hash, None))
        pool.spill = self.spill
        self._bytes = KVBlockBytes(kv_caches)

    # --------------------------------------------------------------- spill

    def spill(self, block: Block) -> None:
        if block.block_hash is None or block.token_ids is None or self.store.known(block.block_hash):
            return
        payload = self._bytes.read(block.block_id)
        self.store.submit(StoredBlock(block.block_hash, block.parent_hash, block.token_ids, payload))

    # --------------------------------------------------------------- fetch

    def fetch(self, request: Request, cached: list[Block]) -> Fetch:
        self.reap()
        key = request.key
        load = self._loads.get(key)
        if load is None:
            return self._start(request, cached)
        if not load.future.done():
            if time.monotonic() - load.started < LOAD_TIMEOUT_S:
                return Fetch.WAITING
            del self._loads[key]
            self._abandon(load)
            self.num_load_timeouts += 1
            log.warning("KV disk tier: a read took over %.1fs; computing the prefix instead", LOAD_TIMEOUT_S)
            return Fetch.NOTHING
        del self._loads[key]
        return Fetch.LOADED if self._finish(load) else Fetch.NOTHING

    def _start(self, request: Request, cached: list[Block]) -> Fetch:
        key = request.key
        if self._tried.get(key, -1) >= len(cached) or self._abandoned:
            return Fetch.NOTHING  # tried from here already, or the disk is hung: serve from RAM
        first_parent, hashes = hashes_past(request, cached, self.block_size)
        if not hashes:
            return Fetch.NOTHING
        if not self.store.contains(hashes[0]):
            self._tried[key] = len(cached)
            self.store.record_miss()
            return Fetch.NOTHING
        if self._loads:
            # One read at a time (there is one reader): requests sharing a prefix then read it
            # once, the next one finding it in RAM when its turn comes.
            return Fetch.WAITING
        self._tried[key] = len(cached)
        # The request's RAM hits are held so no allocation takes them while it waits, and the
        # reader copies into blocks held for it, which nothing else reads or writes meanwhile.
        self.pool.touch(cached)
        targets = self.pool.allocate(min(len(hashes), self.pool.num_free))
        cancel = threading.Event()
        future = self._reader.submit(self._read_into, hashes[: len(targets)], first_parent, targets, cancel)
        self._loads[key] = _Load(
            future, cancel, time.monotonic(), list(cached), targets, request.lora_name, request.hash_root
        )
        return Fetch.WAITING

    def _read_into(
        self, hashes: list[bytes], parent: bytes | None, targets: list[Block], cancel: threading.Event
    ) -> list[StoredBlock]:
        """In the reader thread: each block's file into its target, up to the first missing or bad one.
        What it returns holds the blocks' keys; their payloads are already in place."""
        loaded: list[StoredBlock] = []
        for block_hash, target in zip(hashes, targets):
            if cancel.is_set():
                break
            stored = self.store.read(block_hash)
            if stored is None or stored.parent_hash != parent:
                break
            self._bytes.write(target.block_id, stored.payload)
            loaded.append(StoredBlock(block_hash, parent, stored.token_ids, b""))
            parent = block_hash
        return loaded

    def _finish(self, load: _Load) -> bool:
        """On the step loop, the read done: index what it loaded as cached, release the rest."""
        try:
            loaded = load.future.result()
        except Exception:  # a reader failure is a miss, never a failed request
            log.exception("KV disk tier: reading blocks failed")
            loaded = []
        for block, stored in zip(load.targets, loaded):
            self.pool.cache_block(block, stored.parent_hash, stored.token_ids, load.lora_name, load.hash_root)
        self.pool.free(list(reversed(load.targets)))
        self.pool.free(list(reversed(load.held)))
        self.num_hit_blocks += len(loaded)
        return bool(loaded)

    def _abandon(self, load: _Load) -> None:
        """Stop a read whose request no longer waits. Its blocks stay held until the reader lets
        go of them (it may be copying into them), then return to the free queue uncached."""
        load.cancel.set()
        self._abandoned.append(load)
        self.reap()

    def reap(self) -> None:
        """Release the blocks of abandoned reads that have stopped."""
        for load in [load for load in self._abandoned if load.future.done()]:
            self._abandoned.remove(load)
            self.pool.free(list(reversed(load.targets)))
            self.pool.free(list(reversed(load.held)))

    def forget(self, key: RequestKey) -> None:
        """The request left the scheduler: stop its read, drop what was tried."""
        load = self._loads.pop(key, None)
        if load is not None:
            self._abandon(load)
        self._tried.pop(key, None)

    def wait(self, timeout: float) -> None:
        """An otherwise idle step: wait a little for a read rather than spin."""
        if self._loads:
            wait([load.future for load in self._loads.values()], timeout, FIRST_COMPLETED)

    @property
    def loading(self) -> bool:
        return bool(self._loads)

    def record_events(self) -> None:
        """Blocks the writer stored or evicted since the last call, as KV events of medium DISK."""
        if self._events is None:
            return
        while self._disk_events:
            block_hash, block = self._disk_events.popleft()
            if block is None:
                self._events.removed(block_hash, DISK_MEDIUM)
            else:
                self._events.stored(block_hash, block.parent_hash, block.token_ids, DISK_MEDIUM)

    def close(self) -> None:
        for load in [*self._loads.values(), *self._abandoned]:
            load.cancel.set()
        self._reader.shutdown(wait=True)
        self.store.close()
