"""Load a decoder and its tokenizer from a GGUF file or a Hugging Face folder.

Whatever the file format, weights come back under Hugging Face names and
layouts (model.layers.N.self_attn.q_proj.weight, ...), so the model code has a
single weight map. The reference for every tensor and token id is what
transformers loads from the same file. GGUF specifics live in gguf_loader.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Set before transformers/huggingface_hub are imported anywhere below: nothing may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from stoker.config import ModelConfig
from stoker.models.gguf_loader import gguf_tokenizer, keeps_quantized, load_gguf
from stoker.models.identity import is_gguf, model_name
from stoker.models.quant.hf_quantize import QUANTIZE_AT_LOAD, check_quantization, quantize_weights
from stoker.models.quant.weights import WeightLike
from stoker.models.registry import SUPPORTED_ARCHITECTURES, Architecture, architecture
from stoker.models.tokenizer import Tokenizer, load_hf_tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LoadedModel",
    "load_model",
    "load_tokenizer",
]


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, WeightLike]
    """Dense tensors in dtype on device, and GGMLTensors for quantized linear/embedding weights."""
    tokenizer: Tokenizer


def load_model(path: str, dtype: torch.dtype, device: str = "cpu", quantization: str = "none") -> LoadedModel:
    """Load a GGUF file or a Hugging Face folder; dense weights in dtype on device.

    quantization is EngineConfig.quantization; this function defaults to "none"
    (every weight a dense tensor) so callers that compare tensors keep doing so.
    """
    check_quantization(quantization, device)
    if is_gguf(path):
        config, weights, tokenizer = load_gguf(path, dtype, device, "auto" if quantization == "auto" else "none")
        loaded = LoadedModel(config=config, weights=weights, tokenizer=tokenizer)
    else:
        loaded = _load_folder(path, dtype, device)
    if quantization in QUANTIZE_AT_LOAD:
        loaded.weights = quantize_weights(loaded.weights, quantization)
    return loaded


def weights_stay_quantized(path: str, device: str, quantization: str) -> bool:
    """Whether load_model(path, ..., device, quantization) keeps linear weights in
    GGML blocks (a GGUF in its own quantization, or an HF model quantized at load)."""
    check_quantization(quantization, device)
    if quantization in QUANTIZE_AT_LOAD:
        return True
    return is_gguf(path) and keeps_quantized(path, device, quantization)


def load_tokenizer(path: str) -> Tokenizer:
    """Just the tokenizer (e.g. for the HTTP process, which never holds weights)."""
    if is_gguf(path):
        return gguf_tokenizer(path)
    return _folder_tokenizer(path, _read_json(Path(path) / "config.json"))


# --- Hugging Face folders -------------------------------------------------------


def _load_folder(path: str, dtype: torch.dtype, device: str) -> LoadedModel:
    folder = Path(path)
    raw = _read_json(folder / "config.json")
    family = _check_architecture(raw)
    from transformers import AutoConfig

    # AutoConfig applies transformers' own defaults and legacy-key handling (rope_scaling,
    # head_dim), so our reading of config.json cannot drift from the reference.
    hf = AutoConfig.from_pretrained(folder, local_files_only=True)
    tokenizer = _folder_tokenizer(path, raw)
    theta, scaling = _rope(hf)
    heads = int(hf.num_attention_heads)
    config = ModelConfig(
        architecture=family.hf_name,
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.intermediate_size),
        num_layers=int(hf.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf, "head_dim", None) or hf.hidden_size // heads),
        max_position_embeddings=int(hf.max_position_embeddings),
        rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=family.qkv_bias or bool(getattr(hf, "attention_bias", False)),
        qk_norm=family.qk_norm,
        bos_token_id=hf.bos_token_id if hf.bos_token_id is not None else tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=model_name(path),
    )
    weights: dict[str, WeightLike] = dict(_read_safetensors(folder, dtype, device))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # one rule for model code: tied means embed_tokens
    elif "lm_head.weight" not in weights:
        raise ValueError(f"{path}: lm_head.weight is missing and tie_word_embeddings is false")
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer)


def _check_architecture(raw: dict[str, Any]) -> Architecture:
    archs = raw.get("architectures") or []
    return architecture(archs[0] if archs else None)


def _rope(hf: Any) -> tuple[float, dict[str, Any] | None]:
    """rope theta and scaling from transformers 5 (rope_parameters) or 4 (rope_theta, rope_scaling)."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling: dict[str, Any] | None = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(hf, "rope_theta", 10000.0))
        scaling = getattr(hf, "rope_scaling", None)
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.setdefault("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
    return theta, scaling


def _folder_tokenizer(path: str, raw: dict[str, Any]) -> Tokenizer:
    folder = Path(path)
    hf = load_hf_tokenizer(folder)
    template = hf.chat_template if isinstance(hf.chat_template, str) else None
    if template is None:
        # Older transformers only read tokenizer_config.json; look at both places ourselves.
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        else:
            template = _read_json(folder / "tokenizer_config.json", {}).get("chat_template")
    eos = _as_list(raw.get("eos_token_id"))
    eos += _as_list(_read_json(folder / "generation_config.json", {}).get("eos_token_id"))
    return Tokenizer(
        hf,
        eos_token_ids=eos,
        chat_template=template if isinstance(template, str) else None,
    )


def _read_safetensors(folder: Path, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if key.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved
                    continue
                weights[key] = f.get_tensor(key).to(device=device, dtype=dtype)
    return weights


# --- small helpers --------------------------------------------------------------


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_json(path: Path, default: dict[str, Any] | None = None) -> dict[str, Any]:
    if default is not None and not path.exists():
        return default
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data
