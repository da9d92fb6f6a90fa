"""How a linear layer holds its weight: dense (oneDNN-packed) or as raw GGML
quantized blocks multiplied by the int8 kernels.

Every format satisfies LinearWeight, so the model code never asks which one it
has. GGMLTensor is what the loader hands over for a quantized tensor: its raw
blocks (usually a read-only view of the memory-mapped GGUF, so resident memory
stays at the file's size) and its GGMLQuantizationType.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from stoker.models.layers import Linear
from stoker.models.quant.mapping import release_mapped_pages

log = logging.getLogger("stoker.models.quant")


class LinearWeight(Protocol):
    """y = x W^T (+ b) for x [..., in_features]."""

    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...

    def dequantize(self) -> torch.Tensor:
        """W as a dense [out_features, in_features] tensor: the reference for tests."""
        ...


@cache
def kernels() -> Any | None:
    """stoker.models.quant.kernels, or None where it is absent (its build failed to import)."""
    try:
        return importlib.import_module("stoker.models.quant.kernels")
    except ImportError as exc:
        log.warning("int8 GGML kernels unavailable (%s): quantized weights are dequantized", exc)
        return None


def served_types() -> frozenset[GGMLQuantizationType]:
    """Quantization types the kernels multiply directly on this machine."""
    k = kernels()
    return frozenset(k.SUPPORTED_TYPES) if k is not None else frozenset()


def quant_isa() -> str:
    k = kernels()
    return str(k.quant_isa()) if k is not None else "none"


@dataclass(frozen=True)
class GGMLTensor:
    """A 2-D GGML tensor kept as its raw blocks: data is uint8 [rows, row_bytes]."""

    data: torch.Tensor
    qtype: GGMLQuantizationType
    cols: int
    """Logical columns (elements per row)."""
    file_mapped: bool = False
    """data views the read-only mapping of a GGUF file (np.memmap), not memory of its own."""

    def __post_init__(self) -> None:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"GGML blocks must be uint8 [rows, row_bytes], got {self.data.dtype} {self.data.shape}")
        if self.cols % block or self.data.shape[1] != self.cols // block * type_size:
            raise ValueError(f"{self.qtype.name}: {self.cols} columns do not fit rows of {self.data.shape[1]} bytes")

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def take_rows(self, index: torch.Tensor) -> GGMLTensor:
        """Rows reordered or selected (a copy: q/k un-permutation); a mapped original's pages are given back."""
        copy = GGMLTensor(self.data[index].contiguous(), self.qtype, self.cols)
        if self.file_mapped:
            release_mapped_pages(self.data)
        return copy

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """All rows (or the given ones) as dense [r, cols]: the kernels' rows path, else gguf's numpy one."""
        k = kernels()
        if rows is not None and k is not None and self.qtype in k.SUPPORTED_TYPES:
            got = k.ggml_dequantize_rows(self.data, self.qtype, rows.to(torch.int64), dtype)
            if got is not None:
                return got  # type: ignore[no-any-return]
        from gguf.quants import dequantize

        blocks = self.data if rows is None else self.data[rows]
        array = dequantize(blocks.cpu().numpy(), self.qtype)
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(dtype)


