"""The quantized matmul over GGUF blocks, on every ISA path this CPU can run,
against gguf-py's dequantizer and a float64 matmul.

Two references per case:
- exact-activation: x @ W^T with W = gguf.quants.dequantize(blocks). The kernel
  rounds each x to int8 per block (scale d = amax / 127), an error of at most
  d / 2 per element, so |y - ref| <= sum over blocks of (amax / 254) * sum |w|
  in that block: that bound (plus fp32 accumulation and, for bf16, output
  rounding) is the tolerance. It is loose (~1% of |y|), so also
- emulated-activation: the same int8 rounding done in numpy, then float64. Only
  the kernel's fp32 accumulation differs: tolerance 1e-5 of sum |w * xq|.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from stoker.models.quant import kernels
from stoker.models.quant.blocks import random_blocks
from stoker.models.quant.kernels import (
    SUPPORTED_TYPES,
    available_isas,
    exact_kernels,
    ggml_dequantize_rows,
    ggml_matmul,
    ggml_matmul_packed,
    ggml_pack,
    quant_isa,
)

T = GGMLQuantizationType
TYPES = sorted(SUPPORTED_TYPES)
ISAS = available_isas()
pytestmark = pytest.mark.skipif(kernels._library("portable") is None, reason="no C compiler")


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("STOKER_QUANT_ISA", request.param)
    monkeypatch.delenv("STOKER_DISABLE_C_KERNELS", raising=False)
    return str(request.param)


def k_for(qtype: GGMLQuantizationType) -> int:
    return 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 320


def case(
    qtype: GGMLQuantizationType, m: int, n: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, np.ndarray]:
    k = k_for(qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x, random_blocks(qtype, n, k, seed)


def mm(x: torch.Tensor, w: torch.Tensor, qtype: GGMLQuantizationType, out: torch.Tensor | None = None) -> torch.Tensor:
    y = ggml_matmul(x, w, qtype, out)
    assert y is not None
    return y


def activation_bound(x: np.ndarray, w: np.ndarray, block: int) -> np.ndarray:
    """[m, n] bound on |x @ w.T - xq @ w.T| from rounding x to int8 per block."""
    m, k = x.shape
    amax = np.abs(x).reshape(m, k // block, block).max(-1)
    w_l1 = np.abs(w).reshape(w.shape[0], k // block, block).sum(-1)
    bound: np.ndarray = (amax / 254.0) @ w_l1.T
    return bound


def emulate_activations(x: np.ndarray, block: int) -> np.ndarray:
    """x rounded as the kernel rounds it (fp32 scale, round half to even), as float64."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // block, block)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127)
    xq: np.ndarray = (q.astype(np.float64) * d.astype(np.float64)).reshape(m, k)
    return xq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_matches_dequantized_reference(
    isa: str, qtype: GGMLQuantizationType, m: int, dtype: torch.dtype
) -> None:
    n = 37  # odd: not a multiple of the 2-row weight tile
    x, blocks = case(qtype, m, n, dtype)
    y = ggml_matmul(x, torch.from_numpy(blocks), qtype)
    assert y is not None and y.shape == (m, n) and y.dtype == dtype
    got = y.double().numpy()
    w = quants.dequantize(blocks, qtype).astype(np.float64)
    xf = x.double().numpy()
    block = 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 32
    out_rounding = np.abs(xf @ w.T) * 2.0**-8 if dtype == torch.bfloat16 else 0.0
    accumulation = 1e-5 * (np.abs(xf) @ np.abs(w).T)

    exact = xf @ w.T
    bound = 1.001 * activation_bound(xf, w, block) + accumulation + out_rounding
    assert np.all(np.abs(got - exact) <= bound), f"worst excess {np.max(np.abs(got - exact) - bound)}"

    xq = emulate_activations(xf, block)
    tight = 1e-5 * (np.abs(xq) @ np.abs(w).T) + out_rounding
    assert np.all(np.abs(got - xq @ w.T) <= tight), f"worst excess {np.max(np.abs(got - xq @ w.T) - tight)}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_out_as_column_slice_of_wider_tensor(isa: str, qtype: GGMLQuantizationType) -> None:
    x, blocks = case(qtype, 5, 9, torch.float32)
    wide = torch.full((5, 20), float("nan"))
    out = wide[:, 6:15]
    got = ggml_matmul(x, torch.from_numpy(blocks), qtype, out=out)
    assert got is out
    assert torch.equal(wide[:, 6:15], mm(x, torch.from_numpy(blocks), qtype))
    assert wide[:, :6].isnan().all() and wide[:, 15:].isnan().all()


