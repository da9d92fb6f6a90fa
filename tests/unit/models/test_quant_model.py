"""Quantized weights end to end: tiny GGUF files written here (llama with
llama.cpp's q/k row order, qwen2 with bias, qwen3 with q/k norm) whose linear
weights are random valid blocks of every type the kernels serve, and a Q4_K_M
style mix. The reference is stoker itself on the same file with
quantization="none" (the same blocks, dequantized to fp32), so what is
checked is the quantized path, not the quantization."""

from __future__ import annotations

import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from conftest import cache_sharing_kernels
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from quant_models import (
    FFN,
    HIDDEN,
    LAYERS,
    Q4_K_M,
    SIMPLE_TYPES,
    TOKENS,
    T,
    last_logits,
    random_prompts,
    write_quant_gguf,
)
from tiny_models import make_tiny_hf_model

from stoker import LLM, SamplingParams
from stoker.config import EngineConfig
from stoker.models.layers import Linear
from stoker.models.loader import load_model
from stoker.models.quant.blocks import random_blocks
from stoker.models.quant.hf_quantize import check_quantization
from stoker.models.quant.weights import Embedding, GGMLLinear, GGMLTensor, describe, make_linear, packs


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_CACHE_DIR", cache_sharing_kernels(tmp_path / "cache"))


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _assert_quantized_close(quant: LLM, dense: LLM, vocab: int) -> None:
    """The int8 kernels round activations to int8 per block (32 values for the
    simple types, 256 for the K-quants, as llama.cpp does): ~0.5-3% relative
    error per matmul (test_mixed_parts_... bounds one matmul against the exact
    product). Through two random layers that is 0.3-5% of the logits' norm for
    most prompts, measured on avx2; a rare prompt near an attention tie moves
    more (one qwen3 prompt: 22%). A wrong row order, type or scale gives
    unrelated logits, ~140%. Hence: median under 6%, every prompt under 35%.
    Greedy continuations are not compared token for token: a random model's
    logits are nearly flat, so a 1% error flips argmaxes (measured 3-6 of 6
    prompts equal over 8 tokens on the same CPU); generating through the
    quantized path must still give every prompt its 8 tokens."""
    prompts = random_prompts(vocab)
    assert all(len(tokens) == 8 for tokens in _greedy(quant, prompts))
    errors = []
    for got, want in zip(last_logits(quant, prompts), last_logits(dense, prompts)):
        assert want.std() > 0.5  # the reference is not degenerate
        errors.append(float((got - want).norm() / want.norm()))
    assert max(errors) < 0.35 and sorted(errors)[len(errors) // 2] < 0.06, errors


def _model(llm: LLM):  # type: ignore[no-untyped-def]
    model = llm.engine.runner.model
    model.repack.finish()  # the layers as they serve once repacked (quant/repack.py)
    return model


CASES = [("llama", {}, t) for t in SIMPLE_TYPES] + [
    ("llama", Q4_K_M, T.Q4_K),
    ("qwen2", {}, T.Q4_0),
    ("qwen3", Q4_K_M, T.Q4_K),
]


@pytest.mark.parametrize(
    ("arch", "mix", "default"), CASES, ids=[f"{a}-{'Q4_K_M' if m else d.name}" for a, m, d in CASES]
)
def test_quantized_model_matches_dequantized(
    arch: str, mix: dict[str, GGMLQuantizationType], default: GGMLQuantizationType, tmp_path: Path
) -> None:
    path = write_quant_gguf(tmp_path / f"tiny-{arch}.gguf", arch, mix, default)
    quant = LLM(str(path), dtype="float32", quantization="auto", num_kv_blocks=64)
    dense = LLM(str(path), dtype="float32", quantization="none", num_kv_blocks=64)
    model = _model(quant)
    layer = model.layers[0]
    assert isinstance(layer.qkv, GGMLLinear) and isinstance(layer.down, GGMLLinear)
    # Adjacent parts of one type are joined into one call: Q4_K_M's qkv is Q4_K (q+k) then Q6_K (v).
    types = [mix.get(p, default) for p in ("attn_q", "attn_k", "attn_v")]
    want_qkv = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]
    assert layer.qkv.qtypes == want_qkv
    assert layer.down.qtypes == [mix.get("ffn_down", default)]
    # Tied LM head: the embedding's own Q8_0 blocks, not a copy; or, where the kernels
    # multiply Q8_0 from panels, the head's panels (the mapped blocks' pages given back,
    # the lookups reading only their rows of them).
    assert isinstance(model.lm_head, GGMLLinear)
    head = model.lm_head.parts[0]
    if packs(T.Q8_0):
        assert head.packed is not None and head.tensor is None
    else:
        assert head.tensor is model.embed.quantized
    assert isinstance(_model(dense).layers[0].qkv, Linear)
    _assert_quantized_close(quant, dense, len(TOKENS))


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                lo, hi = line.split()[0].split("-")
                spans.append((int(lo, 16), int(hi, 16)))
    return spans


