"""Tiny random-weight decoders saved as Hugging Face folders, for fast tests.

Each folder holds config.json, *.safetensors (sharded on request), the default
model's converted tokenizer (so prompts tokenize like the real model) and its
ChatML template. transformers' own forward over the same folder is the
reference that the engine's output is compared with.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
TINY_SIZES: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
}


@functools.lru_cache(maxsize=1)
def default_tokenizer_files() -> dict[str, bytes]:
    """The default model's converted tokenizer as files (converted once, then cached)."""
    from stoker.config import default_model_path
    from stoker.models.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.hf.save_pretrained(tmp)
        return {name: (Path(tmp) / name).read_bytes() for name in os.listdir(tmp)}


def make_tiny_hf_model(
    arch: str,
    tmp_path: str | os.PathLike[str],
    *,
    tie: bool = False,
    shards: int = 1,
    seed: int = 0,
) -> Path:
    """Build, randomize and save a tiny model of arch (llama, qwen2, qwen3, mistral); returns its folder."""
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(ARCHITECTURES)}")
    folder = Path(tmp_path) / f"tiny-{arch}{'-tied' if tie else ''}{f'-{shards}shards' if shards > 1 else ''}-s{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in default_tokenizer_files().items():
        (folder / name).write_bytes(data)
    tokenizer_vocab = 49152  # the default SmolLM2 tokenizer; embeddings must cover every id

    class_name = ARCHITECTURES[arch]
    config_cls = getattr(transformers, class_name.replace("ForCausalLM", "Config"))
    extra: dict[str, object] = {}
    if arch in ("qwen2", "qwen3", "mistral"):
        # Sliding-window attention would make transformers' reference differ from a full-attention engine.
        extra = {"sliding_window": None, "use_sliding_window": False} if arch != "mistral" else {"sliding_window": None}
    config = config_cls(
        vocab_size=tokenizer_vocab,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **TINY_SIZES,
        **extra,
    )
    config.architectures = [class_name]
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config).to(torch.float32).eval()
    _randomize(model, seed)
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    max_shard = total if shards <= 1 else total // shards + 1
    model.save_pretrained(folder, max_shard_size=max_shard, safe_serialization=True)
    return folder


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers zero-inits biases and one-inits norms; random values make every
    parameter matter, so a loader that drops or misplaces one fails the comparison."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                # Larger than the usual 0.02 so logits are well separated and greedy ties are unlikely.
                param.copy_(0.1 * noise)


def set_config(folder: Path, **updates: object) -> None:
    """Edit config.json in place (for tests of rope scaling, eos lists and the like)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(updates)
    path.write_text(json.dumps(config, indent=2))
