"""A GGUF's converted tokenizer is cached under the generic fast class when that
loads the same tokenizer as the model's own class (tokenizer.settle_generic_class):
a Qwen2 GGUF then starts without AutoTokenizer (which imports torch into the
front end) and with the `tokenizers`-only path in the engine, and every id and
text is what the Qwen2Tokenizer served before gives."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from stoker.bench.synthetic_gguf import LlamaShape, T, write_llama_gguf
from stoker.models.gguf_loader import gguf_tokenizer
from stoker.models.identity import gguf_tokenizer_folder
from stoker.models.tokenizer import _adds_only_a_constructor, backend_from_file

pytestmark = pytest.mark.timeout(180)

TEXTS = [
    "Hello world, <|im_start|>how are you? 123 \u00e9t\u00e9 <|im_end|>",
    "cafe\u0301 and caf\u00e9",  # NFC makes the two spellings one: Qwen2Tokenizer normalizes, the raw conversion not
    "  leading spaces\n\ttabs and \u4f60\u597d, emoji \U0001f600 it's <|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen-gguf")
    shape = LlamaShape(
        hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, vocab=320, arch="qwen2", tied=True, qkv_bias=True
    )
    shape = LlamaShape(**{**shape.__dict__, "types": dict.fromkeys(shape.types, T.Q8_0)})
    return write_llama_gguf(folder / "tiny-qwen2.gguf", shape, name="tiny-qwen2")


@pytest.fixture(scope="module")
def reference(qwen_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    """What the engine loaded before: transformers' conversion of the GGUF, saved, loaded back by AutoTokenizer."""
    converted = AutoTokenizer.from_pretrained(qwen_gguf.parent, gguf_file=qwen_gguf.name, local_files_only=True)
    saved = tmp_path_factory.mktemp("reference")
    converted.save_pretrained(saved)
    loaded: PreTrainedTokenizerFast = AutoTokenizer.from_pretrained(saved, local_files_only=True)
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    return loaded


def test_a_qwen2_gguf_tokenizer_is_cached_under_the_generic_class_and_served_by_its_backend(
    qwen_gguf: Path, reference: PreTrainedTokenizerFast
) -> None:
    tok = gguf_tokenizer(str(qwen_gguf))
    folder = gguf_tokenizer_folder(str(qwen_gguf))
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    assert tok._hf is None  # the engine's path: no transformers
    assert type(tok.hf) is PreTrainedTokenizerFast
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == reference.encode(text, add_special_tokens=special)
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(reference)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert tok.eos_token_ids[0] == reference.eos_token_id
    assert tok.bos_token_id == reference.bos_token_id
    assert tok.vocab_size == len(reference)
    assert tok.all_special_ids == reference.all_special_ids
    assert tok.chat_template == reference.chat_template


def test_the_raw_conversion_would_have_tokenized_differently(
    qwen_gguf: Path, reference: PreTrainedTokenizerFast
) -> None:
    """Why the folder keeps the backend its class builds, not the one transformers' GGUF conversion wrote."""
    converted = AutoTokenizer.from_pretrained(qwen_gguf.parent, gguf_file=qwen_gguf.name, local_files_only=True)
    raw = backend_from_file(_saved(converted, qwen_gguf.parent / "raw") / "tokenizer.json")
    assert raw.encode(TEXTS[1]).ids != reference.encode(TEXTS[1], add_special_tokens=False)


def _saved(hf: PreTrainedTokenizerFast, folder: Path) -> Path:
    hf.save_pretrained(folder)
    return folder


def test_loading_it_imports_neither_transformers_in_the_engine_nor_torch_in_the_front_end(qwen_gguf: Path) -> None:
    gguf_tokenizer(str(qwen_gguf))
    folder = gguf_tokenizer_folder(str(qwen_gguf))
    engine = _modules_after(f"from stoker.models.gguf_loader import gguf_tokenizer\ngguf_tokenizer({str(qwen_gguf)!r})")
    assert "transformers" not in engine
    front = _modules_after(
        f"from pathlib import Path\nfrom stoker.models.tokenizer import load_hf_tokenizer\n"
        f"load_hf_tokenizer(Path({str(folder)!r}))"
    )
    assert "transformers" in front and "torch" not in front


def _modules_after(code: str) -> set[str]:
    program = f"import sys\n{code}\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True)
    return set(done.stdout.split())


class _OnlyAConstructor(PreTrainedTokenizerFast):
    model = dict  # data for the constructor, not behaviour

    def __init__(self) -> None:
        pass


class _AMethod(_OnlyAConstructor):
    def _decode(self, *args: object, **kwargs: object) -> str:
        return ""


class _AProperty(PreTrainedTokenizerFast):
    @property
    def vocab_size(self) -> int:
        return 0


def test_only_a_class_that_adds_nothing_but_its_constructor_is_replaced() -> None:
    assert _adds_only_a_constructor(_OnlyAConstructor, PreTrainedTokenizerFast)
    assert not _adds_only_a_constructor(_AMethod, PreTrainedTokenizerFast)
    assert not _adds_only_a_constructor(_AProperty, PreTrainedTokenizerFast)
    assert not _adds_only_a_constructor(str, PreTrainedTokenizerFast)
