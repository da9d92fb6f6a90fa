"""What start-up imports, and what it may not (docs/perf/startup.md).

The front end imports its app before it spawns the engine, so whatever that
import pulls in delays the engine's start: torch and transformers (1-3 s)
must stay out of it. The engine imports torch, but not dynamo and inductor
(~1 s more; llguidance.torch pulls them in through a torch.compile
decorator). A tokenizer folder naming the generic fast class loads without
AutoTokenizer's model registry, and gives what AutoTokenizer gives; where
`tokenizers` alone encodes and decodes as transformers does (the default
model's converted tokenizer), the engine does not import transformers at all.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.config import default_model_path
from stoker.models import tokenizer as tokenizer_module
from stoker.models.identity import gguf_tokenizer_folder
from stoker.models.loader import load_tokenizer
from stoker.models.tokenizer import (
    Tokenizer,
    backend_serves,
    load_hf_tokenizer,
    preload_backend,
    preload_hf_tokenizer,
)

pytestmark = pytest.mark.timeout(120)


def _modules_after(imports: str) -> set[str]:
    code = f"import sys\n{imports}\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True)
    return set(done.stdout.split())


def test_the_front_end_imports_neither_torch_nor_transformers_before_it_spawns_the_engine() -> None:
    modules = _modules_after("import stoker.cli, stoker.server.cli, stoker.server.app")
    assert "torch" not in modules
    assert "transformers" not in modules
    assert "llguidance" in modules  # the grammar check is there, only its torch half is not
    assert "matplotlib" not in modules  # the bench extra: a server may not have it


def test_the_engine_core_does_not_import_torch_compile() -> None:
    modules = _modules_after("import stoker.engine.core")
    assert "torch" in modules
    assert "torch._dynamo" not in modules
    assert "torch._inductor" not in modules
    assert not {"matplotlib", "accelerate"} & modules  # the bench extra: a server may not have it


def test_a_generic_tokenizer_folder_loads_as_auto_tokenizer_loads_it() -> None:
    from transformers import AutoTokenizer

    path = default_model_path()
    tokenizer = load_tokenizer(path)  # converts the GGUF's tokenizer into the cache
    folder = gguf_tokenizer_folder(path)
    direct = load_hf_tokenizer(folder)
    auto = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert type(direct) is type(auto) is type(tokenizer.hf)
    text = "Hello world, <|im_start|>how are you? 123 \u00e9t\u00e9 <|im_end|>"
    assert direct.encode(text) == auto.encode(text) == tokenizer.encode(text)
    assert direct.eos_token_id == auto.eos_token_id
    assert direct.chat_template == auto.chat_template


def test_the_default_models_tokenizer_loads_without_transformers() -> None:
    path = default_model_path()
    load_tokenizer(path)  # the GGUF's tokenizer converted into the cache (that step uses transformers)
    modules = _modules_after(f"from stoker.models.loader import load_tokenizer\nload_tokenizer({str(path)!r})")
    assert "tokenizers" in modules
    assert "transformers" not in modules


def test_the_tokenizers_backend_encodes_and_decodes_as_transformers_does() -> None:
    path = default_model_path()
    light = load_tokenizer(path)
    folder = gguf_tokenizer_folder(path)
    full = Tokenizer(load_hf_tokenizer(folder), light.eos_token_ids)
    assert light._hf is None  # the backend path was taken
    assert light.eos_token_ids == full.eos_token_ids and light.eos_token_ids
    assert light._backend_id("eos_token") == full.hf.eos_token_id is not None
    assert light.bos_token_id == full.bos_token_id
    assert light.vocab_size == full.vocab_size
    texts = [
        "Hello world, <|im_start|>how are you? 123 \u00e9t\u00e9 <|im_end|>",
        "  leading spaces\n\ttabs and \u4f60\u597d, emoji \U0001f600 <|endoftext|>",
        "",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    ]
    for text in texts:
        for special in (True, False):
            assert light.encode(text, add_special_tokens=special) == full.encode(text, add_special_tokens=special)
    rng = random.Random(0)
    specials = full.all_special_ids
    for _ in range(200):
        ids = [rng.randrange(light.vocab_size) for _ in range(rng.randrange(1, 12))]
        ids += rng.sample(specials, min(2, len(specials)))
        rng.shuffle(ids)
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip)
    # The transformers half loads on first use, here and in a process that unpickles it;
    # that process loads the backend from the folder too: the pickle carries neither.
    assert light.chat_template == full.chat_template
    sent = pickle.dumps(light)
    assert len(sent) < 10_000, "the backend's JSON went into the pickle"
    copy = pickle.loads(sent)
    assert copy._hf is None and copy.encode(texts[0]) == full.encode(texts[0])
    assert copy.decode(copy.encode(texts[1])) == light.decode(light.encode(texts[1]))
    assert type(copy.hf) is type(full.hf)


def test_which_folders_the_tokenizers_backend_serves(tmp_path: Path) -> None:
    source = gguf_tokenizer_folder(default_model_path())
    load_tokenizer(default_model_path())

    def folder_with(**config: object) -> Path:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(source, folder)
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        settings.update(config)
        (folder / "tokenizer_config.json").write_text(json.dumps(settings))
        return folder

    assert backend_serves(source)
    assert backend_serves(folder_with(clean_up_tokenization_spaces=True))  # BPE: transformers skips the clean-up
    assert not backend_serves(folder_with(tokenizer_class="LlamaTokenizer"))  # a subclass may differ
    assert not backend_serves(folder_with(add_bos_token=True))  # rewrites the post-processor
    assert not backend_serves(tmp_path)  # no tokenizer files at all


@pytest.mark.parametrize("embedding_model", [None, "all-MiniLM-L6-v2"])
def test_the_front_end_imports_transformers_but_not_torch(embedding_model: str | None) -> None:
    """The front end's loading thread needs transformers (the chat half of the
    tokenizer, preloaded there); the embedding model runs on numpy, so no torch either way."""
    load_tokenizer(default_model_path())  # its folder converted, as an earlier start leaves it
    modules = _modules_after(
        "from types import SimpleNamespace\n"
        "from stoker.server.app import _prepare_front_end\n"
        "from stoker.models import tokenizer\n"
        f"config = SimpleNamespace(embedding_model={embedding_model!r}, embedding_batch_size=4)\n"
        f"version = SimpleNamespace(spec=SimpleNamespace(kind='generate', path={str(default_model_path())!r}))\n"
        "fleet = SimpleNamespace(initial=[version])\n"
        "embedder = _prepare_front_end(SimpleNamespace(config=config, embeddings_disabled=None, fleet=fleet))\n"
        "assert len(tokenizer._preloaded) == len(tokenizer._preloaded_backends) == 1\n"
        f"assert (embedder is None) == {embedding_model is None}\n"
        "assert embedder is None or embedder.model.forward([[101, 7592, 102]]).shape == (1, 384)"
    )
    assert "transformers" in modules
    assert "torch" not in modules


def test_a_preloaded_tokenizer_goes_to_the_first_tokenizer_of_its_folder(tmp_path: Path) -> None:
    """The front end preloads both halves while its engine loads; the engine's
    Tokenizer, unpickled when the engine is ready, takes them instead of parsing
    the folder's files again."""
    path = default_model_path()
    folder = gguf_tokenizer_folder(path)
    engines = load_tokenizer(path)
    preload_backend(folder)
    preload_backend(tmp_path)  # no tokenizer there: nothing loaded, nothing raised
    backend = tokenizer_module._preloaded_backends[folder.resolve()]
    sent = pickle.loads(pickle.dumps(engines))  # as the engine sends it: neither half
    assert sent._backend is backend and tokenizer_module._preloaded_backends == {}
    assert sent._hf is None
    preload_hf_tokenizer(folder)
    preload_hf_tokenizer(tmp_path)
    preloaded = tokenizer_module._preloaded[folder.resolve()]
    assert sent.hf is preloaded and tokenizer_module._preloaded == {}
    again = pickle.loads(pickle.dumps(engines))
    assert again._backend is not backend and again.hf is not preloaded  # its own, to set a chat template on
    text = "<|im_start|>user\nhi \u00e9t\u00e9<|im_end|>"
    assert again.encode(text) == sent.encode(text) == engines.encode(text)
    assert again.hf.encode(text) == preloaded.encode(text) and again.chat_template == preloaded.chat_template
