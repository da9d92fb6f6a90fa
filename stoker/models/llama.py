"""Llama-family decoder over a paged KV cache: Llama 2/3, SmolLM, Mistral,
Qwen2/2.5 (qkv bias) and Qwen3 (q/k RMSNorm)."""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, TypeVar

import torch

from stoker.config import ModelConfig
from stoker.models.attention import AttentionMetadata, paged_attention, write_kv
from stoker.models.fused_decoder import FusedDecoder
from stoker.models.layers import Rotary, gated_mlp, rms_norm
from stoker.models.lora import LoraAdapter, LoraBatch, add_lora
from stoker.models.quant.repack import BackgroundRepack
from stoker.models.quant.weights import (
    Embedding,
    GGMLLinear,
    LinearWeight,
    WeightLike,
    deferred_packing,
    dense_weight,
    make_linear,
)
from stoker.models.registry import architecture

log = logging.getLogger("stoker.models")


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor
    qkv: LinearWeight
    """q, k and v projections stacked into one matmul (with Qwen2's bias)."""
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: LinearWeight
    post_norm: torch.Tensor
    gate_up: LinearWeight
    down: LinearWeight


P = ParamSpec("P")
R = TypeVar("R")


def _holding_weights(method: Callable[Concatenate[LlamaModel, P], R]) -> Callable[Concatenate[LlamaModel, P], R]:
    """The method runs under the model's weights lock: a repacked layer swaps in
    between forward passes, never inside one (quant/repack.py)."""

    @functools.wraps(method)
    def holding(model: LlamaModel, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with model.weights_lock:
            return method(model, *args, **kwargs)

    return holding


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, WeightLike],
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int | None = None,
    ) -> None:
        """weights: dense tensors and, for quantized checkpoints, GGMLTensors (linear
        layers and the embedding table); norms and biases are always dense."""
        architecture(config.architecture)  # a ValueError naming the supported ones
        self.config = config
        self.dtype = dtype
        self.device = device

        def raw(name: str) -> WeightLike:
            if name not in weights:
                raise ValueError(f"weight {name!r} missing from the checkpoint")
            return weights[name]

        def w(name: str) -> torch.Tensor:
            return dense_weight(raw(name), dtype, device)

        def maybe(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        def linear(names: list[str], bias: list[str] | None = None) -> LinearWeight:
            biases = [maybe(b) for b in bias or []]
            present = [b for b in biases if b is not None]
            stacked = torch.cat(present) if biases and len(present) == len(biases) else None
            return make_linear([raw(n) for n in names], stacked, dtype, device)

        self.embed = Embedding(raw("model.embed_tokens.weight"), dtype, device)
        self.layers: list[DecoderLayer] = []
        # The layers serve their blocks first; self.repack packs them while the model serves.
        with deferred_packing() as to_repack:
            for i in range(config.num_layers):
                p = f"model.layers.{i}."
                a = p + "self_attn."
                qkv_bias = [a + f"{x}_proj.bias" for x in "qkv"] if config.attention_bias else None
                self.layers.append(
                    DecoderLayer(
                        input_norm=w(p + "input_layernorm.weight"),
                        qkv=linear([a + f"{x}_proj.weight" for x in "qkv"], qkv_bias),
                        q_norm=maybe(a + "q_norm.weight") if config.qk_norm else None,
                        k_norm=maybe(a + "k_norm.weight") if config.qk_norm else None,
                        o_proj=linear([a + "o_proj.weight"]),
                        post_norm=w(p + "post_attention_layernorm.weight"),
                        gate_up=linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                        down=linear([p + "mlp.down_proj.weight"]),
                    )
                )
            tied = config.tie_word_embeddings or "lm_head.weight" not in weights
            # Tied: the embedding's own table (quantized or dense), never a second copy.
            self.lm_head = make_linear([self.embed.table if tied else raw("lm_head.weight")], None, dtype, device)
        self.norm = w("model.norm.weight")
        self.rotary = Rotary(
            config.head_dim,
            max_positions or config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype,
            device,
        )
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        # Built once here; it then serves every step (never only some: batch invariance).
        fused = FusedDecoder.build(self)
        self.fused = fused if isinstance(fused, FusedDecoder) else None
        self.weights_lock = threading.Lock()  # see _holding_weights
        self.repack = BackgroundRepack(to_repack, self.weights_lock, self._repacked)
        self.repack.start()
        # Adapters' tensors copied to a device other than the CPU they load on, while they live.
        self._device_adapters: weakref.WeakKeyDictionary[LoraAdapter, LoraAdapter] = weakref.WeakKeyDictionary()
        if self.fused is not None:
            log.info(
                "decoder layers: fused C path (one call per step for all %d layers, running the"
                " attention backend's C kernels inside it where that backend is cpu-paged-c)",
                config.num_layers,
            )
        else:
            log.info("decoder layers: torch path (%s)", fused)

    @_holding_weights
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Runs the flattened batch; returns float32 logits for logits_indices only.
        lora: each row's adapter (None, or every row -1: the base alone, today's arithmetic)."""
        cfg = self.config
        hidden = self.embed(input_ids)
        if lora is not None and lora.row_adapter.shape != input_ids.shape:
            raise ValueError(f"the LoRA batch covers {lora.row_adapter.numel()} rows, the step {input_ids.numel()}")
        if lora is not None and not lora.active:
            lora = None
        if self.fused is not None and meta.backend.runs_in_fused_stack and self.fused.serves(kv_caches):
            hidden = self.fused(hidden.contiguous(), positions, kv_caches, meta, lora)
            return self._logits(hidden, logits_indices)
        n = hidden.shape[0]
        adapters = self._adapters_on_device(lora)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):

            def adapted(stack: str, linear: LinearWeight, i: int = i) -> Callable[[torch.Tensor], torch.Tensor]:
                """The stacked linear with each row's adapter update added after the base matmul."""
                if lora is None:
                    return linear
                batch = lora
                return lambda rows: add_lora(linear(rows), rows, stack, i, batch, adapters)

            residual = hidden
            x = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            qkv = adapted("qkv", layer.qkv)(x)
            q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(n, cfg.num_heads, cfg.head_dim)
            k = k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            q = self.rotary(q, positions)
            k = self.rotary(k, positions)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            hidden = residual + adapted("o_proj", layer.o_proj)(attn)
            residual = hidden
            x = rms_norm(hidden, layer.post_norm, cfg.rms_norm_eps)
            hidden = residual + gated_mlp(x, adapted("gate_up", layer.gate_up), adapted("down", layer.down))
        return self._logits(hidden, logits_indices)

    def _repacked(self, linear: GGMLLinear) -> None:
        """A linear layer now serves from its panels: so does the fused stack's table of it."""
        if self.fused is not None:
            self.fused.refresh(linear)

    def _adapters_on_device(self, lora: LoraBatch | None) -> list[LoraAdapter]:
        if lora is None:
            return []
        if self.device.type == "cpu":
            return lora.adapters
        moved = []
        for adapter in lora.adapters:
            if adapter not in self._device_adapters:
                self._device_adapters[adapter] = adapter.to(self.device)
            moved.append(self._device_adapters[adapter])
        return moved

    def _logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        last = hidden[logits_indices]
        last = rms_norm(last, self.norm, self.config.rms_norm_eps)
        return self.lm_head(last).float()
