"""The LM head's product at the row counts of a decode step (one row per
sequence), on the ladder rungs' real shapes and types, beside the same type's
other products and a plain read of the same bytes, through builds of
ggml_quant.c loaded side by side and called in turn (a shared machine's drift
hits each build alike).

    F="-O3 -march=x86-64 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni \
       -fno-math-errno -fno-trapping-math -ffp-contract=off -fPIC -shared -fopenmp"
    gcc $F BASE/stoker/models/csrc/ggml_quant.c -o /tmp/q0.so
    gcc $F stoker/models/csrc/ggml_quant.c -o /tmp/qa.so
    THREADS=1,2 M=1,4,8,16,32 python docs/perf/batched-gemm/lm_head.py /tmp/q0.so /tmp/qa.so

In a decode step every weight comes from memory (a 0.5B model's 392 MB are
ten times the L3), so each product cycles through copies of its weight
totalling at least COLD_BYTES (96 MB: three times a 32 MB L3) and no call finds
its weight cached; the LM heads (145 and 270 MB) are larger than that alone.
GOP/s counts 2 * m * n * k operations, GB/s the weight's bytes over the time;
"read" is torch's sum over the same bytes (as int64) on as many threads: what
streaming them costs with no arithmetic. Each figure is the median of REPEATS
calls (STAT=min: their minimum).

HOT_MB=8 instead keeps each weight in cache: its rows cut to at most that many
MB and one copy, so every call after the first finds it in L3. What a build
makes there is the rate its instructions allow, the ceiling it would meet on a
machine whose memory reads faster than this one's.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType

from stoker.models.quant.blocks import random_blocks
from stoker.models.quant.kernels import declare_signatures

T = GGMLQuantizationType
# (rung, name, n, k, type): each rung's LM head (the tied embedding table) and
# that type's other products in the rung's layers (gate and up joined at load).
SHAPES: tuple[tuple[str, str, int, int, GGMLQuantizationType], ...] = (
    ("0.5B", "lm_head", 151936, 896, T.Q8_0),
    ("0.5B q8_0", "gate+up", 9728, 896, T.Q8_0),
    ("0.5B q8_0", "down", 896, 4864, T.Q8_0),
    ("0.5B", "gate+up", 9728, 896, T.Q5_0),
    ("135M", "gate+up", 3072, 576, T.Q4_1),
    ("1B", "lm_head", 128256, 2048, T.Q6_K),
    ("1B", "down", 2048, 8192, T.Q6_K),
    ("1B", "v", 512, 2048, T.Q6_K),
    ("1B", "gate+up", 16384, 2048, T.Q4_K),
    ("1B", "down", 2048, 8192, T.Q4_K),
    ("3B", "gate+up", 16384, 3072, T.Q4_K),
    ("8B", "gate+up", 28672, 4096, T.Q4_K),
    ("8B", "down", 4096, 14336, T.Q4_K),
    ("8B", "down", 4096, 14336, T.Q6_K),
)
COLD_BYTES = 96 << 20


def weight_copies(qtype: GGMLQuantizationType, n: int, k: int, hot_bytes: int = 0) -> list[np.ndarray]:
    """Copies of one random weight totalling at least COLD_BYTES (one if it is that large alone);
    with hot_bytes, one copy of at most that many bytes (its first rows)."""
    w = np.ascontiguousarray(random_blocks(qtype, n, k, 0))
    if hot_bytes:
        return [np.ascontiguousarray(w[: max(8, hot_bytes // w.shape[1] // 8 * 8)])]
    return [w] + [w.copy() for _ in range(max(0, -(-COLD_BYTES // w.nbytes) - 1))]


def main() -> None:
    libs = {os.path.basename(path): declare_signatures(ctypes.CDLL(path)) for path in sys.argv[1:]}
    ms = [int(v) for v in os.environ.get("M", "1,4,8,16,32").split(",")]
    thread_counts = [int(v) for v in os.environ.get("THREADS", "1,2").split(",")]
    repeats = int(os.environ.get("REPEATS", "7"))
    only = os.environ.get("ONLY", "")
    stat = np.min if os.environ.get("STAT") == "min" else np.median
    hot_bytes = int(float(os.environ.get("HOT_MB", "0")) * 1e6)
    for rung, name, n, k, qtype in SHAPES:
        if only and name not in only.split(","):
            continue
        copies = weight_copies(qtype, n, k, hot_bytes)
        nbytes, n = copies[0].nbytes, copies[0].shape[0]
        for threads in thread_counts:
            torch.set_num_threads(threads)
            reads = []
            for i in range(repeats):
                as_words = torch.from_numpy(copies[i % len(copies)].view(np.int64))
                started = time.perf_counter()
                as_words.sum()
                reads.append(time.perf_counter() - started)
            read = float(stat(reads))
            head = f"{rung:9} {name:8} {qtype.name} {n}x{k} ({nbytes / 1e6:.0f} MB) t={threads}"
            print(f"{head} read {read * 1e3:6.2f} ms {nbytes / read / 1e9:5.1f} GB/s", flush=True)
            for m in ms:
                x = np.random.default_rng(m).standard_normal((m, k), dtype=np.float32)
                y = np.zeros((m, n), np.float32)
                times: dict[str, list[float]] = {label: [] for label in libs}
                calls = 0
                for _ in range(repeats):
                    for label, lib in libs.items():
                        w = copies[calls % len(copies)]
                        calls += 1
                        started = time.perf_counter()
                        lib.ggml_quant_matmul(
                            int(qtype), x.ctypes.data, 0, m, k, w.ctypes.data, n, y.ctypes.data, n, threads
                        )
                        times[label].append(time.perf_counter() - started)
                ops = 2.0 * m * n * k
                cells = []
                for label, t in times.items():
                    s = float(stat(t))
                    cells.append(
                        f"{label} {s * 1e3:7.2f} ms {ops / s / 1e9:5.0f} GOP/s {nbytes / s / 1e9:5.1f} GB/s"
                        f" {s / read:4.1f}x read"
                    )
                print(f"{head} m={m:3}", " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
