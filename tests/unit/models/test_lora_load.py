"""Loading LoRA adapters: a llama.cpp GGUF LoRA file gives the same adapter as
the PEFT folder it was written from, and every adapter stoker cannot apply is
refused with one line naming the adapter and the reason."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file, save_file
from tiny_loras import ALL_MODULES, ATTENTION, make_peft_adapter, write_gguf_lora
from tiny_models import TINY_SIZES, make_tiny_hf_model

from stoker.config import ModelConfig
from stoker.models.loader import load_model
from stoker.models.lora import STACKS, LoraAdapter, LoraBatch, LoraError, load_lora

HEADS, KV_HEADS = TINY_SIZES["num_attention_heads"], TINY_SIZES["num_key_value_heads"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig, Path, Path]:
    """The tiny Llama's folder and config, an all-modules rank-8 rsLoRA adapter and a rank-4 attention one."""
    tmp = tmp_path_factory.mktemp("lora-load")
    folder = make_tiny_hf_model("llama", tmp)
    config = load_model(str(folder), torch.float32).config
    full = make_peft_adapter(folder, tmp / "full", rank=8, targets=ALL_MODULES, use_rslora=True, seed=3)
    attention = make_peft_adapter(folder, tmp / "attention", rank=4, targets=ATTENTION, alpha=8, seed=4)
    return folder, config, full, attention


def _same(x: LoraAdapter, y: LoraAdapter, atol: float) -> None:
    assert (x.rank, x.target_modules, x.nbytes) == (y.rank, y.target_modules, y.nbytes)
    assert x.scale == pytest.approx(y.scale)
    for lx, ly in zip(x.layers, y.layers, strict=True):
        assert set(lx) == set(ly)
        for stack in lx:
            torch.testing.assert_close(lx[stack].a, ly[stack].a, atol=atol, rtol=0)
            for px, py in zip(lx[stack].parts, ly[stack].parts, strict=True):
                assert (px.module, px.rank_start, px.rank, px.col_start, px.cols) == (
                    py.module,
                    py.rank_start,
                    py.rank,
                    py.col_start,
                    py.cols,
                )
                torch.testing.assert_close(px.bt, py.bt, atol=atol, rtol=0)


