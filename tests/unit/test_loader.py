"""load_model over tiny Hugging Face folders: weights equal transformers' own
loading, config fields follow each architecture's quirks, bad input fails clearly."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from stoker.models.loader import SUPPORTED_ARCHITECTURES, load_model, load_tokenizer
from tiny_models import make_tiny_hf_model, set_config


def reference_state(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, local_files_only=True)
    return {k: v for k, v in model.state_dict().items() if not k.endswith("inv_freq")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_weights_equal_transformers(arch: str, tmp_path: Path) -> None:
    folder = make_tiny_hf_model(arch, tmp_path)
    loaded = load_model(str(folder), torch.float32)
    expected = reference_state(folder)
    assert sorted(loaded.weights) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded.weights[name].dtype == torch.float32
        assert torch.equal(loaded.weights[name], tensor), name


@pytest.mark.parametrize(
    ("arch", "architecture", "bias", "qk_norm"),
    [
        ("llama", "LlamaForCausalLM", False, False),
        ("qwen2", "Qwen2ForCausalLM", True, False),
        ("qwen3", "Qwen3ForCausalLM", False, True),
        ("mistral", "MistralForCausalLM", False, False),
    ],
)
def test_config_per_architecture(arch: str, architecture: str, bias: bool, qk_norm: bool, tmp_path: Path) -> None:
    folder = make_tiny_hf_model(arch, tmp_path)
    loaded = load_model(str(folder), torch.float32)
    c = loaded.config
    assert (c.architecture, c.attention_bias, c.qk_norm) == (architecture, bias, qk_norm)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (64, 2, 4, 2, 16)
    assert c.vocab_size == 49152 and c.intermediate_size == 128
    assert c.rope_theta == 10000.0 and c.rope_scaling is None and c.rms_norm_eps == 1e-6
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]
    assert c.name == folder.name.lower()
    assert not c.tie_word_embeddings and "lm_head.weight" in loaded.weights
    if bias:
        assert "model.layers.0.self_attn.q_proj.bias" in loaded.weights
    if qk_norm:
        assert loaded.weights["model.layers.1.self_attn.k_norm.weight"].shape == (16,)


def test_tied_and_sharded(tmp_path: Path) -> None:
    folder = make_tiny_hf_model("qwen3", tmp_path, tie=True, shards=2)
    assert (folder / "model.safetensors.index.json").exists()
    assert len(list(folder.glob("*.safetensors"))) >= 2
    loaded = load_model(str(folder), torch.float32)
    assert loaded.config.tie_word_embeddings
    assert "lm_head.weight" not in loaded.weights  # never invented for tied models
    expected = reference_state(folder)
    expected.pop("lm_head.weight", None)
    assert sorted(loaded.weights) == sorted(expected)
    assert all(torch.equal(loaded.weights[k], v) for k, v in expected.items())


def test_bfloat16(tmp_path: Path) -> None:
    folder = make_tiny_hf_model("llama", tmp_path)
    f32 = load_model(str(folder), torch.float32)
    bf16 = load_model(str(folder), torch.bfloat16)
    for name, tensor in f32.weights.items():
        assert bf16.weights[name].dtype == torch.bfloat16
        assert torch.equal(bf16.weights[name], tensor.to(torch.bfloat16))


@pytest.mark.parametrize("style", ["transformers4", "transformers5"])
def test_llama3_rope_scaling_passes_through(style: str, tmp_path: Path) -> None:
    folder = make_tiny_hf_model("llama", tmp_path)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("rope_parameters", None)
    if style == "transformers4":  # the layout of most published Llama 3 checkpoints
        raw.update(rope_theta=500000.0, rope_scaling=scaling)
    else:
        raw.update(rope_parameters={**scaling, "rope_theta": 500000.0})
    (folder / "config.json").write_text(json.dumps(raw))
    config = load_model(str(folder), torch.float32).config
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None
    assert {k: config.rope_scaling[k] for k in scaling} == scaling


def test_eos_ids_merge_config_generation_config_and_tokenizer(tmp_path: Path) -> None:
    folder = make_tiny_hf_model("llama", tmp_path)
    set_config(folder, eos_token_id=[7, 2])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    loaded = load_model(str(folder), torch.float32)
    assert loaded.config.eos_token_ids == [7, 2, 9] == loaded.tokenizer.eos_token_ids


def test_chat_template_from_tokenizer_config(tmp_path: Path) -> None:
    folder = make_tiny_hf_model("llama", tmp_path)
    (folder / "chat_template.jinja").unlink()
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": template}))
    tok = load_tokenizer(str(folder))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi"


def test_unsupported_architecture(tmp_path: Path) -> None:
    folder = make_tiny_hf_model("llama", tmp_path)
    set_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as err:
        load_model(str(folder), torch.float32)
    assert "GPT2LMHeadModel" in str(err.value)
    assert all(a in str(err.value) for a in SUPPORTED_ARCHITECTURES)


def test_missing_path() -> None:
    with pytest.raises(FileNotFoundError):
        load_model("/nonexistent/model", torch.float32)


def test_tiny_model_matches_transformers_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = make_tiny_hf_model("qwen2", tmp_path)
    ours = load_tokenizer(str(folder))
    ref = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    for text in ["Hello 👋 wörld", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == ref.encode(text)
