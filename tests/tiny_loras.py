"""Random-weight LoRA adapters for tests: PEFT folders written by peft's own
save_pretrained over a tiny base (tests/tiny_models.py), the same adapters as
llama.cpp GGUF LoRA files (written with the gguf package the way
convert_lora_to_gguf.py lays them out), and transformers + PEFT's merged model
as the reference."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

_GGML_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def make_peft_adapter(
    base: Path,
    out: Path,
    *,
    rank: int,
    targets: list[str],
    alpha: float = 16.0,
    seed: int = 0,
    magnitude: float = 0.1,
    **lora_args: Any,
) -> Path:
    """A PEFT LoRA folder for the HF model folder `base`, every A and B random
    (PEFT initializes B to zero, which would make the adapter a no-op). Extra
    LoraConfig arguments (use_rslora, layers_to_transform, ...) pass through."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **lora_args)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(magnitude * torch.randn(param.shape, generator=gen))
    peft_model.save_pretrained(out)
    return out


def merged_reference(base: Path, adapter: Path) -> torch.nn.Module:
    """transformers' model of base with the adapter merged into its weights (float32)."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged: torch.nn.Module = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return merged.eval()


def _interleave_qk_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order from Hugging Face's (what its converter does to Llama's q and k)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_lora(
    peft_folder: Path,
    out: Path,
    *,
    arch: str = "llama",
    heads: int,
    kv_heads: int,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
) -> Path:
    """The PEFT adapter as a llama.cpp GGUF LoRA file: blk.N.<ggml name>.weight.lora_a/.lora_b,
    B's q/k rows in llama.cpp's order for Llama, adapter.lora.alpha such that alpha / r is
    PEFT's scale (one rank for all modules). qtype: F32, F16 or BF16."""
    import json

    from safetensors.torch import load_file

    settings = json.loads((peft_folder / "adapter_config.json").read_text())
    rank = settings["r"]
    scale = settings["lora_alpha"] / (rank**0.5 if settings.get("use_rslora") else rank)
    tensors = load_file(str(peft_folder / "adapter_model.safetensors"))
    writer = GGUFWriter(str(out), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", scale * rank)
    for key in sorted(tensors):
        parts = key.split(".")
        layer, module, which = int(parts[4]), parts[6], parts[7]
        w = tensors[key].float().numpy()
        if which == "lora_B" and arch == "llama" and module in ("q_proj", "k_proj"):
            w = _interleave_qk_rows(w, heads if module == "q_proj" else kv_heads)
        name = f"blk.{layer}.{_GGML_NAMES[module]}.weight.lora_{which[-1].lower()}"
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float16))
        else:
            from gguf.quants import quantize

            writer.add_tensor(name, quantize(np.ascontiguousarray(w, dtype=np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