def test_quantized_tensors_view_the_mapped_file(tmp_path: Path) -> None:
    path = write_quant_gguf(tmp_path / "tiny-llama.gguf", "llama", {}, T.Q4_1)
    loaded = load_model(str(path), torch.float32, "cpu", "auto")
    spans = _file_mappings(path)
    assert spans, "the GGUF is not memory-mapped"

    def mapped(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in spans)

    down = loaded.weights["model.layers.0.mlp.down_proj.weight"]
    embed = loaded.weights["model.embed_tokens.weight"]
    assert isinstance(down, GGMLTensor) and down.qtype == T.Q4_1 and down.shape == (HIDDEN, FFN)
    assert isinstance(embed, GGMLTensor) and embed.qtype == T.Q8_0
    assert mapped(down.data) and mapped(embed.data)
    # llama.cpp's q/k row order is undone by reordering rows (a copy: the one exception);
    # exactly the rows the dequantizing path produces. (Through the model a wrong order
    # barely shows: q and k move together, only the rotary pairing changes.)
    dense = load_model(str(path), torch.float32, "cpu", "none").weights
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        q = loaded.weights[name]
        assert isinstance(q, GGMLTensor) and isinstance(dense[name], torch.Tensor)
        torch.testing.assert_close(q.dequantize(), dense[name], rtol=0, atol=0)
        assert not mapped(q.data)
    # Raw blocks are never cached dequantized on disk; "none" still caches its floats.
    cached = sorted(p.name for p in (tmp_path / "cache" / "gguf").glob("*/*"))
    assert cached == ["meta", "tokenizer", "weights-float32"]
    assert describe(loaded.weights).startswith(f"Q4_1 ({LAYERS * 7} tensors) + F32 (")


def test_unsupported_tensor_type_is_a_clear_error(tmp_path: Path) -> None:
    path = write_quant_gguf(tmp_path / "tiny-llama.gguf", "llama", {}, T.Q8_0)
    bad = tmp_path / "tiny-bad.gguf"
    # Rewrite one tensor's type field to Q8_1 (which stoker neither multiplies nor dequantizes):
    # same block size as Q8_0 is not needed since nothing is read before the check.
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    target = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    type_offset = target.field.offset + sum(p.nbytes for p in target.field.parts[:-2])
    raw = bytearray(path.read_bytes())
    assert int.from_bytes(raw[type_offset : type_offset + 4], "little") == T.Q8_0
    raw[type_offset : type_offset + 4] = int(T.Q8_1).to_bytes(4, "little")
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError) as err:
        load_model(str(bad), torch.float32, "cpu", "auto")
    message = str(err.value)
    assert "blk.1.ffn_up.weight" in message and "Q8_1" in message and "Q4_K" in message, message


