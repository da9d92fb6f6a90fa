"""The disk tier through the engine (--kv-cache-disk): blocks that leave RAM are
written, a fresh engine reads them back instead of computing them, greedy
output is the same token for token from disk, from RAM and computed cold, for
every KV cache dtype, and the blocks count as cached tokens."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_hf_model

from stoker import LLM, SamplingParams
from stoker.config import EngineConfig
from stoker.engine import kv_disk_tier
from stoker.engine.kv_cache import BlockPool
from stoker.engine.kv_disk import DiskBlockStore, DiskLayout, StoredBlock, block_file_bytes
from stoker.engine.kv_disk_tier import DISK_MEDIUM, DiskTier
from stoker.engine.kv_events import MEDIUM, BlockRemoved, BlockStored, KVEventLog
from stoker.engine.params import EngineCoreRequest, RequestOutput
from stoker.models.kv_quant import KV_FORMATS

KV_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int8: "int8",
    torch.float8_e4m3fn: "fp8_e4m3",
}
BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SHARED = list(range(100, 141))  # 41 tokens: 10 full blocks and one more token


def test_every_kv_dtype_is_covered() -> None:
    assert set(KV_DTYPE_NAMES) == set(KV_FORMATS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("kv-disk-model"))


def engine(tiny: Path, disk: Path | None, kv_cache_dtype: str = "float32", **overrides: object) -> LLM:
    args: dict[str, object] = {
        "dtype": "float32",
        "kv_cache_dtype": kv_cache_dtype,
        "num_kv_blocks": 64,
        "block_size": BLOCK_SIZE,
        "speculative_method": "none",
        **overrides,
    }
    if disk is not None:
        args["kv_cache_disk"] = str(disk)
        args["kv_cache_disk_size"] = "64MiB"
    return LLM(str(tiny), **args)


def prompts() -> list[list[int]]:
    return [SHARED + [7, 8, 9], SHARED + [200 + i for i in range(9)]]


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("kv_cache_dtype", list(KV_DTYPE_NAMES.values()))
def test_greedy_output_is_the_same_cold_from_ram_and_from_disk(tiny: Path, tmp_path: Path, kv_cache_dtype: str) -> None:
    first = engine(tiny, tmp_path, kv_cache_dtype)
    cold = first.generate(prompts()[:1], GREEDY)
    assert cold[0].num_cached_tokens == 0
    from_ram = first.generate(prompts(), GREEDY)
    # The second prompt shares the first's 10 full blocks; the first repeats all of its own.
    assert [o.num_cached_tokens for o in from_ram] == [40, 40]
    # Looked up on disk twice, past the RAM hits: the cold prompt, and the second prompt's own tail.
    assert (first.engine.stats().kv_disk_hits, first.engine.stats().kv_disk_misses) == (0, 2)
    first.engine.close()  # the queued blocks are written
    written = first.engine.stats()
    assert written.kv_disk_bytes_written > 0 and written.kv_disk_pending_writes == 0

    restarted = engine(tiny, tmp_path, kv_cache_dtype)
    from_disk = restarted.generate(prompts(), GREEDY)
    # Both prompts ran before the restart: every full block before each last token is on disk.
    assert [o.num_cached_tokens for o in from_disk] == [40, 48]
    stats = restarted.engine.stats()
    assert stats.kv_disk_hits == 12 and stats.kv_disk_corrupt_dropped == 0
    assert stats.prefix_cache_hits == 88  # disk blocks count as prefix-cache hits
    restarted.engine.close()

    baseline = engine(tiny, None, kv_cache_dtype).generate(prompts(), GREEDY)
    assert tokens(from_disk) == tokens(from_ram) == tokens(baseline)
    assert tokens(cold) == tokens(baseline)[:1]


def test_blocks_evicted_from_ram_come_back_from_disk(tiny: Path, tmp_path: Path) -> None:
    """A RAM cache too small for two prompts: the first's blocks are evicted by the
    second's, written to disk, and read back when the first comes again."""
    llm = engine(tiny, tmp_path, num_kv_blocks=16)
    a = [list(range(300, 341))]
    b = [list(range(500, 541))]
    first = llm.generate(a, GREEDY)
    llm.generate(b, GREEDY)
    assert llm.engine.disk is not None
    llm.engine.disk.store.flush()
    again = llm.generate(a, GREEDY)
    assert again[0].num_cached_tokens == 40
    assert tokens(again) == tokens(first)
    # A sequence's tail leaves RAM first: a's first 3 blocks were still there, the other 7 came from disk.
    assert llm.engine.stats().kv_disk_hits == 7
    llm.engine.close()


