"""Tiny quantized GGUF models for tests: random valid blocks of any type the
kernels serve (llama, qwen2 with bias, qwen3 with q/k norm), and helpers that
read their greedy logits. Shared by the quantization, fused-decoder, CUDA,
KV-quant and speculative tests."""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGMLQuantizationType, GGUFWriter

from stoker import LLM, SamplingParams
from stoker.engine.params import EngineCoreRequest
from stoker.models.quant.blocks import random_blocks

T = GGMLQuantizationType
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN, LAYERS = 4, 2, 64, 256, 512, 2  # K-quants need rows of 256
SIMPLE_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
# As llama.cpp's Q4_K_M: most projections Q4_K, v and down Q6_K (so qkv fuses Q4_K, Q4_K, Q6_K).
Q4_K_M = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q4_K, "ffn_down": T.Q6_K}


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, so a byte-level BPE covers any text."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_tokens(), "he"]


def write_quant_gguf(
    path: Path,
    arch: str,
    types: dict[str, GGMLQuantizationType],
    default: GGMLQuantizationType,
    seed: int = 0,
    head_dim: int = HEAD_DIM,
) -> Path:
    """A tiny GGUF whose projections are random `default` blocks (or types[part]),
    token_embd Q8_0 (tied LM head), norms and biases F32. The loader reads
    head_dim from attn_q's rows."""
    gen = torch.Generator().manual_seed(seed)
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny-quant")
    for key, value in [
        ("block_count", LAYERS),
        ("context_length", 512),
        ("embedding_length", HIDDEN),
        ("feed_forward_length", FFN),
        ("attention.head_count", HEADS),
        ("attention.head_count_kv", KV_HEADS),
    ]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    w.add_token_merges(["h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    counter = iter(range(10_000))

    def blocks(name: str, qtype: GGMLQuantizationType, rows: int, cols: int) -> None:
        # Random blocks are as good a llama.cpp-permuted tensor as any: no need to permute them.
        data = random_blocks(qtype, rows, cols, seed * 1000 + next(counter))
        w.add_tensor(name, data, raw_dtype=qtype)

    def dense(name: str, shape: tuple[int, ...], mean: float = 0.0) -> None:
        w.add_tensor(name, (mean + 0.1 * torch.randn(shape, generator=gen)).numpy())

    blocks("token_embd.weight", T.Q8_0, len(TOKENS), HIDDEN)
    dense("output_norm.weight", (HIDDEN,), 1.0)
    shapes = {
        "attn_q": (HEADS * head_dim, HIDDEN),
        "attn_k": (KV_HEADS * head_dim, HIDDEN),
        "attn_v": (KV_HEADS * head_dim, HIDDEN),
        "attn_output": (HIDDEN, HEADS * head_dim),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    for i in range(LAYERS):
        # Layer norms of 0.3 keep this random network from amplifying small differences
        # (random blocks are as large as a trained model's, without its damping).
        dense(f"blk.{i}.attn_norm.weight", (HIDDEN,), 0.3)
        dense(f"blk.{i}.ffn_norm.weight", (HIDDEN,), 0.3)
        for part, (rows, cols) in shapes.items():
            blocks(f"blk.{i}.{part}.weight", types.get(part, default), rows, cols)
            if arch == "qwen2" and part in ("attn_q", "attn_k", "attn_v"):
                dense(f"blk.{i}.{part}.bias", (rows,))
        if arch == "qwen3":
            dense(f"blk.{i}.attn_q_norm.weight", (head_dim,), 1.0)
            dense(f"blk.{i}.attn_k_norm.weight", (head_dim,), 1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 9, 17, 30, 41, 64)]


def last_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """One step with every prompt whole: the runner returns each prompt's last-token logits.
    Leaves the requests half-run: call it last on an LLM."""
    engine = llm.engine
    engine.reset_prefix_cache()
    for i, p in enumerate(prompts):
        engine.add_request(EngineCoreRequest(f"r{i}", p, SamplingParams(max_tokens=1), 0.0))
    step = engine.scheduler.schedule()
    got = engine.runner.execute(step)
    by_id = {int(s.request_id[1:]): row for s, row in zip(step.scheduled, got)}
    return [by_id[i] for i in range(len(prompts))]
