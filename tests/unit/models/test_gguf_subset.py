"""A layer subset of a GGUF (models/gguf_subset.py, the self-draft of
`stoker bench self-draft`): the kept blocks byte for byte under their new
numbers, everything else unchanged, loadable by stoker and servable as a draft
model; and the arithmetic that predicts whether such a draft pays."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import cache_sharing_kernels
from gguf import GGUFReader

from stoker.bench.self_draft import (
    agreement_needed,
    agreement_runs,
    iid_tokens_per_verify,
    speedup,
    tokens_per_verify,
)
from stoker.bench.synthetic_gguf import LlamaShape, write_llama_gguf
from stoker.engine.llm import LLM
from stoker.engine.params import SamplingParams
from stoker.models.gguf_subset import parse_layers, write_layer_subset
from stoker.models.loader import load_model, load_tokenizer

SHAPE = LlamaShape(hidden=256, intermediate=512, layers=4, heads=4, kv_heads=2, vocab=300, context=256)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("subset") / "source.gguf", SHAPE)


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_CACHE_DIR", cache_sharing_kernels(tmp_path_factory.getbasetemp() / "subset-cache"))


def _tensors(path: Path) -> dict[str, bytes]:
    return {t.name: t.data.tobytes() for t in GGUFReader(str(path)).tensors}


def test_kept_blocks_are_renumbered_byte_for_byte(source: Path, tmp_path: Path) -> None:
    subset = write_layer_subset(source, tmp_path / "subset.gguf", [1, 3])
    src, sub = _tensors(source), _tensors(subset)
    assert {n for n in sub if n.startswith("blk.")} == {
        n.replace("blk.1.", "blk.0.").replace("blk.3.", "blk.1.") for n in src if n.startswith(("blk.1.", "blk.3."))
    }
    for name, data in sub.items():
        original = name.replace("blk.1.", "blk.3.").replace("blk.0.", "blk.1.") if name.startswith("blk.") else name
        assert data == src[original], name
    assert {n for n in sub if not n.startswith("blk.")} == {n for n in src if not n.startswith("blk.")}
    reader, original_reader = GGUFReader(str(subset)), GGUFReader(str(source))
    assert reader.get_field("llama.block_count").contents() == 2  # type: ignore[union-attr]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "general.name"):
        assert reader.get_field(key).contents() == original_reader.get_field(key).contents(), key  # type: ignore[union-attr]


def test_stoker_loads_the_subset_with_the_kept_layers_weights(source: Path, tmp_path: Path) -> None:
    subset = write_layer_subset(source, tmp_path / "subset.gguf", [0, 2])
    full = load_model(str(source), torch.float32)
    part = load_model(str(subset), torch.float32)
    assert part.config.num_layers == 2 and full.config.num_layers == 4
    assert part.config.vocab_size == full.config.vocab_size
    for new, old in ((0, 0), (1, 2)):
        for suffix in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            kept = part.weights[f"model.layers.{new}.{suffix}"]
            assert isinstance(kept, torch.Tensor)
            assert torch.equal(kept, full.weights[f"model.layers.{old}.{suffix}"])  # type: ignore[arg-type]
    assert torch.equal(part.weights["lm_head.weight"], full.weights["lm_head.weight"])  # type: ignore[arg-type]
    text = "hello there"
    assert load_tokenizer(str(subset)).encode(text) == load_tokenizer(str(source)).encode(text)


def test_a_subset_serves_as_the_draft_model(source: Path, tmp_path: Path) -> None:
    """All layers kept: the draft is the target, so nearly every guess is kept. Two of four:
    guesses are worse, the output is the same (verification is exact)."""
    whole = write_layer_subset(source, tmp_path / "whole.gguf", [0, 1, 2, 3])
    half = write_layer_subset(source, tmp_path / "half.gguf", [0, 1])
    prompts = [[5, 9, 17, 33, 60], [70, 71, 72]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    settings: dict[str, object] = {"num_kv_blocks": 32, "block_size": 8, "num_speculative_tokens": 3}
    plain = LLM(str(source), speculative_method="none", **settings)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for draft, least_acceptance in ((whole, 0.9), (half, 0.0)):
        llm = LLM(str(source), speculative_method="draft", speculative_model=str(draft), **settings)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        spec = llm.engine.speculator
        assert spec is not None and spec.num_draft_tokens > 0
        assert spec.num_accepted_tokens >= least_acceptance * spec.num_draft_tokens


@pytest.mark.parametrize(
    ("spec", "layers"),
    [("first:3", [0, 1, 2]), ("every:2", [0, 2, 4, 6]), ("drop:3", [0, 1, 3, 4, 6]), ("5;1;3", [1, 3, 5])],
)
def test_layer_specs(spec: str, layers: list[int]) -> None:
    assert parse_layers(spec, 7) == layers


@pytest.mark.parametrize("spec", ["first:0", "first:8", "every:0", "drop:1", "last:2", "1;9", "x"])
def test_bad_layer_specs_name_the_spec(spec: str) -> None:
    with pytest.raises(ValueError, match=f"layer spec '{spec}'"):
        parse_layers(spec, 7)


def test_writer_refuses_layers_out_of_range(source: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"within 0\.\.3"):
        write_layer_subset(source, tmp_path / "bad.gguf", [0, 4])


def test_expected_tokens_follow_runs_of_agreement() -> None:
    draft, target = [1, 2, 3, 9, 5, 6], [1, 2, 3, 4, 5, 6]
    assert agreement_runs(draft, target) == [3, 2, 1, 0, 2, 1]
    # k = 2: min(run, 2) averages (2 + 2 + 1 + 0 + 2 + 1) / 6 = 4/3, plus the target's own token.
    assert tokens_per_verify(agreement_runs(draft, target), 2) == pytest.approx(1 + 4 / 3)
    assert iid_tokens_per_verify(0.5, 2) == pytest.approx(1.75)
    assert iid_tokens_per_verify(1.0, 3) == 4.0
    # 1.75 tokens for a 0.2 draft step and a 1.2 verify, against 1.0 per plain token.
    assert speedup(1.75, 2, 0.2, [1.0, 1.1, 1.2]) == pytest.approx(1.75 / 1.6)


def test_agreement_needed_for_a_goal() -> None:
    # Free draft, free rows: k = 1 needs 1 + a >= 1.1; k = 2 needs 1 + a + a^2 >= 1.1, a bit less.
    assert agreement_needed(1.1, 0.0, [1.0, 1.0], 1) == pytest.approx(0.1, abs=1e-6)
    needed = agreement_needed(1.1, 0.0, [1.0, 1.0, 1.0], 2)
    assert needed is not None and needed**2 + needed == pytest.approx(0.1, abs=1e-6)
    # A draft as costly as the target: even perfect guesses give 2 tokens for 2.2 units.
    assert agreement_needed(1.1, 1.0, [1.0, 1.2], 1) is None
