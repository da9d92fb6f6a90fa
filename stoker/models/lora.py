"""LoRA adapters over a loaded base: PEFT folders and llama.cpp GGUF LoRA files
read into one layout, and the per-row low-rank update of the torch path.

An adapter changes a linear layer's output to y = x W^T + scale * (x A^T) B^T
for the rows (tokens) of the requests that name it. The base matmul runs once
for the whole batch; each adapter's rows are gathered, multiplied by its A
then its B (two small GEMMs), and added back into their output columns, as the
punica / S-LoRA kernels group rows by adapter. The fused C stack does the same
in csrc/decoder_layer.c from the tables fused_decoder.py builds from this layout.

The model stacks q/k/v into one `qkv` matmul and gate/up into `gate_up`, so an
adapter is held per stacked linear: its modules' A matrices stacked by rows
(one shrink GEMM for all of them), and per module its B, transposed to
[rank, columns] and pre-multiplied by the module's scale, with the output
columns it lands in. Everything is float32.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from stoker.config import ModelConfig

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may adapt: every linear layer of a Llama-family decoder."""

STACKS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""The model's stacked linears (llama.DecoderLayer's fields) and the modules each holds, in column order."""

_UNSUPPORTED_TARGETS = {"embed_tokens": "embeddings", "lm_head": "the LM head"}


class LoraError(ValueError):
    """Why an adapter cannot serve this base: one line naming the adapter and the reason."""

    @classmethod
    def of(cls, name: str, reason: str) -> LoraError:
        return cls(f"LoRA adapter {name!r}: {reason}")


@dataclass(frozen=True)
class LoraPart:
    """One adapted module inside a stacked linear."""

    module: str
    rank_start: int
    """Its rows in the stacked A (and its entries of the shrunk activations)."""
    rank: int
    col_start: int
    """Its first output column in the stacked linear's output."""
    cols: int
    bt: torch.Tensor
    """scale * B^T: float32 [rank, cols], contiguous."""


@dataclass(frozen=True)
class LoraLinear:
    """An adapter's share of one stacked linear of one layer."""

    a: torch.Tensor
    """The adapted modules' A stacked by rows: float32 [sum of their ranks, in_features], contiguous."""
    parts: tuple[LoraPart, ...]

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    name: str
    path: str
    rank: int
    """The largest rank of its modules (what --max-lora-rank bounds)."""
    scale: float
    """lora_alpha / r (alpha / sqrt(r) with rsLoRA), as PEFT; already folded into each LoraPart.bt."""
    target_modules: frozenset[str]
    nbytes: int
    """Resident bytes of its tensors."""
    layers: tuple[Mapping[str, LoraLinear], ...]
    """Per decoder layer: stacked linear name (STACKS' keys) -> its share; absent where the adapter leaves it alone."""

    def to(self, device: torch.device) -> LoraAdapter:
        """A copy with its tensors on device (the torch path on CUDA)."""

        def move(lin: LoraLinear) -> LoraLinear:
            parts = tuple(
                LoraPart(p.module, p.rank_start, p.rank, p.col_start, p.cols, p.bt.to(device)) for p in lin.parts
            )
            return LoraLinear(lin.a.to(device), parts)

        layers = tuple({k: move(v) for k, v in layer.items()} for layer in self.layers)
        return LoraAdapter(self.name, self.path, self.rank, self.scale, self.target_modules, self.nbytes, layers)


@dataclass
class LoraBatch:
    """Which adapter each row of a step's flattened batch runs with."""

    adapters: list[LoraAdapter]
    """The distinct adapters of this step (at most EngineConfig.max_loras)."""
    row_adapter: torch.Tensor
    """int32 [num_tokens of the flattened step]: index into adapters, -1 = the base alone."""

    def __post_init__(self) -> None:
        rows = self.row_adapter
        if rows.dim() != 1 or rows.dtype != torch.int32:
            raise ValueError(f"row_adapter must be int32 [num_tokens], got {rows.dtype} {list(rows.shape)}")
        if rows.numel() and (int(rows.min()) < -1 or int(rows.max()) >= len(self.adapters)):
            raise ValueError(f"row_adapter holds an index outside -1 .. {len(self.adapters) - 1}")

    @cached_property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """(adapter index, its rows as int64) for each adapter with at least one row, in adapter order."""
        rows = self.row_adapter.to(torch.int64)
        found = []
        for i in range(len(self.adapters)):
            mine = torch.nonzero(rows == i).flatten()
            if mine.numel():
                found.append((i, mine))
        return found

    @property
    def active(self) -> bool:
        """Whether any row runs with an adapter (else the step is exactly the base's)."""
        return bool(self.groups)


