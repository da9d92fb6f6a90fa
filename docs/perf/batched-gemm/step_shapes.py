"""Each product of a Llama-3.2-1B Q4_K_M layer (and its LM head), or of the 3B or
8B rung's layer with RUNG=3b / RUNG=8b, at the row counts of a batched step or a
prefill chunk, through builds of ggml_quant.c
loaded side by side and called in turn (so a contended machine's drift hits
each build alike), beside torch's fp32 and bf16 matmul on the same shape.

    F="-O3 -march=x86-64 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni \
       -fno-math-errno -fno-trapping-math -ffp-contract=off -fPIC -shared -fopenmp"
    gcc $F BASE/stoker/models/csrc/ggml_quant.c -o /tmp/q0.so
    gcc $F stoker/models/csrc/ggml_quant.c -o /tmp/qa.so
    M=16,32,64,512 TORCH=1 python docs/perf/batched-gemm/step_shapes.py /tmp/q0.so /tmp/qa.so
    RUNG=3b THREADS=1,2 M=512 STAT=min python docs/perf/batched-gemm/step_shapes.py /tmp/q0.so /tmp/qa.so

THREADS takes one count or several (each shape is run at each).

GOP/s counts 2 * m * n * k operations per product; ms is the median of REPEATS calls,
or their minimum with STAT=min (steadier on a machine shared with other jobs).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType

from stoker.bench.kernels import time_call
from stoker.models.quant.blocks import random_blocks
from stoker.models.quant.kernels import declare_signatures

T = GGMLQuantizationType
Shape = tuple[str, int, int, GGMLQuantizationType]
# (name, n, k, type): q and k, and gate and up, are joined into one matrix each at load.
# v and down are Q6_K in about half of a Q4_K_M file's layers and Q4_K in the rest.
SHAPES: dict[str, tuple[Shape, ...]] = {
    "1b": (
        ("q+k", 2560, 2048, T.Q4_K),
        ("v", 512, 2048, T.Q6_K),
        ("o", 2048, 2048, T.Q4_K),
        ("gate+up", 16384, 2048, T.Q4_K),
        ("down", 2048, 8192, T.Q4_K),
        ("down", 2048, 8192, T.Q6_K),
        ("lm_head", 128256, 2048, T.Q6_K),
    ),
    "3b": (
        ("q+k", 4096, 3072, T.Q4_K),
        ("v", 1024, 3072, T.Q4_K),
        ("v", 1024, 3072, T.Q6_K),
        ("o", 3072, 3072, T.Q4_K),
        ("gate+up", 16384, 3072, T.Q4_K),
        ("down", 3072, 8192, T.Q4_K),
        ("down", 3072, 8192, T.Q6_K),
    ),
    "8b": (
        ("q+k", 5120, 4096, T.Q4_K),
        ("v", 1024, 4096, T.Q4_K),
        ("v", 1024, 4096, T.Q6_K),
        ("o", 4096, 4096, T.Q4_K),
        ("gate+up", 28672, 4096, T.Q4_K),
        ("down", 4096, 14336, T.Q4_K),
        ("down", 4096, 14336, T.Q6_K),
    ),
}


def main() -> None:
    libs = {os.path.basename(path): declare_signatures(ctypes.CDLL(path)) for path in sys.argv[1:]}
    ms = [int(v) for v in os.environ.get("M", "16,32,64,512").split(",")]
    repeats = int(os.environ.get("REPEATS", "9"))
    thread_counts = [int(v) for v in os.environ.get("THREADS", "2").split(",")]
    shapes = SHAPES[os.environ.get("RUNG", "1b")]
    only = os.environ.get("ONLY", "")
    with_torch = os.environ.get("TORCH") == "1"
    stat = np.min if os.environ.get("STAT") == "min" else np.median
    for (name, n, k, qtype), threads in ((shape, t) for shape in shapes for t in thread_counts):
        if only and name not in only.split(","):
            continue
        torch.set_num_threads(threads)
        w = np.ascontiguousarray(random_blocks(qtype, n, k, 0))
        w_f32 = torch.randn(n, k) if with_torch else None
        for m in ms:
            if name == "lm_head" and m > 64:
                continue  # the LM head sees one row per sequence
            x = np.random.default_rng(m).standard_normal((m, k), dtype=np.float32)
            y = np.zeros((m, n), np.float32)
            times: dict[str, list[float]] = {label: [] for label in libs}
            for _ in range(repeats):
                for label, lib in libs.items():
                    started = time.perf_counter()
                    lib.ggml_quant_matmul(
                        int(qtype), x.ctypes.data, 0, m, k, w.ctypes.data, n, y.ctypes.data, n, threads
                    )
                    times[label].append(time.perf_counter() - started)
            ops = 2.0 * m * n * k
            cells = [f"{label} {stat(t) * 1e3:7.2f} ms {ops / stat(t) / 1e9:5.0f} GOP/s" for label, t in times.items()]
            if w_f32 is not None:
                xt = torch.from_numpy(x)
                f32 = time_call(lambda xt=xt, wf=w_f32: torch.nn.functional.linear(xt, wf), 0)
                wb, xb = w_f32.bfloat16(), xt.bfloat16()
                bf16 = time_call(lambda xb=xb, wb=wb: torch.nn.functional.linear(xb, wb), 0)
                cells += [f"torch fp32 {ops / f32 / 1e9:5.0f}", f"bf16 {ops / bf16 / 1e9:5.0f} GOP/s"]
            print(f"{name:8} {qtype.name} {n}x{k} m={m:4} t={threads}", " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
