"""PEFT LoRA folders (adapter_config.json + adapter_model.safetensors, as
save_pretrained writes them) read into a LoraAdapter.

The scale of each module is PEFT's: lora_alpha / r, or lora_alpha / sqrt(r)
with use_rslora, where alpha_pattern may give a module its own alpha and
rank_pattern its own rank (read from its tensors' shapes). layers_to_transform
needs nothing: the file holds only the layers it names. Settings that change
the arithmetic in ways stoker does not apply are refused, as are .bin weights
(a pickle can run code when it is loaded).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from stoker.config import ModelConfig
from stoker.models.lora import STACKS, LoraAdapter, LoraError, ModuleWeights, build_adapter, check_target

_MLP_MODULES = frozenset(STACKS["gate_up"] + STACKS["down"])
_UNSUPPORTED_SETTINGS = {
    "use_dora": "DoRA",
    "modules_to_save": "whole trained layers beside the adapter",
    "trainable_token_indices": "trained embedding rows",
    "alora_invocation_tokens": "activated LoRA",
    "layer_replication": "replicated layers",
    "target_parameters": "LoRA on raw parameters",
    "fan_in_fan_out": "GPT-2 style Conv1D weights",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
}
"""adapter_config.json settings that change the arithmetic in ways stoker does not apply, when set."""

_PEFT_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight"
)


def load_peft_lora(name: str, path: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    folder = Path(path)
    settings = _peft_config(name, folder)
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise LoraError.of(
                name,
                "adapter_model.bin is a pickle, which stoker never loads (unpickling can run code);"
                " save the adapter with safe_serialization=True",
            )
        raise LoraError.of(name, f"no adapter_model.safetensors in {path}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoraError.of(name, f"adapter_model.safetensors is unreadable (corrupt or truncated?): {exc}") from exc
    r, alpha = settings["r"], settings["lora_alpha"]
    rslora = bool(settings.get("use_rslora", False))

    def scale_of(module_path: str, rank: int) -> float:
        module_alpha = float(_pattern_value(settings.get("alpha_pattern") or {}, module_path, alpha))
        return module_alpha / math.sqrt(rank) if rslora else module_alpha / rank

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.fullmatch(key)
        if match is None:
            raise LoraError.of(name, _unsupported_key(key))
        layer, module, which = int(match[1]), match[2], match[3]
        check_target(name, module)
        pairs.setdefault((layer, module), {})[which] = tensor
    modules: dict[tuple[int, str], ModuleWeights] = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoraError.of(name, f"layers.{layer}.{module} has lora_{''.join(pair)} but not its pair")
        rank = int(pair["A"].shape[0])
        module_path = f"model.layers.{layer}.{'mlp' if module in _MLP_MODULES else 'self_attn'}.{module}"
        modules[(layer, module)] = ModuleWeights(pair["A"].float(), pair["B"].float(), scale_of(module_path, rank))
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    return build_adapter(name, path, config, max_rank, scale, modules)


def _peft_config(name: str, folder: Path) -> dict[str, Any]:
    """adapter_config.json, checked for what stoker cannot apply."""
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise LoraError.of(
            name, f"no adapter_config.json in {folder} (a PEFT adapter folder holds it and adapter_model.safetensors)"
        )
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError.of(name, f"adapter_config.json is not valid JSON: {exc}") from exc
    if not isinstance(settings, dict):
        raise LoraError.of(name, "adapter_config.json is not a JSON object")
    peft_type = settings.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError.of(name, f"peft_type {peft_type!r} is not supported (only LORA)")
    for key, what in _UNSUPPORTED_SETTINGS.items():
        if settings.get(key):
            raise LoraError.of(name, f"{key} {settings[key]!r} is not supported ({what})")
    targets = settings.get("target_modules")
    if isinstance(targets, list):
        for module in targets:
            check_target(name, str(module))
    r, alpha = settings.get("r", 8), settings.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraError.of(name, f"adapter_config.json: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoraError.of(name, f"adapter_config.json: lora_alpha must be a number, got {alpha!r}")
    settings["r"], settings["lora_alpha"] = r, alpha
    return settings


def _pattern_value(patterns: Mapping[str, Any], module_path: str, default: float) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module's name or a suffix of it."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module_path):
            return value
    return default


def _unsupported_key(key: str) -> str:
    if "lora_embedding" in key or "embed_tokens" in key:
        return f"tensor {key!r}: LoRA on embeddings is not supported"
    if "lora_magnitude_vector" in key:
        return f"tensor {key!r}: DoRA (magnitude vectors) is not supported"
    if "modules_to_save" in key or "lm_head" in key:
        return f"tensor {key!r}: modules_to_save and the LM head are not supported"
    if key.endswith(".bias"):
        return f"tensor {key!r}: trained biases (bias != 'none', lora_bias) are not supported"
    return f"tensor {key!r} is not the LoRA A or B of a decoder layer's projection"
