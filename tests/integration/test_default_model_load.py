"""The default GGUF, loaded by stoker, equals what transformers loads from it:
every weight tensor bit for bit, and token ids on awkward strings."""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import PreTrainedModel

from stoker.config import default_model_path
from stoker.models.loader import LoadedModel, load_model, load_tokenizer

pytestmark = pytest.mark.integration

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines\r\n",
    "naïve café — déjà vu; 日本語のテキスト; Ελληνικά",
    "emoji 🦀🚀👩‍👩‍👧‍👦 and flags 🇫🇷",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "x = [i**2 for i in range(10)]  # code",
    "",
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def loaded(gguf_path: str) -> LoadedModel:
    return load_model(gguf_path, torch.float32)


def test_config(loaded: LoadedModel) -> None:
    c = loaded.config
    assert c.architecture == "LlamaForCausalLM"
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.vocab_size == 49152 and c.intermediate_size == 1536
    assert c.tie_word_embeddings and "lm_head.weight" not in loaded.weights
    assert c.name == "smollm2-135m-instruct"
    assert c.eos_token_ids == [2] == loaded.tokenizer.eos_token_ids
    assert loaded.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


def test_weights_equal_transformers(loaded: LoadedModel, transformers_default_model: PreTrainedModel) -> None:
    state = transformers_default_model.state_dict()
    expected = {k: v for k, v in state.items() if not k.endswith("inv_freq")}
    expected.pop("lm_head.weight")  # tied: transformers exposes the embedding under both names
    assert sorted(loaded.weights) == sorted(expected)
    for name, tensor in expected.items():
        got = loaded.weights[name]
        assert got.dtype == torch.float32 and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name


def test_bfloat16_is_float32_rounded(gguf_path: str, loaded: LoadedModel) -> None:
    bf16 = load_model(gguf_path, torch.bfloat16)
    for name, tensor in loaded.weights.items():
        assert bf16.weights[name].dtype == torch.bfloat16
        assert torch.equal(bf16.weights[name], tensor.to(torch.bfloat16)), name


def test_tokenizer_equals_transformers(gguf_path: str, loaded: LoadedModel) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), local_files_only=True
    )
    tok = loaded.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.encode("Hello")[0] != tok.bos_token_id  # SmolLM's tokenizer adds no BOS
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert tok.vocab_size == len(ref) == 49152


def test_chat_template_renders_chatml(loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    )
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    assert isinstance(ids, list) and ids[0] == 1 and ids[-1] != 2


def test_second_load_is_fast(gguf_path: str, loaded: LoadedModel) -> None:
    # The fixture above populated the cache; a reload only reads it back.
    start = time.perf_counter()
    again = load_model(gguf_path, torch.float32)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"cached load took {elapsed:.1f}s"
    assert again.config == loaded.config
    start = time.perf_counter()
    load_tokenizer(gguf_path)
    assert time.perf_counter() - start < 3.0
