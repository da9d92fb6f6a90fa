"""The disk tier's block store on its own: files, checks, LRU, pins, sharing."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stoker.engine.kv_cache import chain_hash
from stoker.engine.kv_disk import STALE_TEMP_S, DiskBlockStore, DiskLayout, StoredBlock
from stoker.engine.kv_disk_format import CHECKSUM, HEADER
from stoker.engine.kv_disk_pins import TEMP_PREFIX

BLOCK_SIZE = 4
BLOCK_BYTES = 256
LAYOUT = DiskLayout(model_digest="sha256:" + "ab" * 32, kv_dtype="bfloat16", block_size=BLOCK_SIZE, block_bytes=256)


def chain(num_blocks: int, seed: int = 0) -> list[StoredBlock]:
    """Blocks of one prompt, each chained to the one before, with distinct payloads."""
    out: list[StoredBlock] = []
    parent: bytes | None = None
    for i in range(num_blocks):
        tokens = tuple(range(seed * 1000 + i * BLOCK_SIZE, seed * 1000 + (i + 1) * BLOCK_SIZE))
        block_hash = chain_hash(parent, tokens)
        out.append(StoredBlock(block_hash, parent, tokens, bytes((seed + i + j) % 256 for j in range(BLOCK_BYTES))))
        parent = block_hash
    return out


def file_size() -> int:
    return HEADER.size + 8 * BLOCK_SIZE + BLOCK_BYTES + CHECKSUM.size


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[list[DiskBlockStore]]:
    made: list[DiskBlockStore] = []
    yield made
    for store in made:
        store.close()


def open_store(
    stores: list[DiskBlockStore], directory: Path, capacity: int = 1 << 20, layout: DiskLayout = LAYOUT
) -> DiskBlockStore:
    store = DiskBlockStore(directory, capacity, layout)
    stores.append(store)
    return store


def put(store: DiskBlockStore, blocks: list[StoredBlock]) -> None:
    for block in blocks:
        assert store.submit(block)
    store.flush()


def test_round_trip(tmp_path: Path, stores: list[DiskBlockStore]) -> None:
    store = open_store(stores, tmp_path)
    blocks = chain(3)
    assert not store.contains(blocks[0].block_hash)
    put(store, blocks)
    assert all(store.contains(b.block_hash) for b in blocks)
    assert store.read(blocks[1].block_hash) == StoredBlock(
        blocks[1].block_hash, blocks[1].parent_hash, blocks[1].token_ids, blocks[1].payload
    )
    read = store.read_chain([b.block_hash for b in blocks]).result()
    assert [b.payload for b in read] == [b.payload for b in blocks]
    stats = store.stats()
    assert stats.hits == 4 and stats.bytes_written == 3 * file_size() and stats.pending_writes == 0
    assert oct(os.stat(store.path(blocks[0].block_hash)).st_mode & 0o777) == "0o600"
    # Written once: a block already on disk is not queued again.
    put(store, blocks)
    assert store.stats().bytes_written == 3 * file_size()


def test_read_chain_stops_at_the_first_missing_block(tmp_path: Path, stores: list[DiskBlockStore]) -> None:
    store = open_store(stores, tmp_path)
    blocks = chain(4)
    put(store, blocks[:2] + blocks[3:])
    read = store.read_chain([b.block_hash for b in blocks]).result()
    assert [b.block_hash for b in read] == [b.block_hash for b in blocks[:2]]


def test_block_of_wrong_size_is_refused(tmp_path: Path, stores: list[DiskBlockStore]) -> None:
    store = open_store(stores, tmp_path)
    block = chain(1)[0]
    with pytest.raises(ValueError, match="does not match the layout"):
        store.submit(StoredBlock(block.block_hash, None, block.token_ids, b"short"))


def test_temporary_files_are_never_visible_and_stale_ones_are_removed(
    tmp_path: Path, stores: list[DiskBlockStore]
) -> None:
    store = open_store(stores, tmp_path)
    block = chain(1)[0]
    final = store.path(block.block_hash)
    final.parent.mkdir(parents=True, exist_ok=True)
    # What a writer killed before its rename leaves: whole bytes under a temporary name.
    fresh = final.parent / f"{TEMP_PREFIX}1-fresh"
    stale = final.parent / f"{TEMP_PREFIX}1-stale"
    for temp in (fresh, stale):
        temp.write_bytes(store.encode(block))
    old = time.time() - STALE_TEMP_S - 1
    os.utime(stale, (old, old))
    store.scan()
    assert not store.contains(block.block_hash)
    assert store.read(block.block_hash) is None
    assert fresh.exists() and not stale.exists()  # a live writer's file is left to it


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_token", "empty"])
def test_damaged_files_are_dropped_never_served(tmp_path: Path, stores: list[DiskBlockStore], damage: str) -> None:
    store = open_store(stores, tmp_path)
    blocks = chain(2)
    put(store, blocks)
    path = store.path(blocks[1].block_hash)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip_payload":
        data[-10] ^= 0x01
    elif damage == "flip_token":
        data[200] ^= 0x80
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert store.read(blocks[1].block_hash) is None
    assert not path.exists()
    assert not store.contains(blocks[1].block_hash)
    stats = store.stats()
    assert stats.corrupt_dropped == 1 and stats.misses == 1
    # The chain is served up to the damaged block.
    assert len(store.read_chain([b.block_hash for b in blocks]).result()) == 1


def test_file_under_another_hash_is_dropped(tmp_path: Path, stores: list[DiskBlockStore]) -> None:
    store = open_store(stores, tmp_path)
    first, second = chain(2)
    put(store, [first])
    target = store.path(second.block_hash)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(store.path(first.block_hash), target)
    assert store.read(second.block_hash) is None
    assert not target.exists()


def test_another_layout_never_sees_the_blocks(tmp_path: Path, stores: list[DiskBlockStore]) -> None:
    store = open_store(stores, tmp_path)
    block = chain(1)[0]
    put(store, [block])
    for other in (
        DiskLayout(LAYOUT.model_digest, "int8", BLOCK_SIZE, BLOCK_BYTES),
        DiskLayout("sha256:" + "cd" * 32, LAYOUT.kv_dtype, BLOCK_SIZE, BLOCK_BYTES),
        DiskLayout(LAYOUT.model_digest, LAYOUT.kv_dtype, BLOCK_SIZE, BLOCK_BYTES, layout_version=99),
    ):
        other_store = open_store(stores, tmp_path, layout=other)
        assert other_store.root != store.root
        assert not other_store.contains(block.block_hash)
        # Even a file copied into its folder is refused (its header names the other layout) and removed.
        copied = other_store.path(block.block_hash)
        copied.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(store.path(block.block_hash), copied)
        assert other_store.read(block.block_hash) is None and not copied.exists()
    assert store.read(block.block_hash) is not None


def test_lru_within_the_size(tmp_path: Path, stores: list[DiskBlockStore]) -> None:
    store = open_store(stores, tmp_path, capacity=3 * file_size())
    blocks = chain(5)
    put(store, blocks[:3])
    assert store.read(blocks[0].block_hash) is not None  # used: now the newest
    put(store, blocks[3:4])
    assert [store.contains(b.block_hash) for b in blocks[:4]] == [True, False, True, True]
    put(store, blocks[4:])
    assert [store.contains(b.block_hash) for b in blocks] == [True, False, False, True, True]
    stats = store.stats()
    assert stats.evictions == 2 and stats.bytes_used == 3 * file_size() <= stats.capacity_bytes


def test_a_restart_keeps_the_lru_order(tmp_path: Path, stores: list[DiskBlockStore]) -> None:
    store = open_store(stores, tmp_path, capacity=3 * file_size())
    blocks = chain(4)
    put(store, blocks[:3])
    for i, block in enumerate(blocks[:3]):
        stamp = time.time() - 100 + i
        os.utime(store.path(block.block_hash), (stamp, stamp))
    assert store.read(blocks[0].block_hash) is not None  # refreshes its mtime
    store.close()
    stores.remove(store)
    again = open_store(stores, tmp_path, capacity=3 * file_size())
    put(again, blocks[3:])
    assert [again.contains(b.block_hash) for b in blocks] == [True, False, True, True]


def test_pinned_blocks_are_never_evicted(tmp_path: Path, stores: list[DiskBlockStore]) -> None:
    store = open_store(stores, tmp_path, capacity=2 * file_size())
    pinned = chain(2, seed=1)
    put(store, pinned)
    store.pin("system-prompt", [b.block_hash for b in pinned], 2 * BLOCK_SIZE)
    put(store, chain(4, seed=2))
    assert all(store.contains(b.block_hash) for b in pinned)
    (pin,) = store.pins()
    assert (pin.label, pin.num_tokens, pin.num_blocks, pin.blocks_on_disk) == ("system-prompt", 8, 2, 2)
    assert pin.created <= time.time()
    # A second store on the directory (a restart, another replica) honours the pin.
    other = open_store(stores, tmp_path, capacity=2 * file_size())
    assert [p.label for p in other.pins()] == ["system-prompt"]
    assert store.unpin("system-prompt") and not store.unpin("system-prompt")
    assert store.pins() == []
    # Unpinned, they are ordinary blocks again: the oldest, so the first to go.
    put(store, chain(2, seed=3))
    assert not any(store.contains(b.block_hash) for b in pinned)
    assert store.stats().bytes_used <= 2 * file_size()


@pytest.mark.parametrize("label", ["", "../escape", "a/b", "x" * 65, ".hidden"])
def test_pin_labels_are_bounded(tmp_path: Path, stores: list[DiskBlockStore], label: str) -> None:
    store = open_store(stores, tmp_path)
    with pytest.raises(ValueError, match="pin label"):
        store.pin(label, [], 0)


def test_a_second_store_shares_the_directory(tmp_path: Path, stores: list[DiskBlockStore]) -> None:
    first = open_store(stores, tmp_path)
    second = open_store(stores, tmp_path)
    blocks = chain(3)
    put(first, blocks)
    assert all(second.contains(b.block_hash) for b in blocks)
    assert second.read(blocks[0].block_hash) is not None
    # The first deletes what the second knows of: a miss there, never an error.
    first.path(blocks[1].block_hash).unlink()
    assert second.read(blocks[1].block_hash) is None
    assert len(second.read_chain([b.block_hash for b in blocks]).result()) == 1
    # And the second still writes and evicts around files that vanished.
    put(second, [blocks[1]])
    assert first.read(blocks[1].block_hash) is not None


def test_a_failing_disk_degrades_writes_and_keeps_reads_quiet(tmp_path: Path, stores: list[DiskBlockStore]) -> None:
    store = open_store(stores, tmp_path)
    blocks = chain(2)
    put(store, blocks[:1])
    # The folder is replaced by a file: every write now fails with an OSError, as on a dead disk.
    shutil.rmtree(store.root)
    store.root.write_bytes(b"")
    assert store.submit(blocks[1])
    store.flush()
    stats = store.stats()
    assert stats.degraded is not None and stats.bytes_written == file_size()
    assert not store.submit(chain(1, seed=3)[0])  # paused: dropped at once, counted
    assert store.stats().writes_dropped == 1
    assert store.read(blocks[0].block_hash) is None and store.read(blocks[1].block_hash) is None
