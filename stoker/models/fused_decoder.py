"""The whole decoder stack in one C call (csrc/decoder_layer.c) for a model whose
every linear layer is GGML-quantized on the CPU with float32 activations.

On a small model the per-op Python and torch dispatch of LlamaModel.forward
cost as much as the matmuls (a 135M model: ~8 C calls and ~15 torch ops per
layer, 30 layers, per token). Here the tables of weight pointers, types and
shapes are built once at load; a step passes only its own tensors.

It serves every step of a model it applies to (decodes, prefill chunks,
mixed), so a sequence's tokens never depend on which path the rest of its
batch took. STOKER_FUSED_DECODER=0 turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING

import torch

from stoker.models.attention import AttentionMetadata
from stoker.models.fused_lora import LoraTables
from stoker.models.kv_quant import KV_FORMATS, row_width
from stoker.models.lora import LoraBatch
from stoker.models.quant.weights import GGMLLinear, LinearWeight, kernels

if TYPE_CHECKING:
    from stoker.models.llama import LlamaModel

log = logging.getLogger("stoker.models")

MAX_PARTS = 4  # as in decoder_layer.c
_i, _f, _p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [
        ("num_parts", _i),
        ("types", _i * MAX_PARTS),
        ("weights", _p * MAX_PARTS),
        ("starts", _i * MAX_PARTS),
        ("rows", _i * MAX_PARTS),
        ("bias", _p),
        ("in_features", _i),
        ("out_features", _i),
        ("packed", _i * MAX_PARTS),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _p),
        ("post_norm", _p),
        ("q_norm", _p),
        ("k_norm", _p),
        ("qkv", _Linear),
        ("o_proj", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i),
        ("hidden", _i),
        ("num_heads", _i),
        ("num_kv_heads", _i),
        ("head_dim", _i),
        ("intermediate", _i),
        ("eps", _f),
        ("scale", _f),
        ("cos", _p),
        ("sin", _p),
        ("max_positions", _i),
        ("layers", ctypes.POINTER(_Layer)),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("n", _i),
        ("positions", _p),
        ("slots", _p),
        ("tables", _p),
        ("max_blocks", _i),
        ("row_seq", _p),
        ("k_caches", _p),
        ("v_caches", _p),
        ("block_size", _i),
        ("kv_format", _i),
        ("row_lora", _p),
        ("loras", _p),
        ("num_loras", _i),
        ("lora_width", _i),
    ]


@cache
def _library(isa: str) -> ctypes.CDLL | None:
    """decoder_layer.c built for the quantized-matmul ISA path `isa`."""
    k = kernels()
    if k is None:
        return None
    lib: ctypes.CDLL | None = k.build_for_isa("decoder_layer", isa)
    if lib is None:
        return None
    lib.decoder_model_ok.restype = _i
    lib.decoder_model_ok.argtypes = [ctypes.POINTER(_Model)]
    lib.decoder_forward.restype = _i
    lib.decoder_forward.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step), _p, _i]
    lib.decoder_kv_round_trip.restype = None
    lib.decoder_kv_round_trip.argtypes = [_i, _p, _i, _i, _p, _p]
    return lib


def _current_library() -> ctypes.CDLL | None:
    """The build for the ISA in use now (STOKER_QUANT_ISA is re-read, as for every matmul)."""
    k = kernels()
    if k is None or os.environ.get("STOKER_DISABLE_C_KERNELS") == "1":
        return None
    return _library(k.quant_isa())


def kv_round_trip(x: torch.Tensor, dtype: torch.dtype, isa: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows x [n, head_dim] (float32) written as the C stack writes a cache of `dtype`, and
    read back as its attention reads them: (the rows as stored, uint8 [n, row bytes]; the
    values read, times their scale), or None without the `isa` build. What the tests hold
    against kv_quant.py and torch's casts."""
    lib = _library(isa)
    if lib is None:
        return None
    x = x.float().contiguous()
    n, head_dim = x.shape
    if head_dim % 8 or head_dim > 512:
        raise ValueError(f"head_dim {head_dim}: the C stack takes multiples of 8 up to 512")
    stored = torch.empty(n, row_width(head_dim, dtype), dtype=dtype).view(torch.uint8)
    values = torch.empty_like(x)
    lib.decoder_kv_round_trip(KV_FORMATS[dtype], x.data_ptr(), n, head_dim, stored.data_ptr(), values.data_ptr())
    return stored, values


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_cpu and t.is_contiguous())


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear_table(w: LinearWeight) -> _Linear | str:
    """The C description of a linear layer, or why it cannot be one."""
    if not isinstance(w, GGMLLinear):
        return f"{type(w).__name__} is not a GGML-quantized linear"
    k = kernels()
    served = k.SUPPORTED_TYPES if k is not None else frozenset()
    if len(w.parts) > MAX_PARTS:
        return f"{len(w.parts)} parts (at most {MAX_PARTS})"
    if not _f32(w.bias):
        return "its bias is not contiguous float32"
    table = _Linear(num_parts=len(w.parts), in_features=w.in_features, out_features=w.out_features, bias=_ptr(w.bias))
    for i, part in enumerate(w.parts):
        if part.dense is not None or part.qtype not in served:
            return f"{part.qtype.name} is not served by the int8 kernels here"
        if part.packed is not None:
            if k is None or not k.packs(part.qtype):
                return f"{part.qtype.name} weights packed for the GEMM are not multiplied by the {k and k.quant_isa()} path"
            table.weights[i] = part.packed.data_ptr()
            table.packed[i] = 1
        else:
            assert part.tensor is not None
            if not part.tensor.data.is_contiguous():
                return "weight blocks are not contiguous"
            table.weights[i] = part.tensor.data.data_ptr()
        table.types[i] = int(part.qtype)
        table.starts[i] = part.start
        table.rows[i] = part.rows
    return table


