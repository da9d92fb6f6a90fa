"""Which device and dtypes an engine computes in: the served model's, a draft
model's and the KV cache's, from the config's names ("auto" or a dtype)."""

from __future__ import annotations

import torch

from stoker.models.cpu_kernels import cpu_flags

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, "bf16": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_kv_dtype(name: str, dtype: torch.dtype, quantized_weights: bool) -> torch.dtype:
    if name != "auto":
        return _KV_DTYPES[name]
    # Quantized weights compute in float32 on the CPU, but a float32 cache
    # only doubles the bytes each decode step reads: bf16 keys and values
    # scored the same perplexity (68.17 vs 68.19 on docs/architecture.md) and
    # decode faster, as llama.cpp's default f16 cache does.
    if quantized_weights and dtype == torch.float32:
        return torch.bfloat16
    return dtype


def resolve_dtype(name: str, device: torch.device, quantized_weights: bool = False) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    # Weights kept in GGML blocks: the int8 kernels and the fused decoder take
    # float32 activations (bf16 would only add rounding and conversions), as
    # llama.cpp computes in float32 between its quantized matmuls.
    if quantized_weights:
        return torch.float32
    # bf16 only pays on CPUs with native bf16 matmul (AMX / AVX512-BF16).
    return (
        torch.bfloat16
        if torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]  # untyped in torch
        and bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})
        else torch.float32
    )
