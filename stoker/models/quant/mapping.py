"""Giving back the pages of a memory-mapped GGUF that a copy has replaced.

Blocks that are copied at load (q/k rows un-permuted, adjacent parts of a fused
projection joined into one matrix) were read through the file mapping, so
their pages stay mapped in this process and count in its resident memory
beside the copy: twice the bytes for most of a model. MADV_DONTNEED unmaps
them from this process; for a read-only file mapping that loses nothing (the
page cache keeps them, and a later read would fault them back in)."""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

_MADV_DONTNEED = 4  # Linux
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def release_mapped_pages(data: torch.Tensor) -> None:
    """Unmap the whole pages inside `data`'s bytes from this process. Only for a
    tensor viewing a read-only *file* mapping: on anonymous memory this would
    zero the pages. Partial pages at either end are left alone."""
    if _libc is None or not data.is_contiguous() or data.numel() == 0:
        return
    start = data.data_ptr()
    end = start + data.numel() * data.element_size()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
