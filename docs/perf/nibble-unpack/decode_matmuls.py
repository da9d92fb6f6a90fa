"""ggml_matmul at decode batch sizes (16 and 32 rows, the GEMM path), the best
of 7 x 5 calls, for the default model's shapes (Q8_0 lm_head, Q4_1 layers)
and a few other formats. `PYTHONPATH=TREE python decode_matmuls.py` to time
another tree; one line of figures."""

import time

import torch
from gguf import GGMLQuantizationType as T

from stoker.bench.kernels import random_blocks
from stoker.models.quant.kernels import ggml_matmul

torch.manual_seed(0)
res = []
for qt, n, k in (
    (T.Q8_0, 49152, 576),
    (T.Q4_1, 3072, 576),
    (T.Q4_K, 3072, 1536),
    (T.Q6_K, 4096, 1536),
    (T.Q5_0, 3072, 576),
):
    w = torch.from_numpy(random_blocks(qt, n, k, seed=1))
    for m in (16, 32):
        x = torch.randn(m, k)
        ggml_matmul(x, w, qt)
        best = 1e9
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(5):
                ggml_matmul(x, w, qt)
            best = min(best, (time.perf_counter() - t) / 5)
        res.append(f"{qt.name} {n}x{k} m={m}: {best * 1e3:.3f} ms")
print(" | ".join(res))