def test_exact_kernels_where_the_build_has_them(isa: str) -> None:
    """The SIMD builds serve every type with the exact kernels (GEMM and small
    tiles, tested above through every m), but AVX2 its Q8_0 (maddubs would
    saturate on its stored + 128 values); the portable path keeps the tile kernels."""
    for qtype in TYPES:
        expected = isa != "portable" and not (isa == "avx2" and qtype == T.Q8_0)
        assert exact_kernels(qtype) == expected, (isa, qtype.name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_batch_invariance(isa: str, qtype: GGMLQuantizationType, dtype: torch.dtype) -> None:
    """A row's result does not depend on the batch around it, its tile, or the threads."""
    x, blocks = case(qtype, 64, 37, dtype, seed=1)
    w = torch.from_numpy(blocks)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = mm(x, w, qtype)
        for i in (0, 5, 31, 63):
            assert torch.equal(mm(x[i : i + 1], w, qtype), full[i : i + 1])
        # either side of the exact kernels' switch from tiles to the GEMM (4 rows with
        # AVX-512, 8 on the 256-bit paths), and the GEMM's row tiles (6 or 3 rows)
        for rows in (2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 15, 16, 17, 23, 24, 25):
            assert torch.equal(mm(x[9 : 9 + rows], w, qtype), full[9 : 9 + rows])
        assert torch.equal(mm(x[5:22], w, qtype), full[5:22])  # other tile boundaries
        assert torch.equal(mm(x, w[3:20], qtype), full[:, 3:20])  # weight rows in other tiles
        torch.set_num_threads(1)
        assert torch.equal(mm(x, w, qtype), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("units", [32, 56, 57], ids=lambda u: f"{u}units")
@pytest.mark.parametrize(
    "qtype",
    [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0],
    ids=lambda t: t.name,
)
def test_long_rows_one_to_four_rows_match_the_gemm(isa: str, qtype: GGMLQuantizationType, units: int) -> None:
    """One to four rows of x (the streamed row kernels up to 56 blocks a row, the
    tiles past that; four rows of Q6_K) give the GEMM's bits, on rows as long as an
    8B's down."""
    k = units * GGML_QUANT_SIZES[qtype][0]
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(3))
    w = torch.from_numpy(random_blocks(qtype, 11, k, seed=3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = mm(x, w, qtype)
        for rows in (1, 2, 3, 4):
            assert torch.equal(mm(x[2 : 2 + rows], w, qtype), full[2 : 2 + rows]), rows
    finally:
        torch.set_num_threads(threads)
    xf, wf = x.double().numpy(), quants.dequantize(w.numpy(), qtype).astype(np.float64)
    bound = 1.001 * activation_bound(xf, wf, GGML_QUANT_SIZES[qtype][0]) + 1e-5 * (np.abs(xf) @ np.abs(wf).T)
    assert np.all(np.abs(full.double().numpy() - xf @ wf.T) <= bound)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_equals_gguf(isa: str, qtype: GGMLQuantizationType) -> None:
    blocks = random_blocks(qtype, 11, k_for(qtype), seed=2)
    rows = torch.tensor([4, 0, 10, 4], dtype=torch.int64)
    want = quants.dequantize(blocks, qtype)[rows.numpy()]
    got = ggml_dequantize_rows(torch.from_numpy(blocks), qtype, rows, torch.float32)
    assert got is not None and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), want)
    got16 = ggml_dequantize_rows(torch.from_numpy(blocks), qtype, rows, torch.bfloat16)
    assert got16 is not None and torch.equal(got16, torch.from_numpy(want).to(torch.bfloat16))


def test_read_only_memmap_weight(isa: str, tmp_path: object) -> None:
    blocks = random_blocks(T.Q4_1, 8, 64, seed=3)
    path = f"{tmp_path}/w.bin"
    blocks.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=blocks.shape)
    with warnings.catch_warnings():  # torch warns (once) that the array is not writable
        warnings.simplefilter("ignore", UserWarning)
        w = torch.from_numpy(mapped)
    x = torch.randn(3, 64)
    assert torch.equal(mm(x, w, T.Q4_1), mm(x, torch.from_numpy(blocks.copy()), T.Q4_1))


def test_bad_inputs_raise_value_error(isa: str) -> None:
    blocks = torch.from_numpy(random_blocks(T.Q4_1, 4, 64, seed=4))  # 2 blocks of 20 bytes per row
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="whole 20-byte blocks"):
        ggml_matmul(x, blocks[:, :39].contiguous(), T.Q4_1)
    with pytest.raises(ValueError, match="not a multiple"):
        ggml_matmul(torch.randn(2, 48), blocks, T.Q4_1)
    with pytest.raises(ValueError, match=r"\[m, 64\]"):
        ggml_matmul(torch.randn(2, 96), blocks, T.Q4_1)
    with pytest.raises(ValueError, match="uint8"):
        ggml_matmul(x, blocks.to(torch.int16), T.Q4_1)
    with pytest.raises(ValueError, match="out must be"):
        ggml_matmul(x, blocks, T.Q4_1, out=torch.empty(2, 5))
    with pytest.raises(ValueError, match="out of range"):
        ggml_dequantize_rows(blocks, T.Q4_1, torch.tensor([4]), torch.float32)
    kq = torch.from_numpy(random_blocks(T.Q4_K, 2, 256, seed=4))
    with pytest.raises(ValueError, match="not a multiple"):
        ggml_matmul(torch.randn(1, 128), kq, T.Q4_K)


