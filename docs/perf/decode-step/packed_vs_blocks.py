"""One product of a ladder rung's shape from the GGUF blocks and from the same
weights repacked into the GEMM's panel order (kernels.ggml_pack), alternating,
weights from memory: each call cycles through copies totalling at least 96 MB
(three times a 32 MB L3; COLD_MB sets it), so none finds its weight cached. Median of REPEATS.

    THREADS=1,2 M=1,2,3,4,8,16,64,512 python docs/perf/decode-step/packed_vs_blocks.py

The 1B rung's Q4_K gate+up, o and down, the 0.5B rung's Q8_0 LM head (tied,
151936 x 896) and a Q8_0 of its width, its Q5_0 gate+up, down and o, and the
1B's gate+up and down in Q4_0, and its Q6_K LM head (tied, 128256 x 2048), down
and v; TYPES=Q4_K, Q8_0, Q5_0, Q4_0 or Q6_K picks (a comma-separated list).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from stoker.models.quant.blocks import random_blocks
from stoker.models.quant.kernels import ggml_matmul, ggml_matmul_packed, ggml_pack, quant_isa

SHAPES = [
    ("gate+up", 16384, 2048, T.Q4_K),
    ("o", 2048, 2048, T.Q4_K),
    ("down", 2048, 8192, T.Q4_K),
    ("lm_head", 151936, 896, T.Q8_0),
    ("qkv", 1152, 896, T.Q8_0),
    ("gate+up", 9728, 896, T.Q5_0),
    ("down", 896, 4864, T.Q5_0),
    ("o", 896, 896, T.Q5_0),
    ("gate+up", 16384, 2048, T.Q4_0),
    ("down", 2048, 8192, T.Q4_0),
    ("lm_head", 128256, 2048, T.Q6_K),
    ("down", 2048, 8192, T.Q6_K),
    ("v", 512, 2048, T.Q6_K),
]
COLD_BYTES = float(os.environ.get("COLD_MB", "96")) * 1e6


def main() -> None:
    threads = [int(t) for t in os.environ.get("THREADS", "2").split(",")]
    rows = [int(m) for m in os.environ.get("M", "1,2,3,4,8,16,64,512").split(",")]
    repeats = int(os.environ.get("REPEATS", "7"))
    print(f"path {quant_isa()}; ms per product, median of {repeats}")
    print("| weight | type | n x k | threads | rows | blocks | packed | blocks ÷ packed |")
    print("|---|---|---|---|---|---|---|---|")
    types = os.environ.get("TYPES", "Q4_K,Q8_0,Q5_0,Q4_0,Q6_K").split(",")
    for name, n, k, qtype in (shape for shape in SHAPES if shape[3].name in types):
        first = torch.from_numpy(random_blocks(qtype, n, k, seed=1))
        copies = int(COLD_BYTES // first.numel()) + 1
        blocks = [first] + [first.clone() for _ in range(copies - 1)]
        packed = [ggml_pack(b, qtype) for b in blocks]
        for nt in threads:
            torch.set_num_threads(nt)
            for m in rows:
                x = torch.randn(m, k)
                times: dict[str, list[float]] = {"blocks": [], "packed": []}
                for r in range(repeats):
                    i = r % copies
                    t = time.perf_counter()
                    ggml_matmul(x, blocks[i], qtype)
                    times["blocks"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    ggml_matmul_packed(x, packed[i], qtype, n)  # type: ignore[arg-type]
                    times["packed"].append(time.perf_counter() - t)
                a, b = (float(np.median(times[v])) * 1e3 for v in ("blocks", "packed"))
                print(
                    f"| {name} | {qtype.name} | {n} x {k} | {nt} | {m} | {a:.2f} | {b:.2f} | {a / b:.2f}x |", flush=True
                )


if __name__ == "__main__":
    main()
