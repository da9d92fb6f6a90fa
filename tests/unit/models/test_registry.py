"""The registry entry of an architecture is where its facts live: the loaders and
the model builder read them there, and nothing else in the package tells families
apart by name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from test_loader import write_tiny_gguf
from tiny_models import make_tiny_hf_model

import stoker
from stoker.models import registry
from stoker.models.loader import load_model
from stoker.models.registry import ARCHITECTURES, GGUF_ARCHITECTURES, build_model

PACKAGE = Path(stoker.__file__).parent


def _family_names() -> set[str]:
    """Every spelling of a registered family a branch could test: HF names, GGUF
    general.architecture values and the bare family words (mistral, qwen2)."""
    names = set(ARCHITECTURES) | set(GGUF_ARCHITECTURES)
    names |= {hf.removesuffix("ForCausalLM") for hf in ARCHITECTURES}
    return {n.lower() for n in names}


def _strings(node: ast.AST) -> list[tuple[int, str]]:
    return [(n.lineno, n.value) for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _name_branches(source: str) -> list[tuple[int, str]]:
    """(line, text) of each comparison, match case or dict key on a family name."""
    names = _family_names()
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        operands: list[ast.AST]
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.match_case):
            operands = [node.pattern]
        elif isinstance(node, ast.Dict):
            operands = [k for k in node.keys if k is not None]
        else:
            continue
        found += [(line, text) for o in operands for line, text in _strings(o) if text.lower() in names]
    return found


def test_no_architecture_name_branches_outside_the_registry() -> None:
    branches = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {text!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "models" / "registry.py"
        for line, text in _name_branches(path.read_text())
    ]
    assert not branches, "architecture facts belong in models/registry.py, not in a name test:\n" + "\n".join(branches)


def test_the_scan_sees_a_name_branch() -> None:
    assert _name_branches('bias = arch == "Qwen2ForCausalLM"\npermute = gguf in ("llama",)') == [
        (1, "Qwen2ForCausalLM"),
        (2, "llama"),
    ]
    assert _name_branches('if "mistral" in name.lower(): pass') == [(1, "mistral")]
    assert _name_branches('match arch:\n    case "qwen3":\n        pass') == [(2, "qwen3")]
    assert _name_branches('ROWS = {"LLAMA": "interleaved"}') == [(1, "LLAMA")]
    assert _name_branches('writer = GGUFWriter(path, "llama")') == []


def _flip(monkeypatch: pytest.MonkeyPatch, hf_name: str, **facts: object) -> None:
    monkeypatch.setitem(ARCHITECTURES, hf_name, dataclasses.replace(ARCHITECTURES[hf_name], **facts))  # type: ignore[arg-type]


def _built_layer(path: Path) -> object:
    loaded = load_model(str(path), torch.float32)
    model = build_model(loaded.config, loaded.weights, torch.float32, torch.device("cpu"))
    return model.layers[0]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("arch", "hf_name", "fact", "layer_part"),
    [("qwen2", "Qwen2ForCausalLM", "qkv_bias", "qkv.bias"), ("qwen3", "Qwen3ForCausalLM", "qk_norm", "q_norm")],
)
def test_hf_loader_reads_the_entry(
    arch: str, hf_name: str, fact: str, layer_part: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same folder builds with the part while the entry says so, without it once the entry does not."""
    folder = make_tiny_hf_model(arch, tmp_path)
    first, _, second = layer_part.partition(".")

    def part(layer: object) -> object:
        value = getattr(layer, first)
        return getattr(value, second) if second else value

    assert part(_built_layer(folder)) is not None
    _flip(monkeypatch, hf_name, **{fact: False})
    assert part(_built_layer(folder)) is None


def test_gguf_loader_reads_the_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The q/k row order and the general.name marker come from the entries."""
    path = tmp_path / "Tiny-qwen2-Q8_0.gguf"
    expected = write_tiny_gguf(path, "qwen2")
    q = "model.layers.0.self_attn.q_proj.weight"
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "cache-as-registered"))
    assert torch.equal(load_model(str(path), torch.float32).weights[q], expected[q])  # type: ignore[arg-type]
    qwen2 = ARCHITECTURES["Qwen2ForCausalLM"]
    assert qwen2.gguf is not None
    _flip(monkeypatch, "Qwen2ForCausalLM", gguf=dataclasses.replace(qwen2.gguf, qk_rows="interleaved"))
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "cache-flipped"))
    assert not torch.equal(load_model(str(path), torch.float32).weights[q], expected[q])  # type: ignore[arg-type]

    mistral = tmp_path / "Tiny-mistral-Q8_0.gguf"
    write_tiny_gguf(mistral, "llama", general_name="Mistral-7B-Instruct-v0.3")
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "cache-mistral"))
    assert load_model(str(mistral), torch.float32).config.architecture == "MistralForCausalLM"
    entry = ARCHITECTURES["MistralForCausalLM"]
    assert entry.gguf is not None
    _flip(monkeypatch, "MistralForCausalLM", gguf=dataclasses.replace(entry.gguf, name_contains="zephyr"))
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "cache-mistral-flipped"))
    assert load_model(str(mistral), torch.float32).config.architecture == "LlamaForCausalLM"


def test_gguf_architectures_lists_each_default_family_once() -> None:
    assert GGUF_ARCHITECTURES == {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }


def test_the_recipe_in_the_docs_is_the_registry() -> None:
    """docs/architecture.md's "How to add" entries are lines of registry.py as they stand."""
    docs = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    recipe = docs.split("- **an architecture**", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    lines = [line.strip() for line in recipe.splitlines() if line.strip()]
    source = Path(registry.__file__).read_text()
    assert lines and all(line in source for line in lines), lines
