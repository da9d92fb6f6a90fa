"""Ask the kernel to read a model's weight files before the engine touches them.

The engine maps its weights and its warm-up pass faults every page in, layer by
layer: on a cold page cache that is many small reads (the fault path's read-
around window) instead of one sequential read, and it starts only once the
engine process has imported torch. posix_fadvise(WILLNEED), issued when
`stoker serve` has read its options, starts the whole file's read at once, in
large requests, while both processes import. Only where the files fit well
within the memory available: a file larger than that would push out pages
that something else (or the file's own first layers) still needs.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
MEMORY_SHARE = 0.5
"""Share of MemAvailable the files read ahead may take together."""
MADV_POPULATE_READ = 22
"""Linux 5.14's madvise advice that faults a mapping's pages in, read-only, as one call."""


def weight_files(path: str) -> list[Path]:
    """A GGUF file itself, or a folder's weight files (every depth, hidden folders skipped)."""
    if not os.path.isdir(path):
        return [Path(path)]
    found = []
    for dirpath, dirnames, files in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [Path(dirpath) / f for f in files if f.endswith(WEIGHT_SUFFIXES)]
    return sorted(found)


def memory_available() -> int:
    """MemAvailable in bytes; 0 where /proc/meminfo does not say (no read-ahead then)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def start_readahead(paths: list[str]) -> threading.Thread | None:
    """Start reading the models' weight files into the page cache, in a daemon
    thread (the advice can block while it queues the reads); None when they
    would take more than MEMORY_SHARE of the memory available, or a file cannot
    be listed (its engine's start then says why)."""
    if not hasattr(os, "posix_fadvise"):
        return None
    try:
        files = [f for path in paths for f in weight_files(path)]
        total = sum(f.stat().st_size for f in files)
    except OSError:
        return None
    if not files or total > memory_available() * MEMORY_SHARE:
        return None
    thread = threading.Thread(target=_advise, args=(files,), name="stoker-readahead", daemon=True)
    thread.start()
    return thread


def _advise(files: list[Path]) -> None:
    for file in files:
        try:
            # O_NONBLOCK: a path swapped for a FIFO since it was listed is not waited on.
            fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def populate_in_background(mapping: np.memmap, ranges: list[tuple[int, int]]) -> threading.Thread | None:
    """Map the (offset, bytes) ranges of a file mapping into this process in a
    daemon thread, while the engine goes on loading (its tokenizer's parse
    takes ~0.1 s): the warm-up pass otherwise faults them in one page at a time
    on the path to /ready (~0.05 s for a 0.4 GB file). The calls run without
    the GIL (ctypes). None where the ranges would take more than MEMORY_SHARE
    of the memory available (pages the run may need more would be pushed out);
    a kernel without the advice ignores it, and the pages fault in as before."""
    if sum(size for _, size in ranges) > memory_available() * MEMORY_SHARE:
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # no C library with madvise: nothing to ask
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    base = mapping.ctypes.data
    # madvise takes page-aligned starts; neighbouring tensors' ranges are joined into one call.
    spans: list[list[int]] = []
    for offset, size in sorted(ranges):
        start, end = offset - offset % mmap.PAGESIZE, min(offset + size, mapping.nbytes)
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        elif end > start:
            spans.append([start, end])

    def populate() -> None:
        for start, end in spans:
            madvise(base + start, end - start, MADV_POPULATE_READ)

    thread = threading.Thread(target=populate, name="stoker-populate", daemon=True)
    thread.start()
    return thread
