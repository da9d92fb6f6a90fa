"""The one list of decoder architectures stoker serves, and the protocol their
model classes meet.

Loaders check names against this list, the engine builds the model through it,
and error messages name what it holds. Adding an architecture is one entry here
plus its model file and tests (docs/architecture.md has the recipe).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from stoker.config import ModelConfig

if TYPE_CHECKING:
    from stoker.models.attention import AttentionMetadata


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
    ) -> torch.Tensor:
        """float32 logits [len(logits_indices), vocab] for the rows asked for."""
        ...


# (config, weights, dtype, device, max_positions) -> model. Weights are the loader's map:
# Hugging Face names, each a dense tensor or a quantized weight.
ModelBuilder = Callable[[ModelConfig, Mapping[str, object], torch.dtype, torch.device, "int | None"], DecoderModel]


@dataclass(frozen=True)
class Architecture:
    hf_name: str
    """config.json's "architectures" entry, and ModelConfig.architecture."""
    gguf_names: tuple[str, ...]
    """GGUF general.architecture values that load as this architecture."""
    build: ModelBuilder


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
        # llama.cpp files Mistral under "llama"; the GGUF loader tells them apart by name.
        Architecture("LlamaForCausalLM", ("llama",), _llama_family),
        Architecture("MistralForCausalLM", (), _llama_family),
        Architecture("Qwen2ForCausalLM", ("qwen2",), _llama_family),
        Architecture("Qwen3ForCausalLM", ("qwen3",), _llama_family),
    )
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)
GGUF_ARCHITECTURES: dict[str, str] = {g: a.hf_name for a in ARCHITECTURES.values() for g in a.gguf_names}


def architecture(hf_name: str | None) -> Architecture:
    """The registered architecture, or a ValueError that lists the supported ones."""
    if hf_name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {hf_name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return ARCHITECTURES[hf_name]


def gguf_architecture(gguf_name: str | None) -> str:
    """The Hugging Face architecture a GGUF general.architecture loads as."""
    if gguf_name not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {gguf_name!r}; supported: "
            + ", ".join(f"{g} ({hf})" for g, hf in GGUF_ARCHITECTURES.items())
        )
    return GGUF_ARCHITECTURES[gguf_name]


def build_model(
    config: ModelConfig,
    weights: Mapping[str, object],
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
) -> DecoderModel:
    return architecture(config.architecture).build(config, weights, dtype, device, max_positions)
