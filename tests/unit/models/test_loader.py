"""load_model over tiny Hugging Face folders: weights equal transformers' own
loading, config fields follow each architecture's quirks, bad input fails clearly."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from conftest import cache_sharing_kernels
from tiny_models import make_tiny_hf_model, set_config

from stoker.models.identity import model_name, tokenizer_folder
from stoker.models.loader import SUPPORTED_ARCHITECTURES, load_model, load_tokenizer


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
    assert c.name == folder.name.lower() == model_name(str(folder))  # the name is known before loading
    assert tokenizer_folder(str(folder)) == str(folder.resolve())
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


# --- GGUF written here from random tensors: name mapping, q/k order, cache ------------


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, so a byte-level BPE covers any text."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_tiny_gguf(path: Path, arch: str, seed: int = 0, general_name: str = "tiny") -> dict[str, torch.Tensor]:
    """A 2-layer GGUF laid out as llama.cpp's converter would; returns the HF-layout tensors."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_tokens(), "he"]
    heads, kv_heads, head_dim, hidden, ffn = 4, 2, 16, 64, 128
    gen = torch.Generator().manual_seed(seed)
    w = GGUFWriter(str(path), arch)
    w.add_name(general_name)
    for key, value in [
        ("block_count", 2),
        ("context_length", 512),
        ("embedding_length", hidden),
        ("feed_forward_length", ffn),
        ("attention.head_count", heads),
        ("attention.head_count_kv", kv_heads),
    ]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")

    expected: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], stored: torch.Tensor | None = None) -> None:
        t = torch.randn(shape, generator=gen)
        data = (stored if stored is not None else t).numpy()
        if gguf_name == "token_embd.weight":  # one quantized tensor: the reference is its round trip
            q = quantize(data, GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name, q, raw_dtype=GGMLQuantizationType.Q8_0)
            t = torch.from_numpy(dequantize(q, GGMLQuantizationType.Q8_0))
        else:
            w.add_tensor(gguf_name, data)
        expected[hf_name] = t

    add("token_embd.weight", "model.embed_tokens.weight", (len(tokens), hidden))
    add("output_norm.weight", "model.norm.weight", (hidden,))
    for i in range(2):
        p = f"model.layers.{i}."
        for g, h, n in [("attn_q", "q_proj", heads), ("attn_k", "k_proj", kv_heads)]:
            t = torch.randn((n * head_dim, hidden), generator=gen)
            # llama.cpp interleaves each head's rotary halves; qwen files keep HF order.
            stored = t.reshape(n, 2, head_dim // 2, hidden).transpose(1, 2).reshape(t.shape) if arch == "llama" else t
            w.add_tensor(f"blk.{i}.{g}.weight", stored.contiguous().numpy())
            expected[f"{p}self_attn.{h}.weight"] = t
            if arch == "qwen2":
                add(f"blk.{i}.{g}.bias", f"{p}self_attn.{h}.bias", (n * head_dim,))
            if arch == "qwen3":
                add(f"blk.{i}.{g}_norm.weight", f"{p}self_attn.{h[0]}_norm.weight", (head_dim,))
        add(f"blk.{i}.attn_v.weight", f"{p}self_attn.v_proj.weight", (kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_output.weight", f"{p}self_attn.o_proj.weight", (hidden, heads * head_dim))
        add(f"blk.{i}.attn_norm.weight", f"{p}input_layernorm.weight", (hidden,))
        add(f"blk.{i}.ffn_norm.weight", f"{p}post_attention_layernorm.weight", (hidden,))
        add(f"blk.{i}.ffn_gate.weight", f"{p}mlp.gate_proj.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_up.weight", f"{p}mlp.up_proj.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_down.weight", f"{p}mlp.down_proj.weight", (hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_CACHE_DIR", cache_sharing_kernels(tmp_path / "cache"))
    path = tmp_path / f"Tiny-{arch}-Q8_0.gguf"
    expected = write_tiny_gguf(path, arch)
    for attempt in range(2):  # the second load reads the cache back
        loaded = load_model(str(path), torch.float32)
        assert sorted(loaded.weights) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(loaded.weights[name], tensor), (attempt, name)
    c = loaded.config
    assert c.name == f"tiny-{arch}" == model_name(str(path))  # the name is known before loading
    assert (Path(tokenizer_folder(str(path))) / "tokenizer.json").is_file()  # converted for others to read
    assert c.tie_word_embeddings and c.head_dim == 16 and c.num_kv_heads == 2
    assert (c.attention_bias, c.qk_norm) == (arch == "qwen2", arch == "qwen3")
    assert c.eos_token_ids == [2] and c.bos_token_id == 1
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("hello ✓")) == "hello ✓"
    assert (tmp_path / "cache" / "gguf").is_dir()
    bf16 = load_model(str(path), torch.bfloat16)
    assert bf16.weights["model.norm.weight"].dtype == torch.bfloat16


def test_tiny_gguf_auto_keeps_quantized_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """quantization="auto": the Q8_0 token_embd stays raw blocks equal to its round trip; F32 tensors as before."""
    from gguf import GGMLQuantizationType

    from stoker.models.quant.weights import GGMLTensor

    monkeypatch.setenv("STOKER_CACHE_DIR", cache_sharing_kernels(tmp_path / "cache"))
    path = tmp_path / "Tiny-llama-Q8_0.gguf"
    expected = write_tiny_gguf(path, "llama")
    loaded = load_model(str(path), torch.float32, "cpu", "auto")
    embed = loaded.weights["model.embed_tokens.weight"]
    assert isinstance(embed, GGMLTensor) and embed.qtype == GGMLQuantizationType.Q8_0
    assert torch.equal(embed.dequantize(), expected["model.embed_tokens.weight"])
    for name, tensor in expected.items():
        if name != "model.embed_tokens.weight":
            assert torch.equal(loaded.weights[name], tensor), name  # type: ignore[arg-type]