def test_peft_folder_layout(base) -> None:
    _, config, full, attention = base
    adapter = load_lora("full", str(full), config, max_rank=8)
    assert adapter.rank == 8 and adapter.scale == pytest.approx(16 / 8**0.5)
    assert adapter.target_modules == frozenset(ALL_MODULES)
    assert adapter.nbytes == sum(t.numel() * 4 for t in load_file(str(full / "adapter_model.safetensors")).values())
    qkv = adapter.layers[0]["qkv"]
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    assert [(p.module, p.rank_start, p.col_start, p.cols) for p in qkv.parts] == [
        ("q_proj", 0, 0, q),
        ("k_proj", 8, q, kv),
        ("v_proj", 16, q + kv, kv),
    ]
    tensors = load_file(str(full / "adapter_model.safetensors"))
    b = tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    torch.testing.assert_close(qkv.parts[1].bt, b.T * adapter.scale)
    only_attention = load_lora("att", str(attention), config, max_rank=8)
    assert only_attention.target_modules == frozenset(ATTENTION)
    assert set(only_attention.layers[1]) == {"qkv", "o_proj"}
    assert only_attention.scale == 2.0


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.F32, GGMLQuantizationType.F16])
def test_gguf_lora_equals_its_peft_folder(base, tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    """llama.cpp's layout (q/k rows of B interleaved for Llama, alpha / r scaling) read back to PEFT's."""
    _, config, full, _ = base
    path = write_gguf_lora(full, tmp_path / "full.gguf", heads=HEADS, kv_heads=KV_HEADS, qtype=qtype)
    want = load_lora("full", str(full), config, max_rank=8)
    got = load_lora("full", str(path), config, max_rank=8)
    _same(got, want, atol=0 if qtype == GGMLQuantizationType.F32 else 2e-3)


def test_lora_batch_checks_its_rows(base) -> None:
    _, config, _, attention = base
    adapter = load_lora("att", str(attention), config, max_rank=8)
    with pytest.raises(ValueError, match=r"outside -1 \.\. 0"):
        LoraBatch([adapter], torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        LoraBatch([adapter], torch.tensor([0, -1]))
    batch = LoraBatch([adapter], torch.tensor([-1, 0, -1, 0], dtype=torch.int32))
    assert batch.active and [(i, rows.tolist()) for i, rows in batch.groups] == [(0, [1, 3])]
    assert not LoraBatch([adapter], torch.tensor([-1, -1], dtype=torch.int32)).active


# ---- refusals -------------------------------------------------------------------


def _copy(folder: Path, tmp_path: Path, **config_updates: object) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    settings = json.loads((out / "adapter_config.json").read_text())
    settings.update(config_updates)
    (out / "adapter_config.json").write_text(json.dumps(settings))
    return out


def _refused(path: Path | str, config: ModelConfig, match: str, max_rank: int = 64) -> None:
    with pytest.raises(LoraError, match=match) as info:
        load_lora("bad", str(path), config, max_rank)
    message = str(info.value)
    assert message.startswith("LoRA adapter 'bad': ") and "\n" not in message


@pytest.mark.parametrize(
    ("updates", "match"),
    [
        ({"target_modules": ["q_proj", "c_attn"]}, "unknown target module 'c_attn'"),
        ({"target_modules": ["embed_tokens"]}, r"target module 'embed_tokens' \(embeddings\) is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"use_dora": True}, "DoRA"),
        ({"trainable_token_indices": [5, 6]}, "trainable_token_indices"),
        ({"layer_replication": [[0, 2]]}, "layer_replication"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"r": "eight"}, "r must be a positive integer"),
    ],
)
def test_refuses_settings(base, tmp_path: Path, updates: dict[str, object], match: str) -> None:
    _, config, _, attention = base
    _refused(_copy(attention, tmp_path, **updates), config, match)


def test_refuses_files(base, tmp_path: Path) -> None:
    _, config, full, attention = base
    _refused(tmp_path / "nowhere", config, "no such file or folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(empty, config, "no adapter_config.json")
    pickled = _copy(attention, tmp_path)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    _refused(pickled, config, "adapter_model.bin is a pickle")
    (pickled / "adapter_model.bin").unlink()
    _refused(pickled, config, "no adapter_model.safetensors")
    (pickled / "adapter_config.json").write_text("{not json")
    _refused(pickled, config, "not valid JSON")
    truncated = tmp_path / "truncated"
    shutil.copytree(full, truncated)
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    _refused(truncated, config, "unreadable")
    _refused(tmp_path / "truncated" / "adapter_config.json", config, "neither a PEFT folder nor a readable GGUF")


def test_refuses_rank_and_other_bases(base, tmp_path: Path) -> None:
    _, config, full, _ = base
    _refused(full, config, r"rank 8, above the maximum LoRA rank 4 \(--max-lora-rank\)", max_rank=4)
    wider = dataclasses.replace(config, hidden_size=2 * config.hidden_size)
    _refused(full, wider, "another base")
    shallower = dataclasses.replace(config, num_layers=1)
    _refused(full, shallower, "adapts layer 1; the base has 1")


def _edit_tensors(folder: Path, tmp_path: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    out = _copy(folder, tmp_path)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    for key, value in edit.items():
        if value is None:
            tensors.pop(key)
        else:
            tensors[key] = value
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def test_refuses_tensors(base, tmp_path: Path) -> None:
    _, config, _, attention = base
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    nan = load_file(str(attention / "adapter_model.safetensors"))[key.format("A")].clone()
    nan[0, 0] = float("nan")
    cases: list[tuple[dict[str, torch.Tensor | None], str]] = [
        ({key.format("B"): None}, "layers.0.q_proj has lora_A but not its pair"),
        ({key.format("A"): nan}, "non-finite"),
        ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)}, "embeddings"),
        ({"base_model.model.lm_head.modules_to_save.default.weight": torch.zeros(4, 8)}, "modules_to_save"),
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.zeros(8)}, "DoRA"),
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias": torch.zeros(8)}, "trained biases"),
    ]
    for i, (edit, match) in enumerate(cases):
        _refused(_edit_tensors(attention, tmp_path / str(i), edit), config, match)


