"""Load a decoder and its tokenizer from a GGUF file or a Hugging Face folder.

Whatever the file format, weights come back under Hugging Face names and
layouts (model.layers.N.self_attn.q_proj.weight, ...), so the model code has a
single weight map. The reference for every tensor and token id is what
transformers loads from the same file.

A GGUF's slow parts (parsing the header with its vocabulary, converting the
tokenizer) are cached under ~/.cache/stoker (STOKER_CACHE_DIR overrides), so a
second load only memory-maps the file and dequantizes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

# Set before transformers/huggingface_hub are imported anywhere below: nothing may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from stoker.config import ModelConfig
from stoker.models.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Bump when the cached layout or its derivation changes, so stale entries are ignored.
_CACHE_VERSION = "1"
# Dequantized weights are cached only up to this size: a 7B model in float32 would cost 28 GB of disk.
_WEIGHT_CACHE_MAX_BYTES = 4 << 30


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer


def load_model(path: str, dtype: torch.dtype, device: str = "cpu") -> LoadedModel:
    """Load a GGUF file or a Hugging Face folder; weights in dtype on device."""
    if _is_gguf(path):
        return _load_gguf(path, dtype, device)
    return _load_folder(path, dtype, device)


def load_tokenizer(path: str) -> Tokenizer:
    """Just the tokenizer (e.g. for the HTTP process, which never holds weights)."""
    if _is_gguf(path):
        return _gguf_tokenizer(path, _gguf_meta(path)["config"])
    return _folder_tokenizer(path, _read_json(Path(path) / "config.json"))


def cache_root() -> Path:
    return Path(os.environ.get("STOKER_CACHE_DIR") or Path.home() / ".cache" / "stoker")


def _is_gguf(path: str) -> bool:
    if os.path.isdir(path):
        return False
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no model at {path!r}: expected a .gguf file or a Hugging Face folder")
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# --- cache -------------------------------------------------------------------


def _gguf_cache_dir(path: str) -> Path:
    """Identity of a GGUF: path, size, mtime and its first MiB (header + vocabulary).

    Hashing whole multi-GB files would cost more than the cache saves; the
    conversion code's versions are part of the key because they shape the output.
    """
    st = os.stat(path)
    h = hashlib.sha256()
    ident = [_CACHE_VERSION, os.path.abspath(path), st.st_size, st.st_mtime_ns, version("gguf"), version("transformers")]
    h.update(repr(ident).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return cache_root() / "gguf" / h.hexdigest()[:32]


def _cached(target: Path, build: Callable[[Path], None]) -> Path:
    """Build target once, atomically: concurrent processes may race; one rename wins."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# --- GGUF ---------------------------------------------------------------------

_GGUF_LAYER_PARTS: dict[str, str] = {
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
}
_GGUF_TOP: dict[str, str] = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_QUANT_SUFFIX = re.compile(r"[._-](i?q\d\w*|f16|f32|bf16|fp16|fp32)$")