def test_cannot_serve_returns_none(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = torch.from_numpy(random_blocks(T.Q8_0, 2, 32, seed=5))
    assert ggml_matmul(torch.randn(1, 32), blocks, T.Q2_K) is None
    assert ggml_matmul(torch.randn(1, 32, dtype=torch.float64), blocks, T.Q8_0) is None
    monkeypatch.setenv("STOKER_DISABLE_C_KERNELS", "1")
    assert ggml_matmul(torch.randn(1, 32), blocks, T.Q8_0) is None
    assert ggml_dequantize_rows(blocks, T.Q8_0, torch.tensor([0]), torch.float32) is None


def test_isa_selection(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("STOKER_QUANT_ISA", raising=False)
    assert ISAS[-1] == "portable" and quant_isa() == ISAS[0]
    monkeypatch.setenv("STOKER_QUANT_ISA", "sse9")
    with pytest.raises(ValueError, match="unknown.*available here: " + ", ".join(ISAS)):
        quant_isa()
    with pytest.raises(ValueError, match="unknown"):
        ggml_matmul(torch.randn(1, 32), torch.from_numpy(random_blocks(T.Q8_0, 2, 32, seed=6)), T.Q8_0)
    unavailable = [name for name in ("avx512_amx", "avx512_vnni", "avx_vnni", "avx2") if name not in ISAS]
    if unavailable:
        monkeypatch.setenv("STOKER_QUANT_ISA", unavailable[0])
        with pytest.raises(ValueError, match="not supported by this CPU"):
            quant_isa()
    monkeypatch.setenv("STOKER_QUANT_ISA", "portable")
    kernels._logged.discard("portable")
    with caplog.at_level(logging.INFO, logger="stoker.kernels"):
        quant_isa()
        quant_isa()
    assert [r.getMessage() for r in caplog.records].count("quantized matmul: portable path") == 1


@pytest.mark.skipif("avx512_amx" not in ISAS, reason="this CPU (or its kernel) offers no AMX-INT8 tiles")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_amx_tiles_give_the_vnni_gemms_bits(
    monkeypatch: pytest.MonkeyPatch, qtype: GGMLQuantizationType, dtype: torch.dtype
) -> None:
    """The AMX path's K-quant GEMM (from 64 rows: whole 32- and 16-row groups on the
    tiles, the rest on the VNNI tiles) is the avx512_vnni path's result bit for bit,
    from the blocks and (Q4_K) packed, on one thread and two, across a partial panel."""
    k, n = 768, 45  # three super-blocks; a panel and 13 columns of the next
    x = torch.randn(150, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    w = torch.from_numpy(random_blocks(qtype, n, k, seed=4))
    packed = ggml_pack(w, qtype)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for rows in (63, 64, 65, 80, 96, 100, 150):
                got: dict[str, list[torch.Tensor]] = {}
                for isa in ("avx512_vnni", "avx512_amx"):
                    monkeypatch.setenv("STOKER_QUANT_ISA", isa)
                    got[isa] = [mm(x[:rows], w, qtype)]
                    if packed is not None:
                        product = ggml_matmul_packed(x[:rows], packed, qtype, n)
                        assert product is not None
                        got[isa].append(product)
                for vnni, amx in zip(got["avx512_vnni"], got["avx512_amx"], strict=True):
                    assert torch.equal(vnni, amx), (num_threads, rows)
    finally:
        torch.set_num_threads(threads)


def test_amx_refused_by_the_kernel_is_not_offered(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A CPU that shows amx_int8 under a kernel that refuses the tile state (before
    Linux 5.16, some VMs) falls back to avx512_vnni and says so once."""
    flags = kernels.cpu_flags() | {"amx_tile", "amx_int8"}
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(kernels, "_amx_permitted", lambda: False)
    kernels._available.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="stoker.kernels"):
            assert "avx512_amx" not in kernels._available()
        assert any("refused the tile state" in r.getMessage() for r in caplog.records) == (
            "avx512_vnni" in kernels._available()
        )
    finally:
        kernels._available.cache_clear()


def test_random_blocks_are_valid() -> None:
    for qtype in TYPES:
        blocks = random_blocks(qtype, 3, k_for(qtype), seed=7)
        assert blocks.shape == (3, k_for(qtype) // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1])
        w = quants.dequantize(blocks, qtype)
        assert np.isfinite(w).all() and 0.01 < np.abs(w).max() < 4 and w.std() > 1e-3
        assert np.array_equal(blocks, random_blocks(qtype, 3, k_for(qtype), seed=7))
