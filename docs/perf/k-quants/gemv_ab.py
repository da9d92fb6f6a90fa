"""Matrix products of a weight larger than the caches (16384 x 2048 unless
N and K say otherwise) through builds of ggml_quant.c compiled side by side,
called in turn in one process so the VM's drifting memory bandwidth hits each
build alike. M rows of x (1: a single stream's decode step); QT the types.

    F="-O3 -march=x86-64 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni \
       -fno-math-errno -fno-trapping-math -ffp-contract=off -fPIC -shared -fopenmp"
    gcc $F BEFORE/stoker/models/csrc/ggml_quant.c -o /tmp/q0.so
    gcc $F stoker/models/csrc/ggml_quant.c -o /tmp/qa.so
    M=1 N=65536 python docs/perf/k-quants/gemv_ab.py /tmp/q0.so /tmp/qa.so
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import numpy as np
from gguf import GGMLQuantizationType

from stoker.models.quant.blocks import random_blocks
from stoker.models.quant.kernels import declare_signatures

T = GGMLQuantizationType


def main() -> None:
    libs = {path: declare_signatures(ctypes.CDLL(path)) for path in sys.argv[1:]}
    m, n, k = (int(os.environ.get(name, default)) for name, default in (("M", 1), ("N", 16384), ("K", 2048)))
    for name in os.environ.get("QT", "Q4_K,Q6_K,Q4_1,Q8_0").split(","):
        qtype = T[name]
        w = np.ascontiguousarray(random_blocks(qtype, n, k, 0))
        x = np.random.default_rng(0).standard_normal((m, k), dtype=np.float32)
        y = np.zeros((m, n), np.float32)
        times: dict[str, list[float]] = {path: [] for path in libs}
        for _ in range(30):
            for path, lib in libs.items():
                started = time.perf_counter()
                lib.ggml_quant_matmul(int(qtype), x.ctypes.data, 0, m, k, w.ctypes.data, n, y.ctypes.data, n, 2)
                times[path].append(time.perf_counter() - started)
        cells = [
            f"{path}: {np.median(t) * 1e3:.2f} ms, {w.nbytes / np.median(t) / 1e9:.1f} GB/s"
            for path, t in times.items()
        ]
        print(f"m={m} {qtype.name}", " | ".join(cells))


if __name__ == "__main__":
    main()
