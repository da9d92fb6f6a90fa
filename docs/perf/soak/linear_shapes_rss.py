"""RSS of the model's linear layers (SmolLM2-135M's per-layer weight shapes,
fp32, packed for oneDNN) fed every row count 1..N, twice.

    OMP_NUM_THREADS=1 PYTHONPATH=. python docs/perf/soak/linear_shapes_rss.py 512
    PAD=0 ...   # calls the packed op unpadded: the path before onednn_rows
"""

from __future__ import annotations

import os
import sys
import time

import torch

from stoker.models.layers import Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def main() -> None:
    torch.manual_seed(0)
    layers = [Linear(torch.randn(o, i)) for o, i in SHAPES]
    inputs = {i: torch.randn(512, i) for _, i in SHAPES}
    pad = os.environ.get("PAD", "1") == "1"
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    print("padded" if pad else "unpadded", "start", rss_mib(), "MiB", flush=True)
    for rnd in range(2):
        t = time.perf_counter()
        for m in range(1, n + 1):
            for (o, i), layer in zip(SHAPES, layers):
                x = inputs[i][:m]
                y = layer(x) if pad else torch.ops.mkldnn._linear_pointwise(x, layer.packed, None, "none", [], "")
                assert y.shape == (m, o)
        print(f"pass {rnd}: {rss_mib()} MiB, {time.perf_counter() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
