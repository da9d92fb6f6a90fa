"""Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 weights repacked at load into the GEMM's panel order (csrc/packed_panels.h),
on every ISA path this CPU can run: the same bits as the GGUF blocks give, at
every row count, and the blocks back from the packing bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from stoker.models.quant import kernels
from stoker.models.quant.blocks import random_blocks
from stoker.models.quant.kernels import available_isas, ggml_matmul, ggml_matmul_packed, ggml_pack, ggml_unpack
from stoker.models.quant.weights import GGMLLinear, GGMLTensor, packs

T = GGMLQuantizationType
pytestmark = pytest.mark.skipif(kernels._library("portable") is None, reason="no C compiler")

# panels of 32 columns; (values, bytes) a column and unit: a Q4_K or Q6_K super-block, a Q8_0, Q5_0 or Q4_0 block
PANEL, UNIT = 32, {T.Q4_K: (256, 148), T.Q6_K: (256, 210), T.Q8_0: (32, 34), T.Q5_0: (32, 22), T.Q4_0: (32, 18)}
PACKED = sorted(UNIT)


def multiplies_packed(isa: str, qtype: GGMLQuantizationType) -> bool:
    """The SIMD paths multiply packed weights, but AVX2 its Q8_0 (maddubs would saturate)."""
    return isa != "portable" and not (isa == "avx2" and qtype == T.Q8_0)


@pytest.fixture(params=available_isas())
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("STOKER_QUANT_ISA", request.param)
    monkeypatch.delenv("STOKER_DISABLE_C_KERNELS", raising=False)
    monkeypatch.delenv("STOKER_DISABLE_PACKED_GGML", raising=False)
    return str(request.param)


def blocks_of(n: int, k: int, seed: int, qtype: GGMLQuantizationType = T.Q4_K) -> torch.Tensor:
    return torch.from_numpy(random_blocks(qtype, n, k, seed))


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
@pytest.mark.parametrize(("n", "k"), [(37, 256), (100, 512), (64, 2048), (50, 896)])
def test_packing_round_trips_bit_for_bit(isa: str, n: int, k: int, qtype: GGMLQuantizationType) -> None:
    """Every path packs the same layout (a padded last panel included) and unpacks it exactly."""
    values, unit_bytes = UNIT[qtype]
    if k % values:
        pytest.skip(f"{qtype.name} rows are whole {values}-value units")
    w = blocks_of(n, k, seed=n, qtype=qtype)
    packed = ggml_pack(w, qtype)
    assert packed is not None
    assert packed.numel() == -(-n // PANEL) * (k // values) * PANEL * unit_bytes
    assert torch.equal(ggml_unpack(packed, qtype, n, k), w)


def test_what_is_packed_and_which_paths_multiply_it(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0, where the path multiplies them; no other type."""
    for qtype in (T.Q4_1, T.Q5_K):
        assert ggml_pack(torch.from_numpy(random_blocks(qtype, 4, 256, seed=1)), qtype) is None
        assert not packs(qtype)
    for qtype in PACKED:
        assert packs(qtype) == multiplies_packed(isa, qtype)
        packed = ggml_pack(blocks_of(8, 256, seed=1, qtype=qtype), qtype)
        assert packed is not None
        y = ggml_matmul_packed(torch.randn(2, 256), packed, qtype, 8)
        assert (y is None) == (not multiplies_packed(isa, qtype))
    monkeypatch.setenv("STOKER_DISABLE_PACKED_GGML", "1")
    assert not any(packs(qtype) for qtype in PACKED)


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "k"), [(37, 256), (100, 512), (50, 896)])
def test_packed_product_is_the_blocks_product_at_every_row_count(
    isa: str, n: int, k: int, dtype: torch.dtype, qtype: GGMLQuantizationType
) -> None:
    """The tiles that read the panels compute the GEMM's (and so the small tiles')
    integers and float operations: the same bits from one row to a prompt, on one
    thread or two, into a column slice of a wider output too."""
    if not multiplies_packed(isa, qtype):
        pytest.skip(f"the {isa} path multiplies {qtype.name}'s blocks only")
    if k % UNIT[qtype][0]:
        pytest.skip(f"{qtype.name} rows are whole {UNIT[qtype][0]}-value units")
    w = blocks_of(n, k, seed=k, qtype=qtype)
    packed = ggml_pack(w, qtype)
    assert packed is not None
    x = torch.randn(109, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            # AMX tiles: 16-64 rows make each super-block's planes as they go, 100 a panel's at once;
            # 13-15, 61 and 109 take a last group of 16 past their rows (amx_packed_rows)
            for rows in (*range(1, 18), 23, 40, 61, 64, 70, 100, 109):
                want = ggml_matmul(x[:rows], w, qtype)
                assert want is not None
                got = ggml_matmul_packed(x[:rows], packed, qtype, n)
                assert got is not None and torch.equal(got, want), (num_threads, rows)
        wide = torch.full((5, n + 9), 7.0, dtype=dtype)
        ggml_matmul_packed(x[:5], packed, qtype, n, out=wide[:, 4 : 4 + n])
        assert torch.equal(wide[:, 4 : 4 + n], ggml_matmul(x[:5], w, qtype))
        assert bool((wide[:, :4] == 7).all() and (wide[:, 4 + n :] == 7).all())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
def test_threads_taking_each_others_panels_leave_none_out_and_none_twice(isa: str, qtype: GGMLQuantizationType) -> None:
    """More threads than panels (4 panels, 7 threads on this machine's few cores): the
    threads with no range of their own, or done with it, take the others' panels from
    the back (panel_claim). Every panel is computed once, by whichever thread: the
    same bits as one thread gives."""
    if not multiplies_packed(isa, qtype):
        pytest.skip(f"the {isa} path multiplies {qtype.name}'s blocks only")
    n, k = 100, 512
    w = blocks_of(n, k, seed=9, qtype=qtype)
    packed = ggml_pack(w, qtype)
    assert packed is not None
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(9))
    threads = torch.get_num_threads()
    try:
        for rows in (1, 16, 70):
            torch.set_num_threads(1)
            want = ggml_matmul_packed(x[:rows], packed, qtype, n)
            torch.set_num_threads(7)
            for _ in range(5):
                got = ggml_matmul_packed(x[:rows], packed, qtype, n)
                assert want is not None and got is not None and torch.equal(got, want), rows
    finally:
        torch.set_num_threads(threads)


