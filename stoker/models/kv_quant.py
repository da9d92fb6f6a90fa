"""The quantized KV cache's row format, in one place.

A quantized cache is one tensor per layer and K/V, like a float cache, shaped
[num_blocks, block_size, kv_heads, head_dim + SCALE_BYTES] of a one-byte dtype
(int8 or float8_e4m3fn): each (token, kv head) row is head_dim quantized values
followed by the row's float32 scale in the last four bytes. Keeping the scale
inside the row, rather than in a tensor of its own, means every place that
holds, copies or passes a cache (the runner, the model, the fused decoder, the
draft model) is unchanged, and a kernel finds a row's scale in the cache line
after its values.

Symmetric, per row: scale = max|x| / QMAX, q = round(x / scale) (int8: to
nearest even, as torch.round and C's lrintf; fp8: torch's conversion), and
x ~ q * scale. The C kernels (csrc/kv_format.h, shared by paged_attention.c and
decoder_layer.c) compute the same thing; this module is the reference they are tested against.

Against an int8 cache the queries are rounded through int8 as well, per
(token, head) row and the same way (`quantize_queries`), as llama.cpp does
against its q8_0 cache: q.k is then a sum of integer products, which the fused
decoder computes exactly with int8 dot-product instructions.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
"""A float32 scale per (token, kv head) row."""

QUANTIZED_KV_DTYPES: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
"""One-byte cache dtypes and the largest magnitude each stores (QMAX)."""

KV_FORMATS: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.int8: 1,
    torch.bfloat16: 2,
    torch.float8_e4m3fn: 3,
    torch.float16: 4,
}
"""Every cache dtype the C kernels read, and the code they know it by: the KV_*
enum of csrc/kv_format.h, which holds the row codecs (a test keeps the two
equal). A new KV dtype is a code there, its codec cases, and a line here."""

BF16_QUERY_CACHES = frozenset({torch.bfloat16, torch.int8, torch.float8_e4m3fn})
"""The caches the C attention reads under bf16 queries (float32 queries: any of KV_FORMATS)."""


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_KV_DTYPES


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of `dtype` in one (token, kv head) row of the cache."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> packed rows [..., head_dim + 4] as uint8 bytes."""
    qmax = QUANTIZED_KV_DTYPES[dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # An all-zero row keeps scale 0 and quantizes to zeros; inv stays finite.
    # A true division, as the C kernels' qmax / amax: torch computes a number
    # over a tensor as qmax * (1 / amax), an ulp off in a quarter of rows,
    # enough to round a value near a half the other way.
    inv = torch.where(amax > 0, torch.full_like(amax, qmax) / amax, torch.zeros_like(amax))
    scaled = xf * inv
    if dtype == torch.int8:
        q = scaled.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = scaled.clamp_(-qmax, qmax).to(dtype)
    scale = (amax / qmax).contiguous()
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., head_dim + 4] of `dtype` -> values [..., head_dim] in out_dtype."""
    raw = packed.view(torch.uint8)
    head_dim = raw.shape[-1] - SCALE_BYTES
    values = raw[..., :head_dim].view(dtype).float()
    # A strided 4-byte slice cannot be reinterpreted in place: copy the scales out first.
    scale = raw[..., head_dim:].contiguous().view(torch.float32)
    return (values * scale).to(out_dtype)


def quantize_queries(q: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """What attention over a cache of `cache_dtype` multiplies the keys by: for
    an int8 cache, q [..., head_dim] rounded through int8 per row as a cache
    row is (values times the row's scale, in q's dtype); any other cache, q
    itself. The fused decoder (csrc/decoder_layer.c, quantize_query) keeps the
    integers and sums q.k exactly before scaling; the other paths multiply
    these floats, which differs from it only by float rounding. Measured cost:
    docs/perf/kv-cache-quant.md (perplexity)."""
    if cache_dtype != torch.int8:
        return q
    return dequantize_rows(quantize_rows(q, torch.int8), torch.int8, q.dtype)
