"""LoRA adapters as the fused C stack reads them (csrc/decoder_layer.c's
LoraLinear and LoraLayer): per layer and stacked linear, a pointer to the
adapter's stacked A and, per module, its scale * B^T and output columns.

An adapter's tables are built on the first step that carries it and kept
while the adapter lives (they point into its tensors), so a step passes only
the row -> adapter map and one pointer per adapter.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from stoker.models.lora import STACKS, LoraAdapter, LoraBatch

if TYPE_CHECKING:
    from stoker.models.llama import DecoderLayer

LORA_MAX_MODULES = 3  # as in decoder_layer.c
_i, _p = ctypes.c_int, ctypes.c_void_p


class _LoraLinear(ctypes.Structure):
    _fields_ = [
        ("rank", _i),
        ("a", _p),
        ("num_modules", _i),
        ("rank_start", _i * LORA_MAX_MODULES),
        ("rank_count", _i * LORA_MAX_MODULES),
        ("col_start", _i * LORA_MAX_MODULES),
        ("col_count", _i * LORA_MAX_MODULES),
        ("bt", _p * LORA_MAX_MODULES),
    ]


class _LoraLayer(ctypes.Structure):
    _fields_ = [("linears", _LoraLinear * len(STACKS))]  # in STACKS' order, as decoder_layer.c's LORA_* enum


@dataclass
class LoraStep:
    """What one step passes to decoder_forward; holds the memory the pointers point into until the call."""

    row_lora: torch.Tensor
    """int32 [n], contiguous."""
    tables: ctypes.Array[ctypes.c_void_p]
    """One pointer per adapter to its [num_layers] LoraLayer tables."""
    num_loras: int
    width: int
    """The widest rank of any adapter's linear in the step (the row stride of the C side's A x)."""


def _f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


class LoraTables:
    """Each adapter's C tables for one model's layers, built on its first step, kept while it lives."""

    def __init__(self, layers: Sequence[DecoderLayer]) -> None:
        self._layers = layers
        self._built: weakref.WeakKeyDictionary[LoraAdapter, tuple[ctypes.Array[_LoraLayer], int]] = (
            weakref.WeakKeyDictionary()
        )

    def step(self, batch: LoraBatch, n: int) -> LoraStep:
        if batch.row_adapter.shape != (n,):
            raise ValueError(f"the LoRA batch covers {list(batch.row_adapter.shape)} rows, the step {n}")
        built = []
        for adapter in batch.adapters:
            if adapter not in self._built:
                self._built[adapter] = self._build(adapter)
            built.append(self._built[adapter])
        pointers = (_p * len(built))(*(ctypes.addressof(tables) for tables, _ in built))
        width = max((w for _, w in built), default=0)
        return LoraStep(batch.row_adapter.to(torch.int32).contiguous(), pointers, len(built), width)

    def _build(self, adapter: LoraAdapter) -> tuple[ctypes.Array[_LoraLayer], int]:
        """The adapter's LoraLayer per layer and its widest rank; a ValueError if it does not fit these layers."""
        if len(adapter.layers) != len(self._layers):
            raise ValueError(
                f"LoRA adapter {adapter.name!r} has {len(adapter.layers)} layers, the model {len(self._layers)}"
            )
        tables = (_LoraLayer * len(self._layers))()
        width = 0
        for i, (shares, layer) in enumerate(zip(adapter.layers, self._layers)):
            for k, stack in enumerate(STACKS):
                lin = shares.get(stack)
                if lin is None:
                    continue
                base = getattr(layer, stack)
                fits = _f32(lin.a) and lin.a.shape[1] == base.in_features and len(lin.parts) <= LORA_MAX_MODULES
                # decoder_layer.c's expand tiles take 16 columns, then 8 at a module's end.
                fits = fits and all(
                    _f32(p.bt) and p.cols % 8 == 0 and p.col_start + p.cols <= base.out_features for p in lin.parts
                )
                if not fits:
                    raise ValueError(f"LoRA adapter {adapter.name!r}: layer {i} {stack} does not fit this model")
                table = tables[i].linears[k]
                table.rank, table.a, table.num_modules = lin.rank, lin.a.data_ptr(), len(lin.parts)
                for m, part in enumerate(lin.parts):
                    table.rank_start[m], table.rank_count[m] = part.rank_start, part.rank
                    table.col_start[m], table.col_count[m] = part.col_start, part.cols
                    table.bt[m] = part.bt.data_ptr()
                width = max(width, lin.rank)
        return tables, width