def test_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    path = write_quant_gguf(tmp_path / "tiny-llama.gguf", "llama", {}, T.Q4_0)
    data = path.read_bytes()
    for keep in (len(data) - 5000, 100):
        cut = tmp_path / f"cut-{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(ValueError, match=re.escape(str(cut))) as err:
            load_model(str(cut), torch.float32, "cpu", "auto")
        assert "truncated" in str(err.value)


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_hf_folder_quantized_at_load(quantization: str, tmp_path: Path) -> None:
    folder = make_tiny_hf_model("llama", tmp_path)
    loaded = load_model(str(folder), torch.float32, "cpu", quantization)
    want = T[quantization.upper()]
    assert {w.qtype for k, w in loaded.weights.items() if "_proj." in k and isinstance(w, GGMLTensor)} == {want}
    assert not any(isinstance(w, torch.Tensor) for k, w in loaded.weights.items() if "_proj." in k)
    assert isinstance(loaded.weights["model.embed_tokens.weight"], GGMLTensor)
    assert loaded.weights["model.embed_tokens.weight"].qtype == T.Q8_0
    assert loaded.weights["lm_head.weight"].qtype == T.Q8_0  # type: ignore[union-attr]
    assert isinstance(loaded.weights["model.norm.weight"], torch.Tensor)
    quant = LLM(str(folder), dtype="float32", quantization=quantization, num_kv_blocks=64)
    dense = LLM(str(folder), dtype="float32", quantization="none", num_kv_blocks=64)
    prompts = random_prompts(49000)
    # Now the weights themselves are rounded too (q4_0: 16 levels per 32-block), so
    # the bound is looser; a wrong layout would still be off by the logits' own size.
    # Bounds on the relative error norm of the logits. Per weight, q8_0's rms error is ~0.5%
    # of a random weight, q4_0's ~8%; ~15 matmuls in a row (two layers of this random
    # model amplify rather than damp) compound that to the 2-4% and 20-35% measured.
    bound = 0.05 if quantization == "q8_0" else 0.4
    for got, want_row in zip(last_logits(quant, prompts), last_logits(dense, prompts)):
        rel = float((got - want_row).norm() / want_row.norm())
        assert rel < bound, rel


def test_int8_is_q8_0_by_its_common_name(tmp_path: Path) -> None:
    folder = make_tiny_hf_model("llama", tmp_path)
    int8 = load_model(str(folder), torch.float32, "cpu", "int8").weights
    q8_0 = load_model(str(folder), torch.float32, "cpu", "q8_0").weights
    assert int8.keys() == q8_0.keys()
    for name, weight in int8.items():
        other = q8_0[name]
        if isinstance(weight, GGMLTensor):
            assert isinstance(other, GGMLTensor) and weight.qtype == other.qtype == T.Q8_0
            assert torch.equal(weight.data, other.data), name
        else:
            assert isinstance(other, torch.Tensor) and torch.equal(weight, other), name


def test_quantization_choices_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="q3_k")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"quantization='q8_0'.*auto, none, q8_0"):
        check_quantization("q8_0", "cuda")
    folder = make_tiny_hf_model("llama", tmp_path)
    with pytest.raises(ValueError, match=r"quantization='int3' is not a choice: auto, none, q8_0"):
        load_model(str(folder), torch.float32, "cpu", "int3")