def test_corrupt_block_files_are_computed_instead(tiny: Path, tmp_path: Path) -> None:
    llm = engine(tiny, tmp_path)
    cold = llm.generate(prompts()[:1], GREEDY)
    llm.engine.close()
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) >= 10
    for path in files:  # every block file damaged, as a crash mid-write on a bad disk could leave them
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    restarted = engine(tiny, tmp_path)
    again = restarted.generate(prompts()[:1], GREEDY)
    assert again[0].num_cached_tokens == 0 and tokens(again) == tokens(cold)
    stats = restarted.engine.stats()
    assert stats.kv_disk_corrupt_dropped == 1 and stats.kv_disk_hits == 0  # the chain stops at its first block
    restarted.engine.close()


def test_prompt_logprobs_requests_never_read_from_disk(tiny: Path, tmp_path: Path) -> None:
    llm = engine(tiny, tmp_path)
    llm.generate(prompts()[:1], GREEDY)
    llm.engine.close()
    restarted = engine(tiny, tmp_path)
    scored = restarted.generate(prompts()[:1], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    assert scored[0].num_cached_tokens == 0 and restarted.engine.stats().kv_disk_hits == 0
    restarted.engine.close()


def test_disk_size_below_one_block_is_refused(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--kv-cache-disk-size 100 is below one KV block"):
        LLM(str(tiny), dtype="float32", kv_cache_disk=str(tmp_path), kv_cache_disk_size=100)


def test_config_bounds(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such folder"):
        EngineConfig(kv_cache_disk=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="larger than the disk"):
        EngineConfig(kv_cache_disk=str(tmp_path), kv_cache_disk_size="1000PB")
    with pytest.raises(ValueError, match="needs kv_cache_disk"):
        EngineConfig(kv_cache_disk_size="1GB")
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineConfig(kv_cache_disk=str(tmp_path), enable_prefix_caching=False)


def test_a_hung_disk_read_is_given_up_and_the_prefix_computed(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = engine(tiny, tmp_path)
    cold = llm.generate(prompts()[:1], GREEDY)
    llm.engine.close()
    restarted = engine(tiny, tmp_path)
    assert restarted.engine.disk is not None
    store = restarted.engine.disk.store
    release = threading.Event()
    read = store.read

    def read_that_hangs(block_hash: bytes) -> StoredBlock | None:
        release.wait(30)
        return read(block_hash)

    monkeypatch.setattr(store, "read", read_that_hangs)
    monkeypatch.setattr(kv_disk_tier, "LOAD_TIMEOUT_S", 0.3)
    started = time.monotonic()
    again = restarted.generate(prompts()[:1], GREEDY)
    release.set()
    assert time.monotonic() - started < 10
    assert again[0].num_cached_tokens == 0 and tokens(again) == tokens(cold)
    tier = restarted.engine.disk
    assert tier.num_load_timeouts == 1
    # The stuck read keeps the blocks it copies into until it lets go of them, then they are free again.
    held = restarted.engine.kv.num_used_blocks
    assert held > 0
    tier._reader.submit(lambda: None).result(timeout=30)  # the reader has finished the stuck read
    tier.reap()
    assert restarted.engine.kv.num_used_blocks == 0
    restarted.engine.close()


@pytest.mark.parametrize("copies", ["numpy", "torch"])
def test_kv_events_name_the_disk_medium(tmp_path: Path, copies: str) -> None:
    """A block the writer stores (and later evicts) is announced as medium DISK,
    never merged into the RAM tier's events; its file holds the block's K then V
    bytes, which load back in place. `torch`: the copies a cache off the CPU takes."""
    k = torch.arange(8 * BLOCK_SIZE * 2, dtype=torch.float32).view(8, BLOCK_SIZE, 1, 2)
    v = k + 1000
    layout = DiskLayout("sha256:test", "float32", BLOCK_SIZE, 2 * BLOCK_SIZE * 2 * 4)
    events = KVEventLog(BLOCK_SIZE)
    pool = BlockPool(8, events=events)
    store = DiskBlockStore(tmp_path, 2 * block_file_bytes(layout), layout)
    tier = DiskTier(store, [(k, v)], pool, BLOCK_SIZE, events)
    if copies == "torch":
        tier._bytes._host_views = None
    parent = None
    blocks = []
    for i in range(3):
        (block,) = pool.allocate(1)
        parent = pool.cache_block(block, parent, tuple(range(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)))
        pool.free([block])  # leaves RAM: spilled
        blocks.append(block)
    store.flush()
    tier.record_events()
    taken = events.take()
    ram = [e for e in taken if isinstance(e, BlockStored) and e.medium == MEDIUM]
    disk_stored = [e for e in taken if isinstance(e, BlockStored) and e.medium == DISK_MEDIUM]
    disk_removed = [e for e in taken if isinstance(e, BlockRemoved) and e.medium == DISK_MEDIUM]
    assert sum(len(e.block_hashes) for e in ram) == 3
    assert sum(len(e.block_hashes) for e in disk_stored) == 3
    assert sum(len(e.block_hashes) for e in disk_removed) == 1  # the store holds two blocks
    last = blocks[-1]
    assert last.block_hash is not None
    read = store.read(last.block_hash)
    assert read is not None
    assert bytes(read.payload) == k[last.block_id].numpy().tobytes() + v[last.block_id].numpy().tobytes()
    want_k, want_v = k[last.block_id].clone(), v[last.block_id].clone()
    k[last.block_id] = 0
    v[last.block_id] = 0
    tier._bytes.write(last.block_id, read.payload)
    assert torch.equal(k[last.block_id], want_k) and torch.equal(v[last.block_id], want_v)
    tier.close()


def test_a_request_waiting_for_disk_never_holds_up_the_others(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one request's blocks are being read (here: a read held back), another
    request is admitted, decodes and finishes; then the first is served from disk."""
    llm = engine(tiny, tmp_path)
    cold = llm.generate(prompts()[:1], GREEDY)
    llm.engine.close()
    core = engine(tiny, tmp_path).engine
    assert core.disk is not None
    release = threading.Event()
    read = core.disk.store.read

    def read_when_released(block_hash: bytes) -> StoredBlock | None:
        release.wait(30)
        return read(block_hash)

    monkeypatch.setattr(core.disk.store, "read", read_when_released)
    core.add_request(EngineCoreRequest("from-disk", prompts()[0], GREEDY, time.time()))
    core.add_request(EngineCoreRequest("other", list(range(900, 910)), GREEDY, time.time()))
    received: dict[str, list[int]] = {"from-disk": [], "other": []}
    done: set[str] = set()
    for _ in range(200):
        for delta in core.step():
            received[delta.request_id].extend(delta.new_token_ids)
            if delta.finished:
                done.add(delta.request_id)
        if "other" in done:
            break
    assert done == {"other"} and len(received["other"]) == GREEDY.max_tokens and received["from-disk"] == []
    assert core.disk.loading
    release.set()
    while core.has_unfinished_requests():
        for delta in core.step():
            received[delta.request_id].extend(delta.new_token_ids)
    assert received["from-disk"] == tokens(cold)[0]
    assert core.stats().kv_disk_hits == 10
    core.close()