LINEARS = ("qkv", "o_proj", "gate_up", "down")


class FusedDecoder:
    """The decoder stack of one LlamaModel as one C call per step. Build with
    `FusedDecoder.build(model)`, which says why it does not apply when it does not."""

    def __init__(self, model: LlamaModel, layers: Sequence[_Layer]) -> None:
        cfg = model.config
        self._layers = (_Layer * len(layers))(*layers)
        self._model = _Model(
            num_layers=len(layers),
            hidden=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate=model.layers[0].down.in_features,
            eps=cfg.rms_norm_eps,
            scale=model.scale,
            cos=model.rotary.cos.data_ptr(),
            sin=model.rotary.sin.data_ptr(),
            max_positions=model.rotary.cos.shape[0],
            layers=self._layers,
        )
        # The C tables point into these: the model owns them, this keeps them alive too.
        self._owner = model
        self._caches_key: tuple[int, ...] = ()
        self._cache_ptrs: tuple[ctypes.Array[ctypes.c_void_p], ctypes.Array[ctypes.c_void_p]] | None = None
        self._lora = LoraTables(model.layers)
        # Where each linear layer's table lies, for refresh.
        self._tables = {id(getattr(layer, name)): (i, name) for i, layer in enumerate(model.layers) for name in LINEARS}

    @staticmethod
    def build(model: LlamaModel) -> FusedDecoder | str:
        """The fused decoder for `model`, or the reason the torch path serves it."""
        if os.environ.get("STOKER_FUSED_DECODER", "1") == "0":
            return "STOKER_FUSED_DECODER=0"
        if model.device.type != "cpu" or model.dtype != torch.float32:
            return f"activations are {model.dtype} on {model.device.type} (the fused path is float32 on the CPU)"
        if not (_f32(model.rotary.cos) and _f32(model.rotary.sin)):
            return "the rotary tables are not contiguous float32"
        layers = []
        for i, layer in enumerate(model.layers):
            tables = {}
            for name in LINEARS:
                table = _linear_table(getattr(layer, name))
                if isinstance(table, str):
                    return f"layer {i} {name}: {table}"
                tables[name] = table
            norms = (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)
            if not all(_f32(t) for t in norms):
                return f"layer {i}: norm weights are not contiguous float32"
            layers.append(
                _Layer(
                    input_norm=_ptr(layer.input_norm),
                    post_norm=_ptr(layer.post_norm),
                    q_norm=_ptr(layer.q_norm),
                    k_norm=_ptr(layer.k_norm),
                    **tables,
                )
            )
        lib = _current_library()
        if lib is None:
            return "the C kernels are unavailable"
        fused = FusedDecoder(model, layers)
        if not lib.decoder_model_ok(ctypes.byref(fused._model)):
            return "the C decoder does not take this model's shapes"
        return fused

    def refresh(self, linear: GGMLLinear) -> None:
        """Point the table of `linear` (one of the stack's) at what it serves now: its
        panels once repacked (quant/repack.py). Between steps only."""
        where = self._tables.get(id(linear))
        if where is None:
            return  # the LM head: run by the model, not the stack
        table = _linear_table(linear)
        if isinstance(table, str):  # it served as blocks; its panels serve as surely
            raise RuntimeError(f"layer {where[0]} {where[1]}: {table}")
        setattr(self._layers[where[0]], where[1], table)

    def serves(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether the KV cache is one it reads (float32, bfloat16, float16, or int8 or fp8
        e4m3 rows with scales (kv_quant.py), contiguous, on the CPU); fixed per runner."""
        k, v = kv_caches[0]
        return (
            k.dtype == v.dtype
            and k.dtype in KV_FORMATS
            and k.is_cpu
            and v.is_cpu
            and k.is_contiguous()
            and v.is_contiguous()
        )

    def _caches(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[ctypes.Array[ctypes.c_void_p], ctypes.Array[ctypes.c_void_p]]:
        """Per-layer cache pointers as C arrays, rebuilt only when the caches change."""
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if key != self._caches_key or self._cache_ptrs is None:
            n = len(kv_caches)
            self._cache_ptrs = ((_p * n)(*key[0::2]), (_p * n)(*key[1::2]))
            self._caches_key = key
        return self._cache_ptrs

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Runs every layer on hidden [n, hidden_size] (contiguous float32) in place and returns it;
        lora: each row's adapter (None: the base alone)."""
        lib = _current_library()
        if lib is None:
            raise RuntimeError("the fused decoder's C library is unavailable")
        if not _f32(hidden) or hidden.dim() != 2:
            raise ValueError("hidden must be a contiguous float32 [tokens, hidden_size] CPU tensor")
        n = hidden.shape[0]
        tables, row_seq = _step_tables(meta, n)
        k_ptrs, v_ptrs = self._caches(kv_caches)
        positions = positions.contiguous()
        slots = meta.slot_mapping.contiguous()
        step = _Step(
            n=n,
            positions=positions.data_ptr(),
            slots=slots.data_ptr(),
            tables=tables.data_ptr(),
            max_blocks=tables.shape[1],
            row_seq=_ptr(row_seq),
            k_caches=ctypes.addressof(k_ptrs),
            v_caches=ctypes.addressof(v_ptrs),
            block_size=kv_caches[0][0].shape[1],
            kv_format=KV_FORMATS[kv_caches[0][0].dtype],
        )
        if lora is not None:
            lora_step = self._lora.step(lora, n)
            step.row_lora = lora_step.row_lora.data_ptr()
            step.loras = ctypes.addressof(lora_step.tables)
            step.num_loras = lora_step.num_loras
            step.lora_width = lora_step.width
        rc = lib.decoder_forward(
            ctypes.byref(self._model), ctypes.byref(step), hidden.data_ptr(), torch.get_num_threads()
        )
        if rc == 1:
            raise MemoryError("the fused decoder could not allocate its scratch memory")
        if rc == 3:
            raise ValueError(f"a position is beyond the rotary tables ({self._model.max_positions} positions)")
        if rc == 4:
            raise ValueError(f"a row names an adapter outside the step's {step.num_loras}")
        if rc != 0:
            raise RuntimeError(f"the fused decoder failed (code {rc})")
        return hidden


def _step_tables(meta: AttentionMetadata, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block table per sequence (decodes, then each prefill chunk) and, when
    any row shares a sequence with another, each row's sequence index."""
    nd = meta.num_decodes
    if nd != n - sum(c.query_len for c in meta.prefills):
        raise ValueError("the attention metadata does not cover the step's tokens")
    decode = meta.decode_block_tables
    if nd and decode is None:
        raise ValueError("decode rows without block tables in the attention metadata")
    if not meta.prefills:
        assert decode is not None
        return decode.contiguous(), None
    width = max([c.block_ids.numel() for c in meta.prefills] + ([decode.shape[1]] if decode is not None else []))
    tables = torch.zeros(nd + len(meta.prefills), width, dtype=torch.int64)
    row_seq = torch.empty(n, dtype=torch.int32)
    if decode is not None and nd:
        tables[:nd, : decode.shape[1]] = decode
        row_seq[:nd] = torch.arange(nd, dtype=torch.int32)
    for i, chunk in enumerate(meta.prefills):
        tables[nd + i, : chunk.block_ids.numel()] = chunk.block_ids
        row_seq[chunk.query_start : chunk.query_start + chunk.query_len] = nd + i
    return tables, row_seq
