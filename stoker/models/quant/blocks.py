"""Valid random GGUF weight blocks for tests and benchmarks: random quant bits
and sub-block scales, with fp16 super-scales (d, m, dmin) chosen so the
dequantized weights are finite and of a trained model's size (|w| up to ~0.5)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_T = GGMLQuantizationType

# Per type: (byte offset of an fp16 field in a block, low, high) for the field's random
# value; every other byte of a block is random bits, which any bit pattern makes valid.
_FP16_FIELDS: dict[GGMLQuantizationType, tuple[tuple[int, float, float], ...]] = {
    _T.Q4_0: ((0, 0.002, 0.02),),  # d; w = d * (q - 8)
    _T.Q4_1: ((0, 0.002, 0.02), (2, -0.15, -0.01)),  # d, m; w = d * q + m
    _T.Q5_0: ((0, 0.001, 0.01),),  # d; w = d * (q - 16)
    _T.Q5_1: ((0, 0.001, 0.01), (2, -0.15, -0.01)),
    _T.Q8_0: ((0, 0.0002, 0.002),),  # d; w = d * q
    _T.Q4_K: ((0, 0.0002, 0.0006), (2, 0.0002, 0.001)),  # d, dmin; w = d * sc * q - dmin * m (sc, m < 64)
    _T.Q5_K: ((0, 0.0001, 0.0003), (2, 0.0002, 0.001)),
    _T.Q6_K: ((208, 0.0001, 0.0002),),  # d; w = d * sc * (q - 32), sc int8
}

SUPPORTED = frozenset(_FP16_FIELDS)


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """[n, row_bytes] uint8: n rows of k weights as valid random `qtype` blocks."""
    if qtype not in _FP16_FIELDS:
        raise ValueError(
            f"random blocks of {qtype.name} are not supported (supported: {sorted(t.name for t in SUPPORTED)})"
        )
    block_elems, type_size = GGML_QUANT_SIZES[qtype]
    if k <= 0 or k % block_elems:
        raise ValueError(f"k={k} is not a positive multiple of {qtype.name}'s {block_elems}-element block")
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // block_elems, type_size), dtype=np.uint8)
    for offset, low, high in _FP16_FIELDS[qtype]:
        values = rng.uniform(low, high, size=(n, k // block_elems)).astype(np.float16)
        blocks[:, :, offset : offset + 2] = values.view(np.uint8).reshape(n, k // block_elems, 2)
    return blocks.reshape(n, -1)
