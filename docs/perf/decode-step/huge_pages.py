"""One decoding row of the 1B rung's Q6_K LM head (tied, 128256 x 2048, 215 MB)
read from four kinds of memory, one thread, weights from memory (the tensor is
larger than any L3 here): the blocks in a file mapping (as a GGUF serves them),
in numpy's memory (which asks for transparent huge pages itself), in torch's
(4 KiB pages under the default THP setting, "madvise"), and the packed copy
ggml_pack makes (kernels.huge_page_bytes). Median of REPEATS, two rounds.

    REPEATS=7 python docs/perf/decode-step/huge_pages.py
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from stoker.models.quant.blocks import random_blocks
from stoker.models.quant.kernels import ggml_matmul, ggml_matmul_packed, ggml_pack
from stoker.models.quant.weights import from_numpy_readonly

N, K = 128256, 2048


def main() -> None:
    repeats = int(os.environ.get("REPEATS", "7"))
    torch.set_num_threads(1)
    raw = random_blocks(T.Q6_K, N, K, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lm_head.bin"
        raw.tofile(path)
        mapped = from_numpy_readonly(np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape))
        in_numpy = torch.from_numpy(raw)
        in_torch = torch.empty_like(in_numpy)
        in_torch.copy_(in_numpy)
        packed = ggml_pack(in_numpy, T.Q6_K)
        assert packed is not None
        x = torch.randn(1, K)
        kinds: list[tuple[str, Callable[[], object]]] = [
            ("blocks, file mapping", lambda: ggml_matmul(x, mapped, T.Q6_K)),
            ("blocks, numpy memory", lambda: ggml_matmul(x, in_numpy, T.Q6_K)),
            ("blocks, torch.empty", lambda: ggml_matmul(x, in_torch, T.Q6_K)),
            ("packed (huge_page_bytes)", lambda: ggml_matmul_packed(x, packed, T.Q6_K, N)),
        ]
        print(f"ms for one row, median of {repeats}, one thread")
        for round_ in (1, 2):
            for name, product in kinds:
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    product()
                    times.append(time.perf_counter() - start)
                print(f"round {round_}  {name:26s} {statistics.median(times) * 1e3:6.2f}")


if __name__ == "__main__":
    main()
