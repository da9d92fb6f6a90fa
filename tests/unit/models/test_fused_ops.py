"""The fused C element-wise ops give what the unfused torch ops give (the
formulas transformers uses), in fp32 and bf16, including strided inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stoker.models import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load_fused_ops() is None, reason="no C compiler")

DTYPES = [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)]


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rms_norm(dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    h = x.float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = cpu_kernels.fused_rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_mul(dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(1)
    gu = (torch.randn(19, 2 * 96, generator=g) * 6).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # the exp's clamps
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.fused_silu_mul(gu), F.silu(gate) * up, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rotary_reads_strided_rows(dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(2)
    tokens, heads, head_dim, kv = 11, 3, 64, 2
    qkv = torch.randn(tokens, (heads + 2 * kv) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)  # rows strided by the qkv width
    angles = torch.randn(50, head_dim // 2, generator=g)
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.randint(0, 50, (tokens,), generator=g)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want = q * c + torch.cat((-q[..., head_dim // 2 :], q[..., : head_dim // 2]), -1) * s
    got = cpu_kernels.fused_rotary(q, cos, sin, positions)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_unservable_inputs_fall_back() -> None:
    assert (
        cpu_kernels.fused_rms_norm(torch.ones(2, 4, dtype=torch.float16), torch.ones(4, dtype=torch.float16), 1e-6)
        is None
    )
    assert cpu_kernels.fused_rms_norm(torch.ones(4, 2).t(), torch.ones(4), 1e-6) is None  # not contiguous
    assert cpu_kernels.fused_silu_mul(torch.ones(2, 5)) is None  # odd width
