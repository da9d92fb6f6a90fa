"""One-row matrix-vector products of a 16384 x 2048 weight (larger than the
caches), through builds of ggml_quant.c compiled side by side, called in turn
in one process so the VM's drifting memory bandwidth hits each build alike.

    F="-O3 -march=x86-64 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni \
       -fno-math-errno -fno-trapping-math -ffp-contract=off -fPIC -shared -fopenmp"
    gcc $F BEFORE/stoker/models/csrc/ggml_quant.c -o /tmp/q0.so
    gcc $F stoker/models/csrc/ggml_quant.c -o /tmp/qa.so
    python docs/perf/k-quants/gemv_ab.py /tmp/q0.so /tmp/qa.so
"""

from __future__ import annotations

import ctypes
import sys
import time

import numpy as np
from gguf import GGMLQuantizationType

from stoker.models.quant.blocks import random_blocks

T = GGMLQuantizationType


def main() -> None:
    libs = {path: ctypes.CDLL(path) for path in sys.argv[1:]}
    for lib in libs.values():
        lib.ggml_quant_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.ggml_quant_matmul.argtypes += [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    n, k = 16384, 2048
    for qtype in (T.Q4_K, T.Q6_K, T.Q4_1, T.Q8_0):
        w = np.ascontiguousarray(random_blocks(qtype, n, k, 0))
        x = np.random.default_rng(0).standard_normal((1, k), dtype=np.float32)
        y = np.zeros((1, n), np.float32)
        times: dict[str, list[float]] = {path: [] for path in libs}
        for _ in range(30):
            for path, lib in libs.items():
                started = time.perf_counter()
                lib.ggml_quant_matmul(int(qtype), x.ctypes.data, 0, 1, k, w.ctypes.data, n, y.ctypes.data, n, 2)
                times[path].append(time.perf_counter() - started)
        cells = [
            f"{path}: {np.median(t) * 1e3:.2f} ms, {w.nbytes / np.median(t) / 1e9:.1f} GB/s"
            for path, t in times.items()
        ]
        print(qtype.name, " | ".join(cells))


if __name__ == "__main__":
    main()
