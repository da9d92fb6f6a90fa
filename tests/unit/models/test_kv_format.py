"""One KV row format and one attention in C (csrc/kv_format.h, csrc/attention.h):
Python's table of formats is the header's enum, nothing else numbers them, and
the paged-attention kernels compute what the fused decoder's attention does:
a prompt row exactly what a decode row at its position does, on every ISA path
and for every cache dtype they read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from stoker.models import cpu_kernels, fused_decoder, kv_quant
from stoker.models.attention import write_kv
from stoker.models.quant.kernels import available_isas

CSRC = Path(cpu_kernels.__file__).parent / "csrc"
# The header's names for the dtypes: what each KV_* code stands for.
C_NAMES = {
    "KV_F32": torch.float32,
    "KV_INT8": torch.int8,
    "KV_BF16": torch.bfloat16,
    "KV_FP8": torch.float8_e4m3fn,
    "KV_F16": torch.float16,
}


def _header_enum() -> dict[str, int]:
    text = (CSRC / "kv_format.h").read_text()
    body = re.search(r"enum\s*\{([^}]*KV_F32[^}]*)\}", text)
    assert body, "kv_format.h has no KV_* enum"
    return {name: int(code) for name, code in re.findall(r"(KV_\w+)\s*=\s*(\d+)", body.group(1))}


def test_python_table_is_the_headers_enum() -> None:
    enum = _header_enum()
    assert set(enum) == set(C_NAMES)
    assert {C_NAMES[name]: code for name, code in enum.items()} == kv_quant.KV_FORMATS


def test_nothing_else_numbers_the_formats() -> None:
    """The C sources include the header; the Python modules import kv_quant's table."""
    for source in sorted(CSRC.glob("*.[ch]")):
        if source.name != "kv_format.h":
            assert not re.search(r"\bKV_F32\s*=", source.read_text()), f"{source.name} numbers the KV formats"
    assert cpu_kernels.KV_FORMATS is kv_quant.KV_FORMATS
    assert fused_decoder.KV_FORMATS is kv_quant.KV_FORMATS


def _cache(dtype: torch.dtype, lens: list[int], heads_dim: tuple[int, int], block_size: int, seed: int):
    """Sequences scattered over shuffled blocks of a cache of `dtype` (quantized rows where one-byte)."""
    kv_heads, head_dim = heads_dim
    g = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(-(-n // block_size) for n in lens) + 2
    shape = (num_blocks, block_size, kv_heads, kv_quant.row_width(head_dim, dtype))
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // block_size))]
        k = torch.randn(n, kv_heads, head_dim, generator=g)
        v = torch.randn(n, kv_heads, head_dim, generator=g)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        write_kv(k_cache, v_cache, k, v, slots)
        tables.append(table)
    return k_cache, v_cache, tables


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize(
    "kv_dtype,q_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.int8, torch.float32),
        (torch.float8_e4m3fn, torch.float32),
    ],
    ids=lambda d: str(d).removeprefix("torch."),
)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 40), (8, 1, 128)], ids=str)
def test_prefill_rows_are_decode_rows(
    isa: str,
    kv_dtype: torch.dtype,
    q_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk of 37 prompt rows (three row groups) over a cached context gives,
    row for row and bit for bit, what decoding each position gives."""
    monkeypatch.setenv("STOKER_QUANT_ISA", isa)
    if cpu_kernels.load_paged_attention() is None:
        pytest.skip("no C compiler")
    context, n, block_size = 70, 37, 16
    k_cache, v_cache, (table,) = _cache(kv_dtype, [context], (kv_heads, head_dim), block_size, seed=3)
    q = torch.randn(n, heads, head_dim, generator=torch.Generator().manual_seed(4)).to(q_dtype)
    scale = head_dim**-0.5
    prefill = torch.empty_like(q)
    block_ids = torch.tensor(table, dtype=torch.int64)
    assert cpu_kernels.paged_prefill_attention(q, k_cache, v_cache, block_ids, context, scale, prefill)
    # Row i of the chunk is a sequence of context - n + i + 1 tokens decoding its last.
    tables = block_ids.repeat(n, 1)
    lens = torch.arange(context - n + 1, context + 1, dtype=torch.int64)
    decode = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert decode is not None
    assert torch.equal(prefill, decode)
    # And it is attention: the float reference over the rows as the cache holds them.
    keys = _rows(k_cache, table, context, kv_dtype).repeat_interleave(heads // kv_heads, 1)
    values = _rows(v_cache, table, context, kv_dtype).repeat_interleave(heads // kv_heads, 1)
    queries = kv_quant.quantize_queries(q.float(), kv_dtype)
    for i in range(n):
        visible = context - n + i + 1
        scores = torch.einsum("hd,thd->ht", queries[i], keys[:visible]) * scale
        want = torch.einsum("ht,thd->hd", torch.softmax(scores, -1), values[:visible])
        tol = 2e-2 if q_dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(decode[i].float(), want, atol=tol, rtol=tol)


def _rows(cache: torch.Tensor, table: list[int], length: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `length` rows of a sequence as floats [length, kv_heads, head_dim]."""
    blocks = cache[torch.tensor(table)]
    if kv_quant.is_quantized(dtype):
        blocks = kv_quant.dequantize_rows(blocks.view(torch.uint8), dtype, torch.float32)
    return blocks.float().flatten(0, 1)[:length]
