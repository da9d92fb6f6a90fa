"""The disk tier under the prefix cache: one file per full KV block.

A block is filed under DIR/<layout key>/<first hash byte>/<block hash>.kv, so
blocks of another model, KV dtype, block size or layout version never meet
(their folders differ) and several servers pointing at one DIR share the
blocks of the model they serve. The file format and its checks are in
kv_disk_format.py; a file that fails a check is removed and never served.
DIR is created 0700 and files 0600: they hold prompts' token ids.

Writes go to a temporary name and are renamed into place, so a reader sees a
whole file or none. fsync policy: none per block. A killed process loses
nothing the kernel already holds; after a power loss a renamed file may be
short or zeroed, which the length and checksum checks drop. A block is a cache
entry, so losing the newest ones costs a recompute, never a wrong answer.

LRU within the size: an index of the files this process knows, oldest use
first, rebuilt by scanning at start and every RESCAN_S (so blocks other
processes add count too); a read refreshes the file's mtime, which is what a
scan orders by. A file another process deleted is a miss; eviction tolerates
it. Pinned prefixes (kv_disk_pins.py) are never evicted.

Degrade, don't fail: a write that fails (disk full, read-only, gone) puts the
store in a degraded state (one log line, DiskTierStats.degraded) and writes
pause for DEGRADED_RETRY_S; reads that fail are misses. Nothing raises into
the step loop.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from stoker.engine.kv_disk_format import (
    DiskLayout,
    StoredBlock,
    block_file_bytes,
    decode_block,
    encode_block,
)
from stoker.engine.kv_disk_pins import LABEL, TEMP_PREFIX, PinFolder, PinnedPrefix

__all__ = [  # what callers take from here: the store, and the format's and pins' types it speaks in
    "LABEL",
    "DiskBlockStore",
    "DiskLayout",
    "DiskTierStats",
    "PinnedPrefix",
    "StoredBlock",
    "block_file_bytes",
]

log = logging.getLogger("stoker.engine.kv_disk")

SUFFIX = ".kv"
STALE_TEMP_S = 600.0
"""A temporary file older than this was left by a killed writer (a live one renames within seconds)."""
RESCAN_S = 30.0
DEGRADED_RETRY_S = 60.0
MAX_PENDING_WRITES = 4096
"""Blocks queued for the writer; beyond it a write is dropped (counted), never waited for."""


@dataclass(frozen=True)
class DiskTierStats:
    hits: int = 0
    """Blocks read from disk (cumulative)."""
    misses: int = 0
    """Blocks looked for on disk and not found, or dropped as corrupt (cumulative)."""
    bytes_read: int = 0
    bytes_written: int = 0
    pending_writes: int = 0
    """Blocks queued for the writer now."""
    writes_dropped: int = 0
    """Blocks not written: the queue was full or the store degraded (cumulative)."""
    evictions: int = 0
    corrupt_dropped: int = 0
    """Files removed because they were truncated, failed their checksum or held another layout or hash."""
    bytes_used: int = 0
    capacity_bytes: int = 0
    degraded: str | None = None
    """Why writes are paused (the OS error), None while healthy."""


class DiskBlockStore:
    """Block files in one layout's folder of `directory`, at most `capacity_bytes` of them."""

    def __init__(self, directory: Path, capacity_bytes: int, layout: DiskLayout) -> None:
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self._key = layout.key
        self.root = Path(directory) / self._key.hex()[:32]
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._pins = PinFolder(self.root / "pins")
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        """Block hash -> file size, least recently used first."""
        self._used = 0
        self._pinned: set[bytes] = set()
        self._counts = dict.fromkeys(
            ("hits", "misses", "bytes_read", "bytes_written", "writes_dropped", "evictions", "corrupt_dropped"), 0
        )
        self._degraded: str | None = None
        self._degraded_since = 0.0
        self._last_scan = 0.0
        self._queue: queue.Queue[StoredBlock | None] = queue.Queue(MAX_PENDING_WRITES)
        self._queued: set[bytes] = set()
        self.on_written: Callable[[StoredBlock], None] | None = None
        self.on_evicted: Callable[[bytes], None] | None = None
        """Called from the writer thread; the engine turns them into KV events of medium DISK."""
        self.scan()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stoker-kv-read")
        self._writer = threading.Thread(target=self._write_loop, name="stoker-kv-write", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------ lookups

    def path(self, block_hash: bytes) -> Path:
        return self.root / block_hash[:1].hex() / (block_hash.hex() + SUFFIX)

    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            if block_hash in self._index:
                return True
        try:
            size = self.path(block_hash).stat().st_size  # another process may have written it
        except OSError:
            return False
        self._add(block_hash, size)
        return True

    def known(self, block_hash: bytes) -> bool:
        """On disk as far as this process knows, or queued for writing: no system call (the step loop asks)."""
        with self._lock:
            return block_hash in self._index or block_hash in self._queued

    def record_miss(self) -> None:
        """A lookup that found its first block neither in RAM nor here (counted with the read misses)."""
        self._count("misses")

    def read(self, block_hash: bytes) -> StoredBlock | None:
        """The block, verified; None (a miss) when absent, unreadable or corrupt (then removed)."""
        path = self.path(block_hash)
        try:
            data = _read_whole(path)
        except OSError:
            self._forget(block_hash)
            self._count("misses")
            return None
        block = decode_block(data, self.layout, self._key, block_hash)
        if block is None:
            log.warning("KV disk tier: dropped corrupt block file %s", path.name)
            self._remove(block_hash)
            self._count("corrupt_dropped")
            self._count("misses")
            return None
        self._count("hits")
        self._count("bytes_read", len(data))
        self._add(block_hash, len(data))  # the newest in the LRU, and known: never copied out again
        try:
            os.utime(path)  # the LRU order a later scan (this or another process) sees
        except OSError:
            pass
        return block

    def read_chain(self, hashes: Sequence[bytes], cancel: threading.Event | None = None) -> Future[list[StoredBlock]]:
        """In the reader thread: the blocks of `hashes` in order, up to the first that is missing or bad."""
        return self._reader.submit(self._read_chain, list(hashes), cancel)

    def _read_chain(self, hashes: list[bytes], cancel: threading.Event | None) -> list[StoredBlock]:
        out: list[StoredBlock] = []
        parent = None
        for block_hash in hashes:
            if cancel is not None and cancel.is_set():
                break
            block = self.read(block_hash)
            if block is None or (out and block.parent_hash != parent):
                break
            out.append(block)
            parent = block_hash
        return out

    def encode(self, block: StoredBlock) -> bytes:
        return encode_block(self._key, block)

    # ------------------------------------------------------------- writes

    def submit(self, block: StoredBlock) -> bool:
        """Queue a block for the writer; False (dropped, counted) when it is full or writes are paused.
        A block already on disk or queued is not written again (True)."""
        if len(block.payload) != self.layout.block_bytes or len(block.token_ids) != self.layout.block_size:
            raise ValueError(f"a block of {len(block.payload)} bytes does not match the layout {self.layout}")
        with self._lock:
            if block.block_hash in self._index or block.block_hash in self._queued:
                return True
            if self._paused():
                self._counts["writes_dropped"] += 1
                return False
            try:
                self._queue.put_nowait(block)
            except queue.Full:
                self._counts["writes_dropped"] += 1
                return False
            self._queued.add(block.block_hash)
        return True

    def flush(self) -> None:
        """Wait until every queued block is written (tests, shutdown)."""
        self._queue.join()

    def write(self, block: StoredBlock) -> bool:
        """Write one block now (the writer thread's work): temp file, then rename. False if it failed."""
        if self.contains(block.block_hash):
            return True
        final = self.path(block.block_hash)
        temp = final.parent / f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        data = self.encode(block)
        try:
            final.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(temp, final)
        except OSError as exc:
            try:
                temp.unlink(missing_ok=True)
            except OSError:
                pass  # the folder itself is gone or not a folder
            self._degrade(exc)
            return False
        self._count("bytes_written", len(data))
        self._add(block.block_hash, len(data))
        if self.on_written is not None:
            self.on_written(block)
        self._evict_to_size()
        return True

    def _write_loop(self) -> None:
        while True:
            block = self._queue.get()
            try:
                if block is None:
                    return
                if not self._paused():
                    self.write(block)
                else:
                    self._count("writes_dropped")
                if time.monotonic() - self._last_scan > RESCAN_S:
                    self.scan()
            except Exception:  # the writer must outlive any one block
                log.exception("KV disk tier: writing a block failed")
            finally:
                if block is not None:
                    with self._lock:
                        self._queued.discard(block.block_hash)
                self._queue.task_done()

    def _paused(self) -> bool:
        if self._degraded is None:
            return False
        if time.monotonic() - self._degraded_since < DEGRADED_RETRY_S:
            return True
        self._degraded = None  # try again; a failure pauses for another period
        return False

    def _degrade(self, exc: OSError) -> None:
        reason = f"{exc.strerror or exc} ({self.root})"
        if self._degraded is None:
            log.error("KV disk tier: writes paused for %.0fs, serving from RAM: %s", DEGRADED_RETRY_S, reason)
        self._degraded, self._degraded_since = reason, time.monotonic()

    # ------------------------------------------------------------ the index

    def scan(self) -> None:
        """Rebuild the index from the folder: every block file, oldest mtime first; stale temp files removed."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        try:
            subfolders = [p for p in self.root.iterdir() if p.is_dir() and p.name != "pins"]
        except OSError:
            subfolders = []
        for folder in subfolders:
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for entry in entries:
                try:
                    st = entry.stat()
                except OSError:
                    continue  # deleted by another process since the listing
                if entry.name.startswith(TEMP_PREFIX):
                    if now - st.st_mtime > STALE_TEMP_S:
                        Path(entry.path).unlink(missing_ok=True)
                    continue
                if entry.name.endswith(SUFFIX):
                    try:
                        found.append((st.st_mtime, bytes.fromhex(entry.name[: -len(SUFFIX)]), st.st_size))
                    except ValueError:
                        continue
        found.sort()
        with self._lock:
            self._index = OrderedDict((h, size) for _, h, size in found)
            self._used = sum(self._index.values())
            self._pinned = {h for pin in self._pins.records() for h in pin.block_hashes}
            self._last_scan = time.monotonic()
        self._evict_to_size()

    def _add(self, block_hash: bytes, size: int) -> None:
        with self._lock:
            self._used += size - self._index.get(block_hash, 0)
            self._index[block_hash] = size
            self._index.move_to_end(block_hash)

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            self._used -= self._index.pop(block_hash, 0)

    def _remove(self, block_hash: bytes) -> None:
        self._forget(block_hash)
        self.path(block_hash).unlink(missing_ok=True)

    def _evict_to_size(self) -> None:
        while True:
            with self._lock:
                if self._used <= self.capacity_bytes:
                    return
                victim = next((h for h in self._index if h not in self._pinned), None)
                if victim is None:
                    return  # only pinned blocks left: they stay, over the size if need be
                self._used -= self._index.pop(victim)
                self._counts["evictions"] += 1
            try:
                self.path(victim).unlink(missing_ok=True)
            except OSError:
                pass  # a read-only disk: the index forgets it all the same
            if self.on_evicted is not None:
                self.on_evicted(victim)

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    # --------------------------------------------------------------- pins

    def pin(self, label: str, block_hashes: Sequence[bytes], num_tokens: int) -> None:
        """Keep these blocks on disk whatever the LRU says (replacing a pin of the same label)."""
        self._pins.write(label, block_hashes, num_tokens)
        with self._lock:
            self._pinned.update(block_hashes)

    def unpin(self, label: str) -> bool:
        if not self._pins.remove(label):
            return False
        with self._lock:
            self._pinned = {h for pin in self._pins.records() for h in pin.block_hashes}
        self._evict_to_size()
        return True

    def pins(self) -> list[PinnedPrefix]:
        return [
            PinnedPrefix(p.label, p.num_tokens, len(p.block_hashes), p.created, sum(map(self.contains, p.block_hashes)))
            for p in self._pins.records()
        ]

    # -------------------------------------------------------------- state

    def stats(self) -> DiskTierStats:
        with self._lock:
            c = self._counts
            return DiskTierStats(
                hits=c["hits"],
                misses=c["misses"],
                bytes_read=c["bytes_read"],
                bytes_written=c["bytes_written"],
                writes_dropped=c["writes_dropped"],
                evictions=c["evictions"],
                corrupt_dropped=c["corrupt_dropped"],
                pending_writes=self._queue.qsize(),
                bytes_used=self._used,
                capacity_bytes=self.capacity_bytes,
                degraded=self._degraded,
            )

    def close(self) -> None:
        """Write what is queued, then stop the threads."""
        self._queue.put(None)
        self._writer.join()
        self._reader.shutdown(wait=True)


def _read_whole(path: Path) -> bytearray:
    """The file's bytes in a writable buffer; a file shortened meanwhile comes back short (and fails its checks)."""
    with open(path, "rb", buffering=0) as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        count = f.readinto(data)
    return data if count == len(data) else data[:count]