def add_lora(
    y: torch.Tensor, x: torch.Tensor, stack: str, layer: int, batch: LoraBatch, adapters: list[LoraAdapter]
) -> torch.Tensor:
    """y (the stacked linear's output for input x) with each row's adapter update added in place.
    adapters: batch.adapters, or their copies on y's device."""
    for index, rows in batch.groups:
        lin = adapters[index].layers[layer].get(stack)
        if lin is None:
            continue
        rows = rows.to(y.device)
        shrunk = x.index_select(0, rows).float() @ lin.a.T  # [rows, rank]
        for part in lin.parts:
            update = shrunk[:, part.rank_start : part.rank_start + part.rank] @ part.bt
            y[:, part.col_start : part.col_start + part.cols].index_add_(0, rows, update.to(y.dtype))
    return y


# ---- building an adapter from its modules, with every check the base imposes ------------


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of this base."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def check_target(name: str, module: str) -> None:
    """A LoraError unless module is one of TARGET_MODULES."""
    if module in TARGET_MODULES:
        return
    what = _UNSUPPORTED_TARGETS.get(module)
    if what is not None:
        raise LoraError.of(
            name, f"target module {module!r} ({what}) is not supported; only {', '.join(TARGET_MODULES)}"
        )
    raise LoraError.of(name, f"unknown target module {module!r}; a Llama-family base has {', '.join(TARGET_MODULES)}")


@dataclass
class ModuleWeights:
    """One adapted module as read from a file: A [r, in], B [out, r] in the base's
    Hugging Face layout, and the scale its update is multiplied by."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def build_adapter(
    name: str,
    path: str,
    config: ModelConfig,
    max_rank: int,
    scale: float,
    modules: Mapping[tuple[int, str], ModuleWeights],
) -> LoraAdapter:
    """The adapter of modules ((layer, module) -> weights), after checking each against the base."""
    if not modules:
        raise LoraError.of(name, "it holds no LoRA tensors")
    shapes = module_shapes(config)
    rank = 0
    for (layer, module), w in modules.items():
        check_target(name, module)
        where = f"layers.{layer}.{module}"
        if layer >= config.num_layers:
            raise LoraError.of(
                name, f"it adapts layer {layer}; the base has {config.num_layers} (an adapter of another base)"
            )
        if w.a.dim() != 2 or w.b.dim() != 2 or w.a.shape[0] != w.b.shape[1]:
            raise LoraError.of(name, f"{where}: A {list(w.a.shape)} and B {list(w.b.shape)} are not a rank-r pair")
        r, (fan_in, fan_out) = int(w.a.shape[0]), shapes[module]
        if (w.a.shape[1], w.b.shape[0]) != (fan_in, fan_out):
            raise LoraError.of(
                name,
                f"{where} maps {w.a.shape[1]} -> {w.b.shape[0]} features; the base's maps {fan_in} -> {fan_out}"
                " (an adapter of another base)",
            )
        if r > max_rank:
            raise LoraError.of(name, f"{where} has rank {r}, above the maximum LoRA rank {max_rank} (--max-lora-rank)")
        if not (torch.isfinite(w.a).all() and torch.isfinite(w.b).all()):
            raise LoraError.of(name, f"{where} holds non-finite values (a corrupt file?)")
        rank = max(rank, r)
    layers: list[dict[str, LoraLinear]] = []
    for layer in range(config.num_layers):
        stacked: dict[str, LoraLinear] = {}
        for stack, members in STACKS.items():
            a_rows, parts, rank_at, col_at = [], [], 0, 0
            for module in members:
                weights = modules.get((layer, module))
                cols = shapes[module][1]
                if weights is not None:
                    r = int(weights.a.shape[0])
                    bt = (weights.b.float().T * weights.scale).contiguous()
                    parts.append(LoraPart(module, rank_at, r, col_at, cols, bt))
                    a_rows.append(weights.a.float())
                    rank_at += r
                col_at += cols
            if parts:
                stacked[stack] = LoraLinear(torch.cat(a_rows).contiguous(), tuple(parts))
        layers.append(stacked)
    nbytes = sum(
        lin.a.numel() * 4 + sum(p.bt.numel() * 4 for p in lin.parts) for layer in layers for lin in layer.values()
    )
    targets = frozenset(module for _, module in modules)
    return LoraAdapter(name, path, rank, scale, targets, nbytes, tuple(layers))


def load_lora(name: str, path: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) or a llama.cpp
    GGUF LoRA file, checked against the base `config`; a LoraError says why not."""
    if os.path.isdir(path):
        from stoker.models.lora_peft import load_peft_lora

        return load_peft_lora(name, path, config, max_rank)
    if os.path.isfile(path):
        from stoker.models.lora_gguf import load_gguf_lora

        return load_gguf_lora(name, path, config, max_rank)
    raise LoraError.of(name, f"{path}: no such file or folder")