def _gguf(
    path: Path, arch: str = "llama", kind: str = "adapter", adapter_type: str = "lora", **tensors: torch.Tensor
) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_string("general.type", kind)
    writer.add_string("adapter.type", adapter_type)
    writer.add_float32("adapter.lora.alpha", 8.0)
    for name, value in tensors.items():
        writer.add_tensor(name, value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_refuses_gguf_files(base, tmp_path: Path) -> None:
    _, config, full, _ = base
    hidden = config.hidden_size
    a, b = torch.zeros(4, hidden), torch.zeros(hidden, 4)
    q = {"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b}
    _refused(_gguf(tmp_path / "model.gguf", kind="model", **q), config, "not an adapter")
    _refused(_gguf(tmp_path / "cvec.gguf", adapter_type="control_vector", **q), config, "adapter.type 'control_vector'")
    _refused(_gguf(tmp_path / "qwen.gguf", arch="qwen2", **q), config, "made for a 'qwen2' model; the base is 'llama'")
    embd = {"token_embd.weight.lora_a": a, "token_embd.weight.lora_b": b}
    _refused(_gguf(tmp_path / "embd.gguf", **embd), config, "embeddings")
    _refused(_gguf(tmp_path / "half.gguf", **{"blk.0.attn_q.weight.lora_a": a}), config, "not its pair")
    norm = {"blk.0.attn_norm.weight.lora_a": a, "blk.0.attn_norm.weight.lora_b": b}
    _refused(_gguf(tmp_path / "norm.gguf", **norm), config, "unknown target module 'input_layernorm'")
    path = write_gguf_lora(full, tmp_path / "full.gguf", heads=HEADS, kv_heads=KV_HEADS)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    _refused(path, config, "neither a PEFT folder nor a readable GGUF")


def test_each_module_update_equals_peft_merge(base, tmp_path: Path) -> None:
    """rank_pattern, alpha_pattern, rsLoRA and layers_to_transform read as PEFT reads them:
    every module's scale * B A equals what merge_and_unload adds to that base weight."""
    from tiny_loras import merged_reference

    folder, config, _, _ = base
    path = make_peft_adapter(
        folder,
        tmp_path / "patterns",
        rank=4,
        targets=ALL_MODULES,
        alpha=8,
        use_rslora=True,
        rank_pattern={"v_proj": 2},
        alpha_pattern={"down_proj": 3},
        layers_to_transform=[1],
        seed=5,
    )
    adapter = load_lora("patterns", str(path), config, max_rank=8)
    assert set(adapter.layers[0]) == set() and set(adapter.layers[1]) == set(STACKS)
    assert [p.rank for p in adapter.layers[1]["qkv"].parts] == [4, 4, 2]
    merged = merged_reference(folder, path).state_dict()
    plain = load_file(str(folder / "model.safetensors"))
    for stack, lin in adapter.layers[1].items():
        for part in lin.parts:
            where = "mlp" if stack in ("gate_up", "down") else "self_attn"
            weight = f"model.layers.1.{where}.{part.module}.weight"
            a = lin.a[part.rank_start : part.rank_start + part.rank]
            torch.testing.assert_close(part.bt.T @ a, merged[weight] - plain[weight], atol=2e-6, rtol=1e-4)
