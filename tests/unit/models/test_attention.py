"""Paged attention: the C decode kernel and the pure-torch path both equal a
naive per-sequence attention over the same tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stoker.models import cpu_kernels
from stoker.models.attention import (
    AttentionInputs,
    AttentionMetadata,
    CPUPagedAttention,
    PrefillChunk,
    TorchSDPAAttention,
    paged_attention,
    select_attention_backend,
    write_kv,
)

BS, KVH, H, D = 4, 2, 6, 16


def _setup(dtype: torch.dtype, lens: list[int], seed: int = 0, D: int = D, BS: int = BS, KVH: int = KVH):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(-(-n // BS) for n in lens) + 3
    k_cache = torch.zeros(num_blocks, BS, KVH, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    # Scatter each sequence over non-contiguous, shuffled blocks.
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, keys, values = [], [], []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // BS))]
        k = torch.randn(n, KVH, D, generator=g).to(dtype)
        v = torch.randn(n, KVH, D, generator=g).to(dtype)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        write_kv(k_cache, v_cache, k, v, slots)
        tables.append(table)
        keys.append(k)
        values.append(v)
    return k_cache, v_cache, tables, keys, values


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [H, D] attends to all of k/v [n, KVH, D]."""
    H, D = q.shape
    KVH = k.shape[1]
    k = k.float().repeat_interleave(H // KVH, dim=1).transpose(0, 1)  # [H, n, D]
    v = v.float().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    scores = (q.float().unsqueeze(1) @ k.transpose(1, 2)) * D**-0.5  # [H, 1, n]
    return (torch.softmax(scores, -1) @ v).squeeze(1)


def _inputs(tables: list[list[int]], lens: list[int], prefills: list[PrefillChunk], BS: int = BS) -> AttentionInputs:
    return AttentionInputs(torch.zeros(0, dtype=torch.long), tables, lens, prefills, BS, 0)


def _decode_meta(tables: list[list[int]], lens: list[int], with_mask: bool, BS: int = BS) -> AttentionMetadata:
    """with_mask: the torch backend (gather + mask); else the C kernel's."""
    backend = TorchSDPAAttention() if with_mask else CPUPagedAttention(D)
    return backend.build_metadata(_inputs(tables, lens, [], BS))


@pytest.mark.parametrize("head_dim", [16, 64, 128], ids=lambda d: f"d{d}")  # 64/128 are specialised in C
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("with_mask", [False, True], ids=["c-kernel", "torch"])
def test_decode_attention_matches_naive(dtype: torch.dtype, tol: float, with_mask: bool, head_dim: int) -> None:
    if not with_mask and cpu_kernels.load_paged_attention() is None:
        pytest.skip("no C compiler")
    lens = [1, 5, 8, 13, 30]
    k_cache, v_cache, tables, keys, values = _setup(dtype, lens, D=head_dim)
    q = torch.randn(len(lens), H, head_dim).to(dtype)
    empty = torch.empty(0, KVH, head_dim)
    meta = _decode_meta(tables, lens, with_mask)
    out = paged_attention(q, empty, empty, k_cache, v_cache, meta, head_dim**-0.5).view(len(lens), H, head_dim)
    for i in range(len(lens)):
        torch.testing.assert_close(out[i].float(), _naive(q[i], keys[i], values[i]), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [5, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (9, 3), (14, 2), (12, 1)], ids=lambda x: str(x))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_kernel_block_and_group_shapes(
    dtype: torch.dtype, tol: float, heads: int, kv_heads: int, block_size: int
) -> None:
    """The vector path walks rows 16 at a time across block edges and serves
    query heads in register groups: lengths and group sizes around those edges."""
    if cpu_kernels.load_paged_attention() is None:
        pytest.skip("no C compiler")
    lens = [1, 15, 16, 17, 32, 33, 64, 100, 160]  # 160 fills its block table row exactly
    k_cache, v_cache, tables, keys, values = _setup(dtype, lens, seed=1, D=64, BS=block_size, KVH=kv_heads)
    q = torch.randn(len(lens), heads, 64).to(dtype)
    empty = torch.empty(0, kv_heads, 64)
    meta = _decode_meta(tables, lens, with_mask=False, BS=block_size)
    out = paged_attention(q, empty, empty, k_cache, v_cache, meta, 64**-0.5).view(len(lens), heads, 64)
    for i in range(len(lens)):
        torch.testing.assert_close(out[i].float(), _naive(q[i], keys[i], values[i]), atol=tol, rtol=tol)


def _naive_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] are the last n positions of k/v [ctx, KVH, D]; causal."""
    n, ctx = q.shape[0], k.shape[0]
    rows = [_naive(q[i], k[: ctx - n + i + 1], v[: ctx - n + i + 1]) for i in range(n)]
    return torch.stack(rows)


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (14, 2), (4, 4)], ids=lambda x: str(x))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefill_kernel_matches_naive_causal(
    dtype: torch.dtype, tol: float, heads: int, kv_heads: int, block_size: int, head_dim: int
) -> None:
    """Several chunks in one step: whole prompts and chunks after a cached
    context, with lengths around the kernel's 16-row and 16-key tiles."""
    if not cpu_kernels.paged_attention_supported(head_dim):
        pytest.skip("no C compiler")
    lens = [1, 16, 33, 70, 41]  # whole contexts
    chunk_lens = [1, 16, 17, 31, 9]  # the last tokens of each are this step's queries
    k_cache, v_cache, tables, keys, values = _setup(dtype, lens, seed=2, D=head_dim, BS=block_size, KVH=kv_heads)
    q = torch.randn(sum(chunk_lens), heads, head_dim).to(dtype)
    chunks, start = [], 0
    for table, ctx, n in zip(tables, lens, chunk_lens):
        chunks.append(PrefillChunk(start, n, ctx, torch.tensor(table), None))
        start += n
    backend = CPUPagedAttention(head_dim)
    meta = backend.build_metadata(_inputs([], [], chunks, block_size))
    empty = torch.empty(0, kv_heads, head_dim)
    out = paged_attention(q, empty, empty, k_cache, v_cache, meta, head_dim**-0.5)
    out = out.view(-1, heads, head_dim)
    for chunk, k, v in zip(chunks, keys, values):
        s, n = chunk.query_start, chunk.query_len
        torch.testing.assert_close(out[s : s + n].float(), _naive_causal(q[s : s + n], k, v), atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prefill_chunk_with_cached_context_is_causal(backend: str) -> None:
    """Either backend (the C one reads the cache in place, SDPA through the mask it builds)."""
    if backend == "cpu" and cpu_kernels.load_paged_attention() is None:
        pytest.skip("no C compiler")
    lens = [11]
    k_cache, v_cache, tables, keys, values = _setup(torch.float32, lens)
    start, n = 6, 5  # the last 5 tokens are this step's chunk
    q = torch.randn(n, H, D)
    chosen = TorchSDPAAttention() if backend == "torch" else CPUPagedAttention(D)
    meta = chosen.build_metadata(_inputs([], [], [PrefillChunk(0, n, 11, torch.tensor(tables[0]))]))
    out = paged_attention(q, keys[0][start:], values[0][start:], k_cache, v_cache, meta, D**-0.5).view(n, H, D)
    for i in range(n):
        visible = start + i + 1
        torch.testing.assert_close(out[i], _naive(q[i], keys[0][:visible], values[0][:visible]))


def test_whole_prompt_prefill_matches_sdpa() -> None:
    n = 9
    q, k, v = torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D)
    meta = TorchSDPAAttention().build_metadata(_inputs([], [], [PrefillChunk(0, n, n, torch.tensor([1, 2, 3]))]))
    out = paged_attention(q, k, v, torch.zeros(4, BS, KVH, D), torch.zeros(4, BS, KVH, D), meta, D**-0.5)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(3, 1).transpose(0, 1),
        v.repeat_interleave(3, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out.view(n, H, D), ref)