def _hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> Hugging Face name; None for tensors HF has no place for (rope_freqs)."""
    base, _, kind = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        hf = _GGUF_LAYER_PARTS.get(part)
        return f"model.layers.{layer}.{hf}.{kind}" if hf else None
    hf = _GGUF_TOP.get(base)
    return f"{hf}.{kind}" if hf else None


def _gguf_meta(path: str) -> dict[str, Any]:
    """ModelConfig fields and a tensor index (offset, type, shape) from the header, cached."""
    meta_dir = _cached(_gguf_cache_dir(path) / "meta", lambda tmp: _write_json(tmp / "meta.json", _read_gguf_header(path)))
    return _read_json(meta_dir / "meta.json")


def _read_gguf_header(path: str) -> dict[str, Any]:
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(_GGUF_ARCHITECTURES)} "
            f"(as Hugging Face {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    hf_arch = _GGUF_ARCHITECTURES[arch]
    # llama.cpp files Mistral under "llama"; transformers tells them apart by name, so do we.
    if arch == "llama" and "mistral" in str(field("general.name", "")).lower():
        hf_arch = "MistralForCausalLM"

    tensors = [
        {
            "gguf": t.name,
            "hf": _hf_name(t.name),
            "type": int(t.tensor_type),
            "dtype": t.data.dtype.str,
            "shape": list(t.data.shape),
            "offset": int(t.data_offset),
        }
        for t in reader.tensors
    ]
    rows = {t["gguf"]: t["shape"][0] for t in tensors}
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    scaling_type = field(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": field(f"{arch}.rope.scaling.factor", 1.0)}
        original = field(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = int(original)
    eos = [field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    stem = os.path.basename(path).lower().removesuffix(".gguf")
    config = ModelConfig(
        architecture=hf_arch,
        vocab_size=int(rows.get("token_embd.weight") or field(f"{arch}.vocab_size") or len(field("tokenizer.ggml.tokens"))),
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(f"{arch}.attention.key_length") or rows.get("blk.0.attn_q.weight", hidden) // heads),
        max_position_embeddings=int(field(f"{arch}.context_length")),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in rows,
        attention_bias="blk.0.attn_q.bias" in rows,
        qk_norm="blk.0.attn_q_norm.weight" in rows,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(e) for e in eos if e is not None],
        name=_QUANT_SUFFIX.sub("", stem) or stem,
    )
    # Only the "llama" converter interleaves q/k rows for its rotary layout.
    return {"config": dataclasses.asdict(config), "tensors": tensors, "permute_qk": arch == "llama"}


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head it stores the rotary pairs interleaved
    (row 2i, 2i+1), HF stores the halves (i, i + d/2)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_gguf(path: str, dtype: torch.dtype, device: str) -> LoadedModel:
    from safetensors.torch import load_file, save_file

    meta = _gguf_meta(path)
    config = ModelConfig(**meta["config"])
    if _dequantized_bytes(meta, dtype) <= _WEIGHT_CACHE_MAX_BYTES:
        # numpy dequantization of a Q4 file costs seconds on a busy CPU; reading it back is ~free.
        def build(tmp: Path) -> None:
            save_file(_dequantize_gguf(path, meta, config, dtype), str(tmp / "model.safetensors"))

        folder = _cached(_gguf_cache_dir(path) / f"weights-{str(dtype).removeprefix('torch.')}", build)
        weights = load_file(str(folder / "model.safetensors"), device=device)
    else:
        weights = {k: v.to(device) for k, v in _dequantize_gguf(path, meta, config, dtype).items()}
    tokenizer = _gguf_tokenizer(path, meta["config"])
    config.eos_token_ids = tokenizer.eos_token_ids
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer)


def _dequantized_bytes(meta: dict[str, Any], dtype: torch.dtype) -> int:
    elements = sum(int(np.prod(t["shape"][:-1])) * _row_elements(t) for t in meta["tensors"] if t["hf"])
    return elements * torch.empty((), dtype=dtype).element_size()


def _row_elements(t: dict[str, Any]) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t["type"])]
    return t["shape"][-1] * np.dtype(t["dtype"]).itemsize // type_size * block


def _dequantize_gguf(path: str, meta: dict[str, Any], config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor in HF name and layout, as transformers' GGUF loading produces it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    weights: dict[str, torch.Tensor] = {}
    for t in meta["tensors"]:
        if t["hf"] is None:
            continue
        item = np.dtype(t["dtype"])
        count = int(np.prod(t["shape"]))
        data = raw[t["offset"] : t["offset"] + count * item.itemsize].view(item).reshape(t["shape"])
        array = dequantize(data, GGMLQuantizationType(t["type"]))
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only mapping
            array = array.copy()
        w = torch.from_numpy(array)
        if meta["permute_qk"] and ".self_attn.q_proj." in t["hf"]:
            w = _unpermute(w, config.num_heads)
        elif meta["permute_qk"] and ".self_attn.k_proj." in t["hf"]:
            w = _unpermute(w, config.num_kv_heads)
        weights[t["hf"]] = w.to(dtype=dtype).contiguous()
    return weights


def _gguf_tokenizer(path: str, config: dict[str, Any]) -> Tokenizer:
    from transformers import AutoTokenizer

    def convert(tmp: Path) -> None:
        hf = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), local_files_only=True)
        hf.save_pretrained(tmp)

    folder = _cached(_gguf_cache_dir(path) / "tokenizer", convert)
    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return Tokenizer(hf, eos_token_ids=config["eos_token_ids"])


# --- Hugging Face folders -------------------------------------------------------


def _load_folder(path: str, dtype: torch.dtype, device: str) -> LoadedModel:
    folder = Path(path)
    raw = _read_json(folder / "config.json")
    arch = _check_architecture(raw)
    from transformers import AutoConfig

    # AutoConfig applies transformers' own defaults and legacy-key handling (rope_scaling,
    # head_dim), so our reading of config.json cannot drift from the reference.
    hf = AutoConfig.from_pretrained(folder, local_files_only=True)
    tokenizer = _folder_tokenizer(path, raw)
    theta, scaling = _rope(hf)
    heads = int(hf.num_attention_heads)
    config = ModelConfig(
        architecture=arch,
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
        # Qwen2 always has q/k/v biases; its config has no switch for them.
        attention_bias=arch == "Qwen2ForCausalLM" or bool(getattr(hf, "attention_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        bos_token_id=hf.bos_token_id if hf.bos_token_id is not None else tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=folder.resolve().name.lower(),
    )
    weights = _read_safetensors(folder, dtype, device)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # one rule for model code: tied means embed_tokens
    elif "lm_head.weight" not in weights:
        raise ValueError(f"{path}: lm_head.weight is missing and tie_word_embeddings is false")
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer)


def _check_architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


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
    from transformers import AutoTokenizer

    folder = Path(path)
    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    template = hf.chat_template if isinstance(hf.chat_template, str) else None
    if template is None:
        # Older transformers only read tokenizer_config.json; look at both places ourselves.
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        else:
            template = _read_json(folder / "tokenizer_config.json", {}).get("chat_template")
    eos = _as_list(raw.get("eos_token_id"))
    eos += _as_list(_read_json(folder / "generation_config.json", {}).get("eos_token_id"))
    return Tokenizer(hf, eos_token_ids=eos, chat_template=template if isinstance(template, str) else None)


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
            for key in f.keys():
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
        return json.load(f)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
