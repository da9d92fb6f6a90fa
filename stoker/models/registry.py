"""The one list of decoder architectures stoker serves, each with the facts its
loaders need, and the protocol their model classes meet.

An entry says everything that differs between families: which projections carry
a bias, whether q and k are normed, how a GGUF file names the family, its tensors
and its q/k row order. Loaders and the model builder read these facts; none of
them compares architecture names (tests/unit/models/test_registry.py keeps it so).
Adding an architecture is one entry here plus its tests, and a model file if it
is not a Llama variant (docs/architecture.md has the recipe).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from stoker.config import ModelConfig

if TYPE_CHECKING:
    from stoker.models.attention import AttentionMetadata
    from stoker.models.lora import LoraBatch


class DecoderModel(Protocol):
    """What the runner needs of a model: one forward over a flattened step."""

    config: ModelConfig
    dtype: torch.dtype
    device: torch.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """float32 logits [len(logits_indices), vocab] for the rows asked for; lora: each row's
        adapter (models/lora.py), None for the base alone."""
        ...


# (config, weights, dtype, device, max_positions) -> model. Weights are the loader's map:
# Hugging Face names, each a dense tensor or a quantized weight.
ModelBuilder = Callable[[ModelConfig, Mapping[str, object], torch.dtype, torch.device, "int | None"], DecoderModel]


@dataclass(frozen=True)
class GGUFTensorNames:
    """llama.cpp's tensor names to Hugging Face's: `blk.N.<layer key>.weight` becomes
    `model.layers.N.<value>.weight`, `<top key>.weight` becomes `<value>.weight`."""

    layer: Mapping[str, str]
    top: Mapping[str, str]

    def hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face name, or None for a tensor HF has no place for (rope_freqs)."""
        base, _, kind = gguf_name.rpartition(".")
        if base.startswith("blk."):
            _, layer, part = base.split(".", 2)
            hf = self.layer.get(part)
            return f"model.layers.{layer}.{hf}.{kind}" if hf else None
        hf = self.top.get(base)
        return f"{hf}.{kind}" if hf else None


LLAMA_GGUF_TENSORS = GGUFTensorNames(
    layer={
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    top={"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
)
"""The Llama family's tensors (Mistral, Qwen2 and Qwen3 name theirs the same way)."""

QKRowOrder = Literal["halves", "interleaved"]
"""How a GGUF stores each head's q and k rows. "halves": Hugging Face's order (rotary
pairs i and i + d/2; llama.cpp's NEOX rope). "interleaved": pairs 2i and 2i + 1, as
llama.cpp's NORM rope reads them; the converter permuted the rows and the loader
permutes them back."""


@dataclass(frozen=True)
class GGUFFacts:
    """How llama.cpp's GGUF files hold one architecture."""

    architecture: str
    """general.architecture; also the prefix of the model's metadata keys (`<it>.block_count`,
    `<it>.rope.freq_base`, `<it>.rope.scaling.type`, ...)."""
    qk_rows: QKRowOrder
    name_contains: str | None = None
    """For a family llama.cpp files under another's general.architecture: a file is this one
    when its general.name contains this text (any case), as transformers tells them apart.
    None: the architecture's default family."""
    tensors: GGUFTensorNames = LLAMA_GGUF_TENSORS


@dataclass(frozen=True)
class Architecture:
    hf_name: str
    """config.json's "architectures" entry, and ModelConfig.architecture."""
    build: ModelBuilder
    gguf: GGUFFacts | None
    """How GGUF files hold it; None: it loads only from a Hugging Face folder."""
    qkv_bias: bool = False
    """q, k and v projections always carry a bias, whatever config.json says (Qwen2's config has
    no switch for them). False: config.json's attention_bias decides (absent means none)."""
    qk_norm: bool = False
    """RMSNorm on each head of q and k before rotary (Qwen3). A GGUF says it by holding
    attn_q_norm tensors; a Hugging Face config.json does not say it at all."""


def _llama_family(
    config: ModelConfig,
    weights: Mapping[str, object],
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None,
) -> DecoderModel:
    # Imported here: the model module imports the kernels, which the loaders do not need.
    from stoker.models.llama import LlamaModel

    return LlamaModel(config, weights, dtype, device, max_positions)  # type: ignore[arg-type]


ARCHITECTURES: dict[str, Architecture] = {
    a.hf_name: a
    for a in (
        Architecture("LlamaForCausalLM", _llama_family, GGUFFacts("llama", qk_rows="interleaved")),
        # llama.cpp files Mistral under "llama"; transformers tells them apart by general.name, so do we.
        Architecture(
            "MistralForCausalLM", _llama_family, GGUFFacts("llama", qk_rows="interleaved", name_contains="mistral")
        ),
        Architecture("Qwen2ForCausalLM", _llama_family, GGUFFacts("qwen2", qk_rows="halves"), qkv_bias=True),
        Architecture("Qwen3ForCausalLM", _llama_family, GGUFFacts("qwen3", qk_rows="halves"), qk_norm=True),
    )
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)
GGUF_ARCHITECTURES: dict[str, str] = {
    a.gguf.architecture: a.hf_name for a in ARCHITECTURES.values() if a.gguf and a.gguf.name_contains is None
}
"""Each GGUF general.architecture stoker loads, and the family it loads as by default."""


def architecture(hf_name: str | None) -> Architecture:
    """The registered architecture, or a ValueError that lists the supported ones."""
    if hf_name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {hf_name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return ARCHITECTURES[hf_name]


def gguf_architecture(gguf_name: str | None, general_name: str | None = None) -> Architecture:
    """The architecture a GGUF with this general.architecture and general.name loads as."""
    if gguf_name not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {gguf_name!r}; supported: "
            + ", ".join(f"{g} ({hf})" for g, hf in GGUF_ARCHITECTURES.items())
        )
    name = (general_name or "").lower()
    for a in ARCHITECTURES.values():
        marker = a.gguf.name_contains if a.gguf and a.gguf.architecture == gguf_name else None
        if marker is not None and marker.lower() in name:
            return a
    return ARCHITECTURES[GGUF_ARCHITECTURES[gguf_name]]


def build_model(
    config: ModelConfig,
    weights: Mapping[str, object],
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
) -> DecoderModel:
    return architecture(config.architecture).build(config, weights, dtype, device, max_positions)
