"""One K-quant product, packed as served, timed in a loop: the minimum over
SECS seconds (at least 7 calls), one thread, output written into a kept tensor
as the fused decoder writes its own. The tree whose kernels run is the one on
PYTHONPATH; paired_trees.sh runs two of them at once.

    python docs/perf/amx/product_time.py N K M [TYPE]      (TYPE: Q4_K, Q5_K, Q6_K)
"""

from __future__ import annotations

import os
import sys
import time

import torch
from gguf import GGMLQuantizationType as T

from stoker.models.quant.blocks import random_blocks
from stoker.models.quant.kernels import ggml_matmul_packed, ggml_pack, quant_isa


def main() -> None:
    n, k, m = (int(v) for v in sys.argv[1:4])
    qtype = T[sys.argv[4]] if len(sys.argv) > 4 else T.Q4_K
    secs = float(os.environ.get("SECS", "2"))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    packed = ggml_pack(torch.from_numpy(random_blocks(qtype, n, k, seed=1)), qtype)
    if packed is None:
        raise SystemExit(f"{qtype.name} is not packed on the {quant_isa()} path")
    x, y = torch.randn(m, k), torch.empty(m, n)
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < secs or len(times) < 7:
        t = time.perf_counter()
        ggml_matmul_packed(x, packed, qtype, n, out=y)
        times.append(time.perf_counter() - t)
    print(f"{quant_isa()} {qtype.name} {n} x {k}, {m} rows: {min(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
