"""GGUF files of real models' shapes made of random valid quantized blocks, for
memory, load and speed tests of model sizes not available offline (a 1B-class
Q4_K_M file is 0.7 GB). The blocks are random bytes with sane scales
(quant/blocks.py), so nothing is quantized from floats and writing takes
seconds; the model's outputs are noise, its shapes, types and bytes are real.

The size ladder (`stoker bench ladder`) names its rungs FAMILY-MIX, e.g.
qwen2.5-0.5b-q8_0 or llama-3.1-8b-q4_k_m: FAMILIES holds the real models'
config.json values, MIXES llama.cpp's choice of type per tensor."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from stoker.models.quant.blocks import random_blocks

T = GGMLQuantizationType

Q4_K_M = {
    "token_embd": T.Q4_K,
    "output": T.Q6_K,
    "attn_q": T.Q4_K,
    "attn_k": T.Q4_K,
    "attn_v": T.Q6_K,
    "attn_output": T.Q4_K,
    "ffn_gate": T.Q4_K,
    "ffn_up": T.Q4_K,
    "ffn_down": T.Q6_K,
}
"""llama.cpp's Q4_K_M mix, simplified: Q4_K, with v, down and the LM head Q6_K
(llama.cpp gives Q6_K to half the layers' v and down; all of them here).
The ladder's rungs use MIXES["q4_k_m"], which follows llama.cpp layer by layer."""

PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

# llama.cpp's fallback when a row's length is not a whole number of K-quant
# super-blocks (256): Qwen2.5-0.5B's hidden size of 896 takes it for most tensors.
_ROW_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


@dataclass(frozen=True)
class LlamaShape:
    """A llama-family decoder: the GGUF header's hyperparameters and each tensor's type."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    context: int = 2048
    types: dict[str, GGMLQuantizationType] = field(default_factory=lambda: dict(Q4_K_M))
    """Type per tensor kind (token_embd, output, attn_q ... ffn_down)."""
    more_bits: dict[str, GGMLQuantizationType] = field(default_factory=dict)
    """Types that replace `types` on llama.cpp's "more bits" layers (the first and
    last eighth and every third one between): Q4_K_M's v and down in Q6_K."""
    arch: str = "llama"
    """GGUF general.architecture: "llama" or "qwen2"."""
    tied: bool = False
    """No output.weight: the LM head is token_embd (tie_word_embeddings), typed as the output."""
    qkv_bias: bool = False
    """q, k and v projections with a bias (Qwen2)."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    norm_weight: float = 0.3
    """Every RMSNorm's weight. Random blocks are as large as a trained model's without
    its damping: below 1, a layer adds less to the residual than it reads from it, so a
    tiny difference (a summation order) is not amplified layer after layer."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        per_layer = h * (2 * h + 2 * kv) + 3 * h * self.intermediate + 2 * h
        if self.qkv_bias:
            per_layer += h + 2 * kv
        return self.layers * per_layer + (1 if self.tied else 2) * self.vocab * h + h

    def tensor_type(self, part: str, layer: int, cols: int) -> GGMLQuantizationType:
        """llama.cpp's type for `part` of `layer` (-1: token_embd and output) with rows of `cols`."""
        if part == "token_embd" and self.tied:
            part = "output"  # llama.cpp quantizes a tied embedding as the output it also is
        qtype = self.types[part]
        if layer >= 0 and part in self.more_bits and _more_bits(layer, self.layers):
            qtype = self.more_bits[part]
        block = GGML_QUANT_SIZES[qtype][0]
        if cols % block:
            if qtype not in _ROW_FALLBACK:
                raise ValueError(f"{part}: rows of {cols} are not whole {qtype.name} blocks of {block}")
            qtype = _ROW_FALLBACK[qtype]
        return qtype

    def tensors(self) -> Iterator[tuple[str, str, GGMLQuantizationType, int, int]]:
        """(GGUF name, kind, type, rows, cols) of every quantized tensor, in file order."""
        kv = self.kv_heads * self.head_dim
        dims = {
            "attn_q": (self.hidden, self.hidden),
            "attn_k": (kv, self.hidden),
            "attn_v": (kv, self.hidden),
            "attn_output": (self.hidden, self.hidden),
            "ffn_gate": (self.intermediate, self.hidden),
            "ffn_up": (self.intermediate, self.hidden),
            "ffn_down": (self.hidden, self.intermediate),
        }
        yield (
            "token_embd.weight",
            "token_embd",
            self.tensor_type("token_embd", -1, self.hidden),
            self.vocab,
            self.hidden,
        )
        for i in range(self.layers):
            for part, (rows, cols) in dims.items():
                yield f"blk.{i}.{part}.weight", part, self.tensor_type(part, i, cols), rows, cols
        if not self.tied:
            yield "output.weight", "output", self.tensor_type("output", -1, self.hidden), self.vocab, self.hidden

    def float_tensors(self) -> Iterator[tuple[str, int]]:
        """(GGUF name, length) of every F32 vector: norms, and Qwen2's biases."""
        kv = self.kv_heads * self.head_dim
        for i in range(self.layers):
            yield f"blk.{i}.attn_norm.weight", self.hidden
            yield f"blk.{i}.ffn_norm.weight", self.hidden
            if self.qkv_bias:
                yield f"blk.{i}.attn_q.bias", self.hidden
                yield f"blk.{i}.attn_k.bias", kv
                yield f"blk.{i}.attn_v.bias", kv
        yield "output_norm.weight", self.hidden

    def tensor_bytes(self) -> int:
        """Bytes of all tensor data: the file's size less its header and alignment."""
        quantized = sum(_row_bytes(t, cols) * rows for _, _, t, rows, cols in self.tensors())
        return quantized + 4 * sum(n for _, n in self.float_tensors())

    def decode_bytes_per_token(self) -> int:
        """Weight bytes one decode step reads: every layer and the LM head; of an untied
        embedding only one row, which is left out."""
        total = 0
        for _, part, qtype, rows, cols in self.tensors():
            if part != "token_embd" or self.tied:
                total += _row_bytes(qtype, cols) * rows
        return total + 4 * sum(n for _, n in self.float_tensors())

    def kv_bytes_per_token(self, element_bytes: int = 2) -> int:
        """KV cache bytes per token of context: k and v of every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _row_bytes(qtype: GGMLQuantizationType, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return cols // block * size


ONE_B = LlamaShape(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000)
"""TinyLlama-1.1B's shape: 1.1 B parameters, 0.7 GB as Q4_K_M."""

