"""One KV block's bytes in and out of the KV tensors, in the cache's own layout:
K then V of each layer, the cache's own dtype and rows (scales included). The
disk tier (kv_disk_tier.py) and the KV transfer between prefill and decode
workers (kv_transfer_*.py) move blocks in this form.

A block's rows are contiguous in every tensor, so copying one is a slice per
tensor. Reading a block another thread may copy out is safe while it is
referenced: a full block's rows are never written again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class KVBlockBytes:
    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches
        self._host_views: list[np.ndarray] | None = None
        """Byte views of the KV tensors in CPU memory, K then V of each layer: numpy copies a block's
        rows in about a microsecond where a torch call costs tens (60 of them per block on the default model)."""
        if all(t.device.type == "cpu" for pair in kv_caches for t in pair):
            self._host_views = [t.view(torch.uint8).numpy() for pair in kv_caches for t in pair]

    def read(self, block_id: int) -> memoryview:
        """A copy of the block's bytes."""
        if self._host_views is not None:
            return np.concatenate([view[block_id].reshape(-1) for view in self._host_views]).data
        parts = [t[block_id].view(torch.uint8).reshape(-1) for pair in self.kv_caches for t in pair]
        return torch.cat(parts).cpu().numpy().data

    def write(self, block_id: int, payload: bytes | bytearray | memoryview) -> None:
        """The block's bytes from `payload` (as read returns them)."""
        src = np.frombuffer(payload, dtype=np.uint8)
        offset = 0
        if self._host_views is not None:
            for view in self._host_views:
                part = view[block_id].reshape(-1)  # a view: the block is contiguous
                part[:] = src[offset : offset + part.size]
                offset += part.size
            return
        for k, v in self.kv_caches:
            for tensor in (k, v):
                part = tensor[block_id].view(torch.uint8).reshape(-1)
                part.copy_(torch.from_numpy(src[offset : offset + part.numel()].copy()))
                offset += part.numel()