def from_numpy_readonly(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing a read-only array's memory (an np.memmap of the file): no copy.
    torch warns that writes would be undefined; nothing writes to weights."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class _Part:
    """One run of a fused weight's rows: its blocks, or where the kernels multiply
    its type from them the same repacked once into their GEMM's panel order
    (kernels.ggml_pack; the blocks' memory given back), and its dense stand-in
    once the kernels refuse it. pack=False leaves the repacking to install()."""

    def __init__(self, tensor: GGMLTensor, start: int, pack: bool = True) -> None:
        self.qtype, self.rows, self.cols = tensor.qtype, tensor.rows, tensor.cols
        self.start = start
        self.stop = start + tensor.rows
        self.dense: Linear | None = None
        self.tensor: GGMLTensor | None = tensor
        self.packed: torch.Tensor | None = None
        if pack:
            self.install(self.packed_copy())

    def packed_copy(self, num_threads: int | None = None) -> torch.Tensor | None:
        """The blocks repacked (a copy; this part is unchanged), or None where its type
        is not repacked here or it serves from panels or dense already."""
        k = kernels()
        if k is None or self.tensor is None or self.dense is not None or not packs(self.qtype):
            return None
        return k.ggml_pack(self.tensor.data.contiguous(), self.qtype, num_threads)  # type: ignore[no-any-return]

    def install(self, packed: torch.Tensor | None) -> GGMLTensor | None:
        """Serve from `packed` (packed_copy's) from now on; the blocks' mapped pages are
        given back. Returns the blocks replaced (None when nothing was)."""
        if packed is None or self.tensor is None:
            return None
        replaced = self.tensor
        if replaced.file_mapped:
            release_mapped_pages(replaced.data)
        self.packed, self.tensor = packed, None
        return replaced

    @property
    def nbytes(self) -> int:
        return self.packed.numel() if self.packed is not None else self.blocks().nbytes

    def blocks(self) -> GGMLTensor:
        """The weight as GGML blocks (unpacked into a copy where it is packed)."""
        if self.tensor is not None:
            return self.tensor
        k = kernels()
        assert k is not None and self.packed is not None
        return GGMLTensor(k.ggml_unpack(self.packed, self.qtype, self.rows, self.cols), self.qtype, self.cols)


def packs(qtype: GGMLQuantizationType) -> bool:
    """Whether a linear layer's `qtype` weights are repacked (_Part): where the path
    in use multiplies them so (Q4_K, Q6_K, Q8_0, Q5_0, Q4_0), unless STOKER_DISABLE_PACKED_GGML=1."""
    k = kernels()
    return k is not None and os.environ.get("STOKER_DISABLE_PACKED_GGML") != "1" and bool(k.packs(qtype))


_deferred: ContextVar[list[GGMLLinear] | None] = ContextVar("deferred_packing", default=None)


@contextmanager
def deferred_packing() -> Iterator[list[GGMLLinear]]:
    """GGMLLinears built inside keep serving their blocks; the list receives those
    with weights to repack, for a BackgroundRepack (quant/repack.py) to pack later."""
    linears: list[GGMLLinear] = []
    token = _deferred.set(linears)
    try:
        yield linears
    finally:
        _deferred.reset(token)


class GGMLLinear:
    """y = x W^T + b over quantized parts stacked by rows (a fused qkv may mix
    Q4_K and Q6_K as Q4_K_M files do). Adjacent parts of one type are joined into
    one block matrix at load, so a fused qkv or gate/up is one kernel call (on a
    135M model a decode step's call count is what costs: 7 calls a layer became 4,
    2.4 ms less per token). Parts side by side in the file are joined as one view
    of it; others are copied, and the copy gives back the mapped pages it was
    read from (those a neighbour's 2 MiB folio keeps mapped stay resident twice).
    Parts of different types each write their column slice of one output."""

    def __init__(self, parts: Sequence[GGMLTensor], bias: torch.Tensor | None = None) -> None:
        if not parts:
            raise ValueError("GGMLLinear needs at least one part")
        cols = {p.cols for p in parts}
        if len(cols) != 1:
            raise ValueError(f"parts of one linear layer disagree on in_features: {sorted(cols)}")
        self.in_features = cols.pop()
        self.parts: list[_Part] = []
        deferred = _deferred.get()
        start = 0
        for p in _join_same_type(parts):
            self.parts.append(_Part(p, start, pack=deferred is None))
            start += p.rows
        self.out_features = start
        self.bias = bias
        if deferred is not None and any(packs(p.qtype) for p in self.parts):
            deferred.append(self)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def qtypes(self) -> list[GGMLQuantizationType]:
        return [p.qtype for p in self.parts]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        if len(self.parts) == 1:
            y = self._part(self.parts[0], x2, None)
        else:
            y = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype, device=x.device)
            for part in self.parts:
                self._part(part, x2, y[:, part.start : part.stop])
        if self.bias is not None:
            y += self.bias
        return y.reshape(*lead, self.out_features)

    def _part(self, part: _Part, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if part.dense is None:
            k = kernels()
            if k is not None:
                if part.packed is not None:
                    got = k.ggml_matmul_packed(x, part.packed, part.qtype, part.rows, out=out)
                else:
                    assert part.tensor is not None
                    got = k.ggml_matmul(x, part.tensor.data, part.qtype, out=out)
                if got is not None:
                    return got  # type: ignore[no-any-return]
            _log_fallback(part.qtype, x.dtype)
            part.dense = Linear(part.blocks().dequantize(x.dtype))
        y = part.dense(x)
        if out is not None:
            out.copy_(y)
            return out
        return y

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.blocks().dequantize(torch.float32) for p in self.parts])

    def packed_copies(self, num_threads: int | None = None) -> list[torch.Tensor | None]:
        """Each part's blocks repacked (copies: this layer serves as before), None where a part's are not."""
        return [p.packed_copy(num_threads) for p in self.parts]

    def install_packed(self, copies: Sequence[torch.Tensor | None]) -> list[GGMLTensor | None]:
        """Serve from packed_copies' copies from now on. Not while a product runs:
        the blocks' pages are given back (their owner's lock, quant/repack.py).
        Returns the blocks replaced, which a caller keeps while anything may still point at them."""
        return [part.install(packed) for part, packed in zip(self.parts, copies, strict=True)]


