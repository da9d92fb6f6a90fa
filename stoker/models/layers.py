"""Building blocks of a Llama-family decoder, written to reproduce Hugging Face's
arithmetic (same op order, fp32 where it computes in fp32) so greedy output matches."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from stoker.models.cpu_kernels import fused_rms_norm, fused_rotary, fused_silu_mul


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale.
    fused = fused_rms_norm(x, weight, eps)
    if fused is not None:
        return fused
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's frequency-dependent rope scaling (rope_type "llama3")."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary:
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling or {})
        elif rope_type not in ("default", None):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, llama3)")
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype).to(device)
        self.sin = emb.sin().to(dtype).to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] (rows may be strided); returns a new tensor."""
        fused = fused_rotary(x, self.cos, self.sin, positions)
        if fused is not None:
            return fused
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)


def _pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight re-laid out once in the blocked layout oneDNN's CPU kernels
    read, or None where that is unavailable (another device, a torch without
    the op, STOKER_DISABLE_PACKED_LINEAR=1)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if os.environ.get("STOKER_DISABLE_PACKED_LINEAR") == "1" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        # Its own generator: loading a model must not move the caller's global RNG.
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    want = F.linear(probe, weight)
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
    return packed if torch.allclose(got.float(), want.float(), rtol=tol, atol=tol) else None


class Linear:
    """y = x W^T + b. On CPU the weight is packed once for oneDNN instead of
    F.linear re-packing it on every call: decode-sized matmuls run 1.3x (bf16)
    to 1.7x (fp32) faster. Elsewhere it is F.linear on the weight as given."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.out_features, self.in_features = (int(n) for n in weight.shape)
        self.nbytes = weight.numel() * weight.element_size()
        self.dtype = weight.dtype
        self.packed = _pack_for_onednn(weight)
        # The packed copy replaces the original; keep the original only to fall back on.
        self.weight = weight if self.packed is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def dequantize(self) -> torch.Tensor:
        """W [out, in] in float32 (the reference the quantized formats are checked against).
        The packed layout is opaque, so W^T is read back by multiplying the identity."""
        if self.weight is not None:
            return self.weight.float()
        assert self.packed is not None
        eye = torch.eye(self.in_features, dtype=self.dtype)
        wt: torch.Tensor = torch.ops.mkldnn._linear_pointwise(eye, self.packed, None, "none", [], "")
        return wt.t().float().contiguous()


def gated_mlp(
    x: torch.Tensor,
    gate_up: Callable[[torch.Tensor], torch.Tensor],
    down: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """SwiGLU with gate and up fused into one matmul."""
    gu = gate_up(x)
    fused = fused_silu_mul(gu)
    if fused is not None:
        return down(fused)
    gate, up = gu.chunk(2, dim=-1)
    return down(F.silu(gate) * up)
