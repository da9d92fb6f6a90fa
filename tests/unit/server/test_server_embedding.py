"""Our BERT encoder against transformers' AutoModel on the same folder."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from stoker.models.embedding import EmbeddingBatcher, EmbeddingModel, bundled_model_path

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "a", "Embeddings, pooled and normalized!"]


@pytest.fixture(scope="module")
def model() -> EmbeddingModel:
    return EmbeddingModel(bundled_model_path())


def reference(texts: list[str]) -> torch.Tensor:
    from transformers import AutoModel, AutoTokenizer

    path = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModel.from_pretrained(path).eval()
    enc = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = hf(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=1)


def test_matches_transformers(model: EmbeddingModel) -> None:
    ours = model.forward([model.encode_text(t) for t in TEXTS])
    assert model.name == "all-MiniLM-L6-v2" and model.dimensions == 384 and model.max_tokens == 256
    assert ours.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(ours), reference(TEXTS), atol=1e-5, rtol=1e-4)
    # Padding must not change a row: each text alone gives the same vector.
    alone = np.concatenate([model.forward([model.encode_text(t)]) for t in TEXTS])
    np.testing.assert_allclose(ours, alone, atol=1e-5, rtol=1e-4)


def test_raw_ids_get_cls_and_sep(model: EmbeddingModel) -> None:
    ids = model.encode_text("hello there")
    assert model.wrap_ids(ids[1:-1]) == ids and model.wrap_ids(ids) == ids


async def test_batcher_serves_concurrent_requests(model: EmbeddingModel) -> None:
    batcher = EmbeddingBatcher(model, max_batch=3)
    inputs = [[model.encode_text(t)] for t in TEXTS]
    results = await asyncio.gather(*(batcher.embed(i) for i in inputs))
    expected = model.forward([i[0] for i in inputs])
    for row, got in zip(expected, results):
        np.testing.assert_allclose(got[0], row, atol=1e-5, rtol=1e-4)
    batcher.close()


def test_a_bfloat16_folder_loads(model: EmbeddingModel, tmp_path) -> None:
    """numpy has no bfloat16: such weights are read through torch and widened."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bf16"
    shutil.copytree(bundled_model_path(), folder)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(folder / "model.safetensors"))
    bf16 = EmbeddingModel(str(folder))
    ids = [model.encode_text(t) for t in TEXTS]
    np.testing.assert_allclose(bf16.forward(ids), model.forward(ids), atol=2e-2)
