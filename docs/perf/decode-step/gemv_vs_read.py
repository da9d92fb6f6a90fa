"""Is the one-row matmul (m = 1, a decode step's) bound by memory or by arithmetic? Each of a
GGUF's weight kinds, all layers' tensors in turn (more bytes than the L3 cache), through
ggml_quant_matmul, beside one plain read of the same bytes (an int64 sum), alternating, best of 7.

    python docs/perf/decode-step/gemv_vs_read.py MODEL.gguf THREADS
"""

import os
import sys
import time

import torch
from gguf import GGUFReader

from stoker.models.quant.kernels import ggml_matmul

path, threads = os.path.expanduser(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
groups: dict[tuple[str, object], list] = {}
for t in GGUFReader(path).tensors:
    kind = t.name.split(".")[-2] if t.name.startswith("blk") else t.name.split(".")[0]
    groups.setdefault((kind, t.tensor_type), []).append(t)


def read(weights: list[torch.Tensor]) -> int:
    return sum(int(w.reshape(-1)[: w.numel() // 8 * 8].view(torch.int64).sum()) for w in weights)


for (kind, qtype), tensors in sorted(groups.items(), key=lambda kv: -sum(int(t.n_bytes) for t in kv[1])):
    if qtype.name == "F32":
        continue
    weights = [torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(int(t.shape[1]), -1) for t in tensors]
    x = torch.randn(1, int(tensors[0].shape[0]))
    nbytes = sum(w.numel() for w in weights)
    gemv = plain = 1e9
    for _ in range(7):
        start = time.perf_counter()
        for w in weights:
            ggml_matmul(x, w, qtype)
        gemv = min(gemv, time.perf_counter() - start)
        start = time.perf_counter()
        read(weights)
        plain = min(plain, time.perf_counter() - start)
    print(
        f"{kind:12s} {qtype.name:5s} {len(weights):3d}x {nbytes / 1e6:7.1f} MB  matmul {nbytes / gemv / 1e9:5.1f} GB/s"
        f"  read {nbytes / plain / 1e9:5.1f} GB/s  matmul / read time {gemv / plain:.2f}"
    )