def test_backend_selection() -> None:
    """The C kernels serve float32 activations over every cache they read (the fused
    decoder's too) and bf16 ones over bf16 or quantized rows; anything else gets torch SDPA."""
    cpu = torch.device("cpu")
    if cpu_kernels.load_paged_attention() is not None:
        for kv in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn):
            assert isinstance(select_attention_backend(cpu, kv, torch.float32, 64), CPUPagedAttention)
        assert isinstance(select_attention_backend(cpu, torch.bfloat16, torch.bfloat16, 64), CPUPagedAttention)
        assert type(select_attention_backend(cpu, torch.float32, torch.float32, 20)) is TorchSDPAAttention
    chosen = select_attention_backend(cpu, torch.float16, torch.float16, 64)
    assert type(chosen) is TorchSDPAAttention
    assert type(select_attention_backend(cpu, torch.float32, torch.bfloat16, 64)) is TorchSDPAAttention


def _clear_kernel_caches() -> None:
    for loader in (cpu_kernels._build, cpu_kernels._paged_attention_library, cpu_kernels.load_fused_ops):
        loader.cache_clear()


def test_kernel_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_DISABLE_C_KERNELS", "1")
    _clear_kernel_caches()
    try:
        assert cpu_kernels.load_paged_attention() is None
        assert (
            cpu_kernels.paged_decode_attention(
                torch.zeros(1, H, D),
                torch.zeros(2, BS, KVH, D),
                torch.zeros(2, BS, KVH, D),
                torch.ones(1, 1, dtype=torch.long),
                torch.ones(1, dtype=torch.long),
                1.0,
            )
            is None
        )
        assert cpu_kernels.fused_rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6) is None
    finally:
        _clear_kernel_caches()


def test_loading_the_kernel_keeps_subnormals() -> None:
    """A library built with -ffast-math would switch the process to flush-to-zero."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; from stoker.models.cpu_kernels import load_fused_ops, load_paged_attention; "
        "assert load_paged_attention() is not None and load_fused_ops() is not None; "
        "assert sys.float_info.min / 2 > 0, 'subnormals flushed to zero'"
    )
    env = {k: v for k, v in os.environ.items() if k != "STOKER_DISABLE_C_KERNELS"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
