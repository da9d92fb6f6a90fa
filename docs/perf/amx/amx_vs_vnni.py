"""The K-quants' products on the avx512_amx path against avx512_vnni, alternating in
one process, on a ladder rung's shapes: the 1B's Q4_K gate+up and down (packed,
as served), a Q6_K down of the same shape (the rungs' v and down layers, in
blocks) and a Q5_K of the 1B's width. Checks the two give the same bits. Median
of REPEATS, weights as the GEMM reads them at prompt sizes (from L3 and memory).

    M=16,32,64,512 REPEATS=5 THREADS=2 python docs/perf/amx/amx_vs_vnni.py
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from gguf import GGMLQuantizationType as T

from stoker.models.quant.blocks import random_blocks
from stoker.models.quant.kernels import available_isas, ggml_matmul, ggml_matmul_packed, ggml_pack

SHAPES = [
    ("gate+up (1B)", 16384, 2048, T.Q4_K),
    ("down (1B)", 2048, 8192, T.Q4_K),
    ("down (1B shape)", 2048, 8192, T.Q6_K),
    ("o (1B shape)", 2048, 2048, T.Q5_K),
]
PATHS = ("avx512_vnni", "avx512_amx")


def main() -> None:
    if "avx512_amx" not in available_isas():
        raise SystemExit("this CPU (or its kernel) offers no AMX-INT8 tiles")
    rows = [int(m) for m in os.environ.get("M", "16,32,64,512").split(",")]
    repeats = int(os.environ.get("REPEATS", "5"))
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    print(f"ms per product, median of {repeats}, {torch.get_num_threads()} threads")
    print("| product | type | n x k | rows | avx512_vnni | avx512_amx | vnni ÷ amx | same bits |")
    print("|---|---|---|---|---|---|---|---|")
    for name, n, k, qtype in SHAPES:
        blocks = torch.from_numpy(random_blocks(qtype, n, k, seed=1))
        packed = ggml_pack(blocks, qtype)
        for m in rows:
            x = torch.randn(m, k)
            times: dict[str, list[float]] = {path: [] for path in PATHS}
            results: dict[str, torch.Tensor] = {}
            for _ in range(repeats):
                for path in PATHS:
                    os.environ["STOKER_QUANT_ISA"] = path
                    start = time.perf_counter()
                    y = ggml_matmul_packed(x, packed, qtype, n) if packed is not None else ggml_matmul(x, blocks, qtype)
                    times[path].append(time.perf_counter() - start)
                    assert y is not None
                    results[path] = y
            vnni, amx = (statistics.median(times[path]) * 1e3 for path in PATHS)
            same = torch.equal(results["avx512_vnni"], results["avx512_amx"])
            print(f"| {name} | {qtype.name} | {n} x {k} | {m} | {vnni:.2f} | {amx:.2f} | {vnni / amx:.2f}x | {same} |")


if __name__ == "__main__":
    main()
