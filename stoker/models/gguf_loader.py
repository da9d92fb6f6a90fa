"""GGUF files: header to ModelConfig, tensors dequantized into Hugging Face
names and layouts, tokenizer converted by transformers (the reference).

Quantized tensors the int8 kernels serve can stay raw blocks viewing the
memory-mapped file (quantization "auto"; see quant/weights.py). The slow parts
(parsing the header with its vocabulary, converting the tokenizer, numpy
dequantization for quantization "none") are cached under ~/.cache/stoker
(STOKER_CACHE_DIR overrides), so a second load reads back a small JSON file,
a tokenizer folder and a safetensors file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# transformers converts the tokenizer; it must never try to reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from gguf import GGMLQuantizationType

from stoker.config import ModelConfig
from stoker.models.identity import gguf_cache_dir, gguf_model_name, gguf_tokenizer_folder
from stoker.models.quant.weights import GGMLTensor, WeightLike, from_numpy_readonly, packs, served_types
from stoker.models.readahead import populate_in_background
from stoker.models.registry import gguf_architecture
from stoker.models.tokenizer import Tokenizer, settle_generic_class, tokenizer_from_folder

log = logging.getLogger("stoker.models")

# Dequantized weights are cached only up to this size: a 7B model in float32 would cost 28 GB of disk.
_WEIGHT_CACHE_MAX_BYTES = 4 << 30


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


def _gguf_meta(path: str) -> dict[str, Any]:
    """ModelConfig fields and a tensor index (offset, type, shape) from the header, cached."""

    def build(tmp: Path) -> None:
        _write_json(tmp / "meta.json", _read_gguf_header(path))

    meta_dir = _cached(gguf_cache_dir(path) / "meta", build)
    return _read_json(meta_dir / "meta.json")


def _read_gguf_header(path: str) -> dict[str, Any]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, struct.error) as exc:
        # numpy's reshape/view errors say nothing about which file or why.
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): {exc}") from exc

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    family = gguf_architecture(field("general.architecture"), str(field("general.name", "")))
    assert family.gguf is not None  # gguf_architecture returns only families GGUF files hold
    facts = family.gguf
    prefix = facts.architecture

    tensors = [
        {
            "gguf": t.name,
            "hf": facts.tensors.hf_name(t.name),
            "type": int(t.tensor_type),
            "dtype": t.data.dtype.str,
            "shape": list(t.data.shape),
            "offset": int(t.data_offset),
        }
        for t in reader.tensors
    ]
    rows: dict[str, int] = {str(t["gguf"]): int(t["shape"][0]) for t in tensors}  # type: ignore[index]
    heads = int(field(f"{prefix}.attention.head_count"))
    hidden = int(field(f"{prefix}.embedding_length"))
    scaling_type = field(f"{prefix}.rope.scaling.type")
    rope_scaling = None
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": field(f"{prefix}.rope.scaling.factor", 1.0)}
        original = field(f"{prefix}.rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = int(original)
    eos = [field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    config = ModelConfig(
        architecture=family.hf_name,
        vocab_size=int(
            rows.get("token_embd.weight") or field(f"{prefix}.vocab_size") or len(field("tokenizer.ggml.tokens"))
        ),
        hidden_size=hidden,
        intermediate_size=int(field(f"{prefix}.feed_forward_length")),
        num_layers=int(field(f"{prefix}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(f"{prefix}.attention.head_count_kv", heads)),
        head_dim=int(field(f"{prefix}.attention.key_length") or rows.get("blk.0.attn_q.weight", hidden) // heads),
        max_position_embeddings=int(field(f"{prefix}.context_length")),
        rms_norm_eps=float(field(f"{prefix}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(field(f"{prefix}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in rows,
        attention_bias="blk.0.attn_q.bias" in rows,
        qk_norm="blk.0.attn_q_norm.weight" in rows,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(e) for e in eos if e is not None],
        name=gguf_model_name(path),
    )
    permute_qk = facts.qk_rows == "interleaved"
    return {"config": dataclasses.asdict(config), "tensors": tensors, "permute_qk": permute_qk}


def unpermute_qk_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head it stores the rotary pairs interleaved
    (row 2i, 2i+1), HF stores the halves (i, i + d/2)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def keeps_quantized(path: str, device: str, quantization: str) -> bool:
    """Whether load_gguf(path, ..., device, quantization) returns any tensor still
    quantized (read from the cached header, nothing loaded)."""
    if quantization != "auto" or torch.device(device).type != "cpu":
        return False
    meta = _gguf_meta(path)
    return any(GGMLQuantizationType(t["type"]) in served_types() for t in meta["tensors"] if t["hf"])


def load_gguf(
    path: str, dtype: torch.dtype, device: str, quantization: str = "none"
) -> tuple[ModelConfig, dict[str, WeightLike], Tokenizer]:
    """quantization "auto": quantized tensors of a type the int8 kernels serve come back
    as GGMLTensors over the memory-mapped file (CPU only); "none" (or anything else):
    every tensor dequantized to dtype, cached on disk for small models."""
    meta = _gguf_meta(path)
    config = ModelConfig(**meta["config"])
    _check_tensors(path, meta)
    keep = served_types() if quantization == "auto" and torch.device(device).type == "cpu" else frozenset()
    quantized = {GGMLQuantizationType(t["type"]) for t in meta["tensors"] if t["hf"]} - _DENSE_TYPES
    if quantization == "auto" and quantized - keep:
        where = "the int8 kernels do not serve them" if keep or not served_types() else f"device is {device}"
        log.info(
            "%s: %s tensors dequantized to %s at load (%s)",
            os.path.basename(path),
            "/".join(sorted(q.name for q in quantized - keep)),
            str(dtype).removeprefix("torch."),
            where,
        )
    if quantized & keep:
        # Raw blocks read straight from the mapping: nothing is dequantized, so nothing is cached.
        weights = {k: _to_device(v, device) for k, v in _gguf_weights(path, meta, config, dtype, keep).items()}
    elif _dequantized_bytes(meta, dtype) <= _WEIGHT_CACHE_MAX_BYTES:
        from safetensors.torch import load_file, save_file

        # numpy dequantization of a Q4 file costs seconds on a busy CPU; reading it back is ~free.
        def build(tmp: Path) -> None:
            dense = _gguf_weights(path, meta, config, dtype, frozenset())
            save_file({k: v for k, v in dense.items() if isinstance(v, torch.Tensor)}, str(tmp / "model.safetensors"))

        folder = _cached(gguf_cache_dir(path) / f"weights-{str(dtype).removeprefix('torch.')}", build)
        weights = dict(load_file(str(folder / "model.safetensors"), device=device))
    else:
        weights = {k: _to_device(v, device) for k, v in _gguf_weights(path, meta, config, dtype, frozenset()).items()}
    tokenizer = gguf_tokenizer(path)
    config.eos_token_ids = tokenizer.eos_token_ids
    return config, weights, tokenizer


def _to_device(w: WeightLike, device: str) -> WeightLike:
    return w if isinstance(w, GGMLTensor) else w.to(device)


_DENSE_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


@functools.cache
def loadable_types() -> frozenset[GGMLQuantizationType]:
    """Types stoker can load: served by the kernels, or dequantized by gguf's numpy code."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    ok = set(served_types())
    for qtype, (_, type_size) in GGML_QUANT_SIZES.items():
        try:
            dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError):
            continue
        ok.add(qtype)
    return frozenset(ok)