FAMILIES = {
    # Qwen2.5-0.5B(-Instruct) config.json: q/k/v bias, tied embeddings, rope_theta 1e6, eps 1e-6.
    "qwen2.5-0.5b": LlamaShape(
        hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936, context=32768,
        arch="qwen2", tied=True, qkv_bias=True, rope_theta=1_000_000.0, norm_eps=1e-6,
    ),
    # Llama-3.2-1B / 3B: tied embeddings; Llama-3.1-8B: untied. All rope_theta 500000, vocab 128256.
    "llama-3.2-1b": LlamaShape(
        hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256, context=131072,
        tied=True, rope_theta=500_000.0,
    ),
    "llama-3.2-3b": LlamaShape(
        hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8, vocab=128256, context=131072,
        tied=True, rope_theta=500_000.0,
    ),
    "llama-3.1-8b": LlamaShape(
        hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256, context=131072,
        rope_theta=500_000.0,
    ),
}  # fmt: skip
"""The real models' shapes (their config.json). Llama 3's rope scaling (a
rope_freqs tensor in llama.cpp's files) is left out: it changes the rotary's
values, not the work."""

MIXES: dict[str, tuple[dict[str, GGMLQuantizationType], dict[str, GGMLQuantizationType]]] = {
    "q8_0": ({part: T.Q8_0 for part in ("token_embd", "output", *PARTS)}, {}),
    "q4_k_m": (
        {"token_embd": T.Q4_K, "output": T.Q6_K, **{part: T.Q4_K for part in PARTS}},
        {"attn_v": T.Q6_K, "ffn_down": T.Q6_K},
    ),
}
"""(types, more_bits) per llama.cpp file type, as its llama-quant.cpp assigns them."""