def _q(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> GGMLTensor:
    return GGMLTensor(torch.from_numpy(random_blocks(qtype, rows, cols, seed)), qtype, cols)


def test_mixed_parts_and_fallback_match_the_dequantized_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = [_q(T.Q4_K, 64, 256, 1), _q(T.Q4_K, 32, 256, 2), _q(T.Q6_K, 32, 256, 3)]
    bias = torch.randn(128)
    x = torch.randn(5, 256)
    want = x @ torch.cat([p.dequantize() for p in parts]).T + bias
    fused = GGMLLinear(parts, bias)
    # The two Q4_K parts are one run; where the kernels multiply Q4_K from panels, it is
    # packed in 3 panels of 32 rows, 148 bytes a row and super-block (csrc/packed_panels.h).
    q4_k_bytes = 3 * 32 * 148 if packs(T.Q4_K) else 96 * 144
    assert (fused.out_features, fused.in_features, fused.nbytes) == (128, 256, q4_k_bytes + 32 * 210)
    torch.testing.assert_close(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    # Activations rounded to int8 per 256-block (Q8_K, as llama.cpp): ~0.7% of the product's norm.
    assert float((fused(x) - want).norm() / want.norm()) < 0.015
    torch.testing.assert_close(fused(x[:1]), want[:1], atol=0.1, rtol=0.05)  # m = 1 (decode) too
    # With the C kernels off, ggml_matmul returns None: each part is dequantized once and run dense.
    monkeypatch.setenv("STOKER_DISABLE_C_KERNELS", "1")
    fallback = GGMLLinear(parts, bias)
    torch.testing.assert_close(fallback(x), want, atol=1e-4, rtol=1e-4)
    assert all(p.dense is not None for p in fallback.parts)


def test_other_devices_dequantize_at_load() -> None:
    """CUDA (or any non-CPU device) has no int8 kernels: weights become dense there.
    "meta" stands in for a GPU; the path is the same."""
    parts = [_q(T.Q4_0, 32, 64, 1), _q(T.Q8_0, 16, 64, 2)]
    meta = torch.device("meta")
    linear = make_linear(parts, torch.zeros(48), torch.float32, meta)
    assert isinstance(linear, Linear) and linear.weight is not None
    assert linear.weight.device.type == "meta" and linear.weight.shape == (48, 64)
    table = Embedding(parts[1], torch.float32, meta)
    assert table.quantized is None and table.dense is not None and table.dense.device.type == "meta"
    on_cpu = make_linear(parts, None, torch.float32, torch.device("cpu"))
    assert isinstance(on_cpu, GGMLLinear)
    dense_cpu = make_linear(parts, None, torch.float32, torch.device("cpu")).dequantize()
    np.testing.assert_array_equal(dense_cpu.numpy(), torch.cat([p.dequantize() for p in parts]).numpy())


def test_embedding_rows_match_gguf_dequantize() -> None:
    table = _q(T.Q8_0, 40, 64, 5)
    ids = torch.tensor([3, 0, 39, 3])
    from gguf.quants import dequantize

    want = torch.from_numpy(dequantize(table.data.numpy(), T.Q8_0))[ids]
    torch.testing.assert_close(Embedding(table, torch.float32, torch.device("cpu"))(ids), want, rtol=0, atol=0)
    assert GGML_QUANT_SIZES[T.Q8_0] == (32, 34)


def test_dtype_auto_computes_in_float32_when_weights_stay_quantized(tmp_path: Path) -> None:
    """bf16-capable CPUs pick bfloat16 for dense models, but quantized weights are
    served by float32 kernels (and the fused decoder), so auto means float32 there."""
    from stoker.engine.devices import resolve_dtype
    from stoker.models.loader import weights_stay_quantized

    gguf = str(write_quant_gguf(tmp_path / "tiny-llama.gguf", "llama", {}, T.Q4_1))
    folder = str(make_tiny_hf_model("llama", tmp_path / "hf"))
    assert weights_stay_quantized(gguf, "cpu", "auto")
    assert not weights_stay_quantized(gguf, "cpu", "none")
    assert not weights_stay_quantized(gguf, "meta", "auto")  # other devices dequantize at load
    assert weights_stay_quantized(folder, "cpu", "q8_0")
    assert not weights_stay_quantized(folder, "cpu", "auto")
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, quantized_weights=True) == torch.float32
    assert resolve_dtype("bfloat16", cpu, quantized_weights=True) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda"), quantized_weights=True) == torch.bfloat16