def _check_tensors(path: str, meta: dict[str, Any]) -> None:
    """Every tensor of a known type and inside the file, before anything is read."""
    size = os.path.getsize(path)
    for t in meta["tensors"]:
        qtype = GGMLQuantizationType(t["type"])
        if t["hf"] is not None and qtype not in loadable_types():
            names = ", ".join(sorted(q.name for q in loadable_types()))
            raise ValueError(
                f"{path}: tensor {t['gguf']} has type {qtype.name}, which stoker cannot load; supported: {names}"
            )
        end = t["offset"] + int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize
        if end > size:
            raise ValueError(f"{path}: truncated GGUF: tensor {t['gguf']} ends at byte {end}, the file has {size}")


def _dequantized_bytes(meta: dict[str, Any], dtype: torch.dtype) -> int:
    elements = sum(int(np.prod(t["shape"][:-1])) * _row_elements(t) for t in meta["tensors"] if t["hf"])
    return elements * torch.empty((), dtype=dtype).element_size()


def _row_elements(t: dict[str, Any]) -> int:
    from gguf import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t["type"])]
    return int(t["shape"][-1] * np.dtype(t["dtype"]).itemsize // type_size * block)


def _gguf_weights(
    path: str, meta: dict[str, Any], config: ModelConfig, dtype: torch.dtype, keep: frozenset[GGMLQuantizationType]
) -> dict[str, WeightLike]:
    """Every tensor under its HF name and layout (as transformers' GGUF loading
    produces it). Types in keep stay raw blocks viewing the mapping (no copy);
    the rest is dequantized to dtype."""
    from gguf.quants import dequantize

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if keep:  # the raw blocks are served from the mapping: their pages are mapped in while the rest loads
        populate_in_background(raw, _read_every_step(meta))
    # Every quantized tensor views this one tensor's storage, so parts that lie side by side in
    # the file can be joined as a view of it (quant/weights.py) rather than copied.
    mapping = from_numpy_readonly(raw)
    weights: dict[str, WeightLike] = {}
    for t in meta["tensors"]:
        if t["hf"] is None:
            continue
        qtype = GGMLQuantizationType(t["type"])
        item = np.dtype(t["dtype"])
        count = int(np.prod(t["shape"]))
        data = raw[t["offset"] : t["offset"] + count * item.itemsize].view(item).reshape(t["shape"])
        heads = None
        if meta["permute_qk"] and ".self_attn.q_proj." in t["hf"]:
            heads = config.num_heads
        elif meta["permute_qk"] and ".self_attn.k_proj." in t["hf"]:
            heads = config.num_kv_heads
        if qtype in keep and data.ndim == 2:
            blocks = mapping[t["offset"] : t["offset"] + data.nbytes].view(data.shape)
            q = GGMLTensor(blocks, qtype, _row_elements(t), file_mapped=True)
            # The permutation moves whole rows, so it applies to blocks as to floats (one copy of q and k).
            weights[t["hf"]] = q if heads is None else q.take_rows(unpermute_qk_rows(torch.arange(q.rows), heads))
            continue
        array = dequantize(data, qtype)
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only mapping
            array = array.copy()
        w = torch.from_numpy(array)
        if heads is not None:
            w = unpermute_qk_rows(w, heads)
        weights[t["hf"]] = w.to(dtype=dtype).contiguous()
    return weights


def _read_every_step(meta: dict[str, Any]) -> list[tuple[int, int]]:
    """(offset, bytes) of the tensors a forward pass reads from the mapping whole.
    Not an untied embedding, of which a step reads only its tokens' rows, nor q
    and k where their rows are reordered into a copy, nor the linear layers'
    weights repacked into a copy (quant/repack.py reads them; both copies give
    their mapped pages back): mapped in, their pages would count in the engine's resident memory
    for nothing."""
    names = {t["hf"] for t in meta["tensors"]}
    untied = "lm_head.weight" in names

    def copied_or_looked_up(t: dict[str, Any]) -> bool:
        name = t["hf"]
        if untied and name == "model.embed_tokens.weight":
            return True
        if packs(GGMLQuantizationType(t["type"])):
            return True  # repacked into a copy (quant/repack.py; a tied LM head too), its mapped pages given back
        return bool(meta["permute_qk"]) and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name)

    return [
        (int(t["offset"]), int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize)
        for t in meta["tensors"]
        if t["hf"] is not None and not copied_or_looked_up(t)
    ]


def gguf_tokenizer(path: str) -> Tokenizer:
    def convert(tmp: Path) -> None:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), local_files_only=True
        )
        hf.save_pretrained(tmp)
        # Saved under the generic class where that loads the same tokenizer: no AutoTokenizer
        # (and its torch import) in the front end, no transformers at all in the engine.
        settle_generic_class(tmp)

    folder = _cached(gguf_tokenizer_folder(path), convert)
    return tokenizer_from_folder(folder, eos_token_ids=_gguf_meta(path)["config"]["eos_token_ids"])


def _read_json(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
