"""Llama-shaped GGUF files of random valid quantized blocks, for memory and
load tests of model sizes not available offline (a 1B-class Q4_K_M file is
0.7 GB). The blocks are random bytes with sane scales (quant/blocks.py), so
nothing is quantized from floats and writing takes seconds; the model's
outputs are noise, its shapes, types and bytes are real."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

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
(llama.cpp gives Q6_K to half the layers' v and down; all of them here)."""


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    context: int = 2048
    types: dict[str, GGMLQuantizationType] = field(default_factory=lambda: dict(Q4_K_M))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        per_layer = h * (2 * h + 2 * kv) + 3 * h * self.intermediate + 2 * h
        return self.layers * per_layer + 2 * self.vocab * h + h


ONE_B = LlamaShape(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000)
"""TinyLlama-1.1B's shape: 1.1 B parameters, 0.7 GB as Q4_K_M."""


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, so a byte-level BPE covers any text."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_llama_gguf(path: Path, shape: LlamaShape, seed: int = 0, name: str = "synthetic-llama") -> Path:
    """Write `shape` as a llama GGUF at `path`: projections, embedding and an untied
    LM head as random blocks of shape.types, norms F32, a byte-level BPE vocabulary
    padded to shape.vocab. Tensors are generated one at a time as the file is written."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*specials, *_byte_tokens(), "he"]  # one merge: transformers reads a GGUF BPE only with merges
    tokens += [f"<synthetic_{i}>" for i in range(shape.vocab - len(tokens))]
    if len(tokens) != shape.vocab:
        raise ValueError(f"vocab {shape.vocab} is smaller than the {len(tokens)} tokens a byte-level BPE needs")
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(name)
    for key, value in [
        ("block_count", shape.layers),
        ("context_length", shape.context),
        ("embedding_length", shape.hidden),
        ("feed_forward_length", shape.intermediate),
        ("attention.head_count", shape.heads),
        ("attention.head_count_kv", shape.kv_heads),
    ]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    kv = shape.kv_heads * shape.head_dim
    projections = {
        "attn_q": (shape.hidden, shape.hidden),
        "attn_k": (kv, shape.hidden),
        "attn_v": (kv, shape.hidden),
        "attn_output": (shape.hidden, shape.hidden),
        "ffn_gate": (shape.intermediate, shape.hidden),
        "ffn_up": (shape.intermediate, shape.hidden),
        "ffn_down": (shape.hidden, shape.intermediate),
    }
    plan: list[tuple[str, str, tuple[int, int]]] = [("token_embd.weight", "token_embd", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        plan += [(f"blk.{i}.{part}.weight", part, dims) for part, dims in projections.items()]
    plan.append(("output.weight", "output", (shape.vocab, shape.hidden)))
    norms = [f"blk.{i}.{n}.weight" for i in range(shape.layers) for n in ("attn_norm", "ffn_norm")]
    norms.append("output_norm.weight")

    # Header first (shapes and types only), then each tensor's bytes as it is made,
    # so the writer never holds more than one tensor.
    for name_, part, (rows, cols) in plan:
        qtype = shape.types[part]
        row_bytes = random_blocks(qtype, 1, cols, 0).shape[1]
        writer.add_tensor_info(name_, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, raw_dtype=qtype)
    for name_ in norms:
        writer.add_tensor_info(name_, (shape.hidden,), np.dtype(np.float32), shape.hidden * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (_, part, (rows, cols)) in enumerate(plan):
        writer.write_tensor_data(random_blocks(shape.types[part], rows, cols, seed * 100_000 + index))
    for _ in norms:
        writer.write_tensor_data(np.full(shape.hidden, 0.3, dtype=np.float32))
    writer.close()
    return path
