"""What start-up imports, and what it may not (docs/perf/startup.md).

The front end imports its app before it spawns the engine, so whatever that
import pulls in delays the engine's start: torch and transformers (1-3 s)
must stay out of it. The engine imports torch, but not dynamo and inductor
(~1 s more; llguidance.torch pulls them in through a torch.compile
decorator). A tokenizer folder naming the generic fast class loads without
AutoTokenizer's model registry, and gives what AutoTokenizer gives.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from stoker.config import default_model_path
from stoker.models.identity import gguf_tokenizer_folder
from stoker.models.loader import load_tokenizer
from stoker.models.tokenizer import load_hf_tokenizer

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


def test_the_engine_core_does_not_import_torch_compile() -> None:
    modules = _modules_after("import stoker.engine.core")
    assert "torch" in modules
    assert "torch._dynamo" not in modules
    assert "torch._inductor" not in modules


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