def test_packed_bad_inputs_raise_value_error(isa: str) -> None:
    packed = ggml_pack(blocks_of(40, 512, seed=2), T.Q4_K)
    assert packed is not None
    with pytest.raises(ValueError, match="packed Q4_K"):
        ggml_unpack(packed, T.Q4_K, 40, 256)
    if isa != "portable":
        with pytest.raises(ValueError, match="packed Q4_K weight of 70 rows"):  # 3 panels, not 2
            ggml_matmul_packed(torch.randn(2, 512), packed, T.Q4_K, 70)
        with pytest.raises(ValueError, match="packed Q4_K"):
            ggml_matmul_packed(torch.randn(2, 256), packed, T.Q4_K, 40)


def test_linear_layers_pack_their_q4_k_runs_and_answer_as_the_blocks_do(
    isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GGMLLinear packs a Q4_K run where the path multiplies it so (a Q5_K part
    beside it stays blocks); its output, dequantized weight and fallbacks are
    the blocks' own: bit for bit where the kernels serve, dense from the unpacked
    blocks where they do not (the path switched to portable after loading)."""
    parts = [GGMLTensor(blocks_of(50, 512, seed=s), T.Q4_K, 512) for s in (3, 4)]
    parts.append(GGMLTensor(torch.from_numpy(random_blocks(T.Q5_K, 16, 512, seed=5)), T.Q5_K, 512))
    bias = torch.randn(116)
    x = torch.randn(6, 512)
    packed = GGMLLinear(parts, bias)
    assert [p.packed is not None for p in packed.parts] == [isa != "portable", False]
    monkeypatch.setenv("STOKER_DISABLE_PACKED_GGML", "1")
    blocks = GGMLLinear(parts, bias)
    assert all(p.packed is None for p in blocks.parts)
    assert torch.equal(packed.dequantize(), blocks.dequantize())
    for rows in (1, 3, 6):
        assert torch.equal(packed(x[:rows]), blocks(x[:rows]))
    monkeypatch.setenv("STOKER_QUANT_ISA", "portable")
    want = x @ torch.cat([p.dequantize() for p in parts]).T + bias
    # x rounded to int8 per 256 in the Q5_K part's kernels: ~0.7% of the product's norm
    assert float((packed(x) - want).norm() / want.norm()) < 0.015
    assert (packed.parts[0].dense is not None) == (isa != "portable")


def test_packing_gives_back_the_mapped_pages(isa: str, tmp_path: object) -> None:
    """A file-mapped Q4_K weight, once packed, leaves none of its pages mapped (the copy replaces them)."""
    if isa == "portable":
        pytest.skip("nothing is packed on the portable path")
    path = Path(str(tmp_path)) / "w.bin"
    blocks = random_blocks(T.Q4_K, 2048, 2048, seed=6)  # 4.5 MiB
    blocks.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=blocks.shape)
    from stoker.models.quant.weights import from_numpy_readonly

    tensor = GGMLTensor(from_numpy_readonly(mapped), T.Q4_K, 2048, file_mapped=True)
    before = _rss_file()
    linear = GGMLLinear([tensor])
    assert linear.parts[0].packed is not None
    assert _rss_file() - before < blocks.nbytes // 4
    x = torch.randn(2, 2048)
    want = ggml_matmul(x, torch.from_numpy(blocks), T.Q4_K)
    assert want is not None and torch.equal(linear(x), want)


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


def test_packed_weights_ask_for_huge_pages() -> None:
    """A packed copy is memory that asked for transparent huge pages (VmFlags `hg`):
    on 4 KiB pages one decoding row's TLB misses cost the 1B's Q6_K LM head 1.5x
    its time. Where the kernel has no THP the same bytes sit on small pages."""
    if not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        pytest.skip("this kernel offers no transparent huge pages")
    packed = ggml_pack(blocks_of(64, 2048, seed=7, qtype=T.Q6_K), T.Q6_K)
    assert packed is not None
    assert "hg" in _vm_flags(packed.data_ptr())
    assert torch.equal(ggml_unpack(packed, T.Q6_K, 64, 2048), blocks_of(64, 2048, seed=7, qtype=T.Q6_K))


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