def _join_same_type(parts: Sequence[GGMLTensor]) -> list[GGMLTensor]:
    """Runs of adjacent parts with one qtype, each run as one contiguous tensor."""
    runs: list[list[GGMLTensor]] = []
    for p in parts:
        if runs and runs[-1][0].qtype == p.qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    joined = []
    for run in runs:
        if len(run) == 1:
            joined.append(run[0])
            continue
        if _side_by_side(run):
            # One view over the file's bytes: no copy. A copy of mapped parts cannot give all their
            # pages back where the page cache maps 2 MiB folios whole (a neighbour's fault maps the
            # folio again): ~50 MB of a 0.5B Q4_K_M's gate/up stayed resident twice.
            rows = sum(t.rows for t in run)
            data = run[0].data.as_strided((rows, run[0].data.shape[1]), run[0].data.stride())
            joined.append(GGMLTensor(data, run[0].qtype, run[0].cols, file_mapped=True))
            continue
        joined.append(GGMLTensor(torch.cat([t.data for t in run]), run[0].qtype, run[0].cols))
        for t in run:
            if t.file_mapped:  # the copy replaces them: resident memory stays the file's size
                release_mapped_pages(t.data)
    return joined


def _side_by_side(run: Sequence[GGMLTensor]) -> bool:
    """Whether the parts are contiguous views of one storage, each starting where the one
    before ends (a GGUF's q, k, v or gate, up written one after the other, no padding)."""
    first = run[0].data
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for t in run:
        if not t.data.is_contiguous() or t.data.untyped_storage().data_ptr() != storage or t.data.data_ptr() != end:
            return False
        end += t.nbytes
    return True


@cache
def _log_fallback(qtype: GGMLQuantizationType, dtype: torch.dtype) -> None:
    log.warning("%s x %s: the int8 kernels cannot serve it here; dequantized once per tensor", qtype.name, dtype)


WeightLike = torch.Tensor | GGMLTensor


def make_linear(
    parts: Sequence[WeightLike], bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device
) -> LinearWeight:
    """The LinearWeight for row-stacked parts: GGMLLinear when every part is
    quantized and the device is the CPU; else dense (dequantized once here: on
    CUDA and other devices the int8 kernels do not run)."""
    if bias is not None:
        bias = bias.to(device=device, dtype=dtype).contiguous()
    if device.type == "cpu" and all(isinstance(p, GGMLTensor) for p in parts):
        return GGMLLinear([p for p in parts if isinstance(p, GGMLTensor)], bias)
    dense = [dense_weight(p, dtype, device) for p in parts]
    return Linear(dense[0] if len(dense) == 1 else torch.cat(dense).contiguous(), bias)


def dense_weight(w: WeightLike, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(w, GGMLTensor):
        w = w.dequantize(dtype)
    return w.to(device=device, dtype=dtype).contiguous()


class Embedding:
    """Token-embedding lookup from a dense table or a quantized one (only the
    looked-up rows are dequantized)."""

    def __init__(self, table: WeightLike, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.quantized = table if isinstance(table, GGMLTensor) and device.type == "cpu" else None
        self.dense = None if self.quantized is not None else dense_weight(table, dtype, device)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.dequantize(self.dtype, rows=ids)
        assert self.dense is not None
        return F.embedding(ids, self.dense)

    @property
    def table(self) -> WeightLike:
        """What a tied LM head multiplies by: the same storage, no second copy."""
        return self.quantized if self.quantized is not None else self.dense  # type: ignore[return-value]


def type_name(w: WeightLike) -> str:
    if isinstance(w, GGMLTensor):
        return w.qtype.name
    return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}.get(w.dtype, str(w.dtype))


def weight_nbytes(w: WeightLike) -> int:
    return w.nbytes if isinstance(w, GGMLTensor) else w.numel() * w.element_size()


def describe(weights: dict[str, WeightLike]) -> str:
    """E.g. 'Q4_1 (210 tensors) + Q8_0 (1) + F32 (61), 78 MiB': most common format first."""
    counts: dict[str, int] = {}
    for w in weights.values():
        counts[type_name(w)] = counts.get(type_name(w), 0) + 1
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [f"{name} ({n}{' tensors' if i == 0 else ''})" for i, (name, n) in enumerate(ordered)]
    total = sum(weight_nbytes(w) for w in weights.values())
    return f"{' + '.join(parts)}, {total / 2**20:.0f} MiB"