LADDER = (
    "qwen2.5-0.5b-q8_0",
    "qwen2.5-0.5b-q4_k_m",
    "llama-3.2-1b-q4_k_m",
    "llama-3.2-3b-q4_k_m",
    "llama-3.1-8b-q4_k_m",
)
"""The rungs `stoker bench ladder` runs by default, smallest first."""


def rung_shape(name: str) -> LlamaShape:
    """The shape of rung FAMILY-MIX; ValueError naming the known ones otherwise."""
    for family, shape in FAMILIES.items():
        mix = name.removeprefix(family + "-")
        if name.startswith(family + "-") and mix in MIXES:
            types, more_bits = MIXES[mix]
            return dataclasses.replace(shape, types=dict(types), more_bits=dict(more_bits))
    raise ValueError(f"unknown rung {name!r}: FAMILY-MIX with FAMILY in {sorted(FAMILIES)}, MIX in {sorted(MIXES)}")


def rung_file(name: str, cache: Path) -> Path:
    """The rung's GGUF in `cache`, written once (through a temporary name, so an
    interrupted write is never taken for a whole file) and reused after."""
    shape = rung_shape(name)
    path = cache / f"{name}.gguf"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f".{name}.{os.getpid()}.partial"
    try:
        write_llama_gguf(partial, shape, name=f"synthetic-{name}")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, so a byte-level BPE covers any text."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_llama_gguf(path: Path, shape: LlamaShape, seed: int = 0, name: str = "synthetic-llama") -> Path:
    """Write `shape` as a GGUF of its arch at `path`: projections, embedding and (untied)
    LM head as random blocks of their types, norms F32 of 0.3 (a random network must
    not amplify small differences), Qwen2's biases small, a byte-level BPE vocabulary
    padded to shape.vocab. Tensors are generated one at a time as the file is written."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*specials, *_byte_tokens(), "he"]  # one merge: transformers reads a GGUF BPE only with merges
    tokens += [f"<synthetic_{i}>" for i in range(shape.vocab - len(tokens))]
    if len(tokens) != shape.vocab:
        raise ValueError(f"vocab {shape.vocab} is smaller than the {len(tokens)} tokens a byte-level BPE needs")
    arch = shape.arch
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    for key, value in [
        ("block_count", shape.layers),
        ("context_length", shape.context),
        ("embedding_length", shape.hidden),
        ("feed_forward_length", shape.intermediate),
        ("attention.head_count", shape.heads),
        ("attention.head_count_kv", shape.kv_heads),
    ]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", shape.norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", shape.rope_theta)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    # Header first (shapes and types only), then each tensor's bytes as it is made,
    # so the writer never holds more than one tensor.
    plan = list(shape.tensors())
    floats = list(shape.float_tensors())
    for name_, _, qtype, rows, cols in plan:
        row_bytes = _row_bytes(qtype, cols)
        writer.add_tensor_info(name_, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, raw_dtype=qtype)
    for name_, length in floats:
        writer.add_tensor_info(name_, (length,), np.dtype(np.float32), length * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (_, _, qtype, rows, cols) in enumerate(plan):
        writer.write_tensor_data(random_blocks(qtype, rows, cols, seed * 100_000 + index))
    bias = np.random.default_rng(seed)
    for name_, length in floats:
        if name_.endswith(".bias"):
            writer.write_tensor_data((0.1 * bias.standard_normal(length)).astype(np.float32))
        else:
            writer.write_tensor_data(np.full(length, shape.norm_weight, dtype=np.float32))
    writer.close()
    return path
