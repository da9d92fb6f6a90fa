"""`stoker serve` asks the kernel to read its models' weight files while it starts
(stoker/models/readahead.py): the pages are resident afterwards, checked with
mincore(2); nothing is asked for files that would not fit, or that are not there."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest

from stoker.models import readahead

PAGE = mmap.PAGESIZE


def resident_share(path: Path) -> float:
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        try:
            pages = -(-size // PAGE)
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec.raw) / pages
        finally:
            libc.munmap(addr, size)


def evicted(path: Path) -> Path:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if resident_share(path) > 0.5:
        pytest.skip(f"{path.parent}'s file system keeps its pages (tmpfs?): nothing to read ahead")
    return path


def test_a_models_weights_are_in_the_page_cache_after_the_read_ahead(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    (folder / ".git").mkdir(parents=True)
    weights = folder / "model.safetensors"
    weights.write_bytes(os.urandom(8 << 20))
    (folder / "README.md").write_text("not weights")
    (folder / ".git" / "pack.bin").write_bytes(b"hidden")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(os.urandom(4 << 20))
    assert readahead.weight_files(str(folder)) == [weights]
    evicted(weights), evicted(gguf)
    thread = readahead.start_readahead([str(folder), str(gguf)])
    assert thread is not None
    thread.join(30)
    deadline = time.monotonic() + 10  # the advice queues the reads; they land shortly after
    while min(resident_share(weights), resident_share(gguf)) < 0.9:
        assert time.monotonic() < deadline, (resident_share(weights), resident_share(gguf))
        time.sleep(0.05)


def test_nothing_is_read_ahead_that_would_not_fit_or_is_not_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = tmp_path / "m.gguf"
    weights.write_bytes(os.urandom(4 << 20))
    evicted(weights)
    monkeypatch.setattr(readahead, "memory_available", lambda: 6 << 20)  # half of it is less than the file
    assert readahead.start_readahead([str(weights)]) is None
    time.sleep(0.2)
    assert resident_share(weights) < 0.5
    monkeypatch.undo()
    assert readahead.start_readahead([str(tmp_path / "missing.gguf")]) is None
    (tmp_path / "no-weights").mkdir()
    assert readahead.start_readahead([str(tmp_path / "no-weights")]) is None


def rss_file_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(
    tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit()) < (5, 14),
    reason="MADV_POPULATE_READ arrived in Linux 5.14",
)
def test_a_mapping_is_populated_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's weight ranges are mapped into the process while the rest loads:
    their pages count in the process's resident memory without being touched, and
    a range left out (an untied embedding) does not."""
    path = tmp_path / "weights.gguf"
    path.write_bytes(os.urandom(48 << 20))
    mapping = np.memmap(path, dtype=np.uint8, mode="r")
    before = rss_file_bytes()
    # Two neighbouring ranges (one call), one apart from them; the 16 MiB between left out.
    ranges = [(100, (8 << 20) - 100), (8 << 20, 8 << 20), (32 << 20, 16 << 20)]
    thread = readahead.populate_in_background(mapping, ranges)
    assert thread is not None
    thread.join(timeout=30)
    grown = rss_file_bytes() - before
    assert (32 << 20) - 2 * PAGE <= grown < 40 << 20
    monkeypatch.setattr(readahead, "memory_available", lambda: 32 << 20)  # below twice the ranges' 32 MiB
    assert readahead.populate_in_background(mapping, ranges) is None


@pytest.mark.parametrize("packing", [True, False], ids=["packing", "blocks"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_engine_populates_what_every_step_reads_from_the_mapping(
    tmp_path: Path, arch: str, packing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Everything but what the loader copies (llama's q and k, their rows reordered;
    the weights repacked for the GEMM where the kernels pack their type) or reads a
    few rows of (an untied embedding; this one is tied, so it counts)."""
    from gguf import GGMLQuantizationType
    from quant_models import write_quant_gguf

    from stoker.models.gguf_loader import _gguf_meta, _read_every_step
    from stoker.models.quant.weights import packs

    if not packing:
        monkeypatch.setenv("STOKER_DISABLE_PACKED_GGML", "1")
    path = write_quant_gguf(tmp_path / f"{arch}.gguf", arch, {}, GGMLQuantizationType.Q4_K)
    meta = _gguf_meta(str(path))
    populated = set(_read_every_step(meta))
    assert populated
    for t in meta["tensors"]:
        if t["hf"] is None:
            continue
        span = (int(t["offset"]), int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize)
        copied = arch == "llama" and (".q_proj." in t["hf"] or ".k_proj." in t["hf"])
        copied = copied or packs(GGMLQuantizationType(t["type"]))
        assert (span in populated) != copied, t["hf"]
