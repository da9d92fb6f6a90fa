"""Our cross-encoder (stoker.models.cross_encoder) against transformers'
BertForSequenceClassification and XLMRobertaForSequenceClassification on the
same random-weight folders: tokens, scores (sigmoid of the one logit) within
1e-4, the same order; truncation as transformers' only_second; the batcher."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tiny_rerankers import make_tiny_cross_encoder

from stoker.models.cross_encoder import CrossEncoder, PairBatcher, PairTooLongError, model_kind
from stoker.models.micro_batch import BatcherClosedError

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "Berlin is the capital of Germany.",
    "The quick brown fox jumps over the lazy dog.",
    "x",
    "Rerankers sort documents by relevance to a query.",
    "France",
]
ARCHS = ("bert", "xlm-roberta")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cross-encoders")
    return {arch: make_tiny_cross_encoder(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def models(folders: dict[str, Path]) -> dict[str, CrossEncoder]:
    return {arch: CrossEncoder(str(folder), arch) for arch, folder in folders.items()}


def reference(folder: Path, query: str, documents: list[str], **tokenize: object) -> tuple[np.ndarray, dict]:
    """transformers' scores (sigmoid of the logit) and its tokens, for each (query, document)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    encoded = tokenizer([query] * len(documents), documents, padding=True, return_tensors="pt", **tokenize)
    with torch.no_grad():
        logits = model(**encoded).logits
    return torch.sigmoid(logits[:, 0]).numpy(), encoded


@pytest.mark.parametrize("arch", ARCHS)
def test_scores_and_order_match_transformers(arch: str, folders: dict[str, Path], models: dict) -> None:
    model = models[arch]
    pairs = [model.pair(QUERY, d, truncate=False) for d in DOCUMENTS]
    expected, encoded = reference(folders[arch], QUERY, DOCUMENTS)
    for i, pair in enumerate(pairs):
        real = encoded["attention_mask"][i].bool()
        assert pair.ids == encoded["input_ids"][i][real].tolist()
        if "token_type_ids" in encoded:
            assert pair.type_ids == encoded["token_type_ids"][i][real].tolist()
    scores = model.forward(pairs)
    np.testing.assert_allclose(scores, expected, atol=1e-4, rtol=0)
    assert np.argsort(-scores, kind="stable").tolist() == np.argsort(-expected, kind="stable").tolist()
    # The scores spread enough that the order is a real check, not a tie broken by rounding.
    assert np.diff(np.sort(expected)).min() > 2e-4
    # A pair's score does not depend on its batch.
    alone = np.concatenate([model.forward([p]) for p in pairs])
    np.testing.assert_allclose(scores, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_truncate_cuts_the_document_as_transformers_only_second(
    arch: str, folders: dict[str, Path], models: dict
) -> None:
    model = models[arch]
    long_document = " ".join(["relevance ranking of long documents"] * 60)
    with pytest.raises(PairTooLongError, match=f"at most {model.max_tokens}"):
        model.pair(QUERY, long_document, truncate=False)
    pair = model.pair(QUERY, long_document, truncate=True)
    assert len(pair.ids) == model.max_tokens
    expected, encoded = reference(
        folders[arch], QUERY, [long_document], truncation="only_second", max_length=model.max_tokens
    )
    assert pair.ids == encoded["input_ids"][0].tolist()
    np.testing.assert_allclose(model.forward([pair]), expected, atol=1e-4, rtol=0)
    # A query that fills the model alone cannot be cut to fit.
    with pytest.raises(PairTooLongError, match="query alone"):
        model.pair(long_document, "a", truncate=True)


def test_model_kind_and_refusals(folders: dict[str, Path], tmp_path: Path) -> None:
    from stoker.config import default_model_path

    assert model_kind(str(folders["bert"])) == model_kind(str(folders["xlm-roberta"])) == "rerank"
    assert model_kind(default_model_path()) == "generate"
    two_labels = tmp_path / "two"
    make_tiny_cross_encoder("bert", two_labels)
    config = json.loads((two_labels / "config.json").read_text())
    config["id2label"] = {"0": "no", "1": "yes"}
    (two_labels / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="2 labels"):
        CrossEncoder(str(two_labels), "two")


async def test_batcher_shares_forward_passes(models: dict) -> None:
    model = models["bert"]
    batcher = PairBatcher(model, max_batch=4)
    calls: list[int] = []
    forward = model.forward

    def counted(batch: list) -> np.ndarray:
        calls.append(len(batch))
        return forward(batch)

    model.forward = counted  # type: ignore[method-assign]
    try:
        requests = [[model.pair(QUERY, d, truncate=False) for d in DOCUMENTS[i : i + 2]] for i in range(0, 6, 2)]
        results = await asyncio.gather(*(batcher.score(r) for r in requests))
    finally:
        del model.forward
        batcher.close()
    expected = model.forward([p for r in requests for p in r])
    np.testing.assert_allclose([s for r in results for s in r], expected, atol=1e-5, rtol=0)
    assert max(calls) > 2 and sum(calls) == 6  # requests met in one forward pass, none scored twice


async def test_closing_fails_the_pairs_still_waiting(models: dict) -> None:
    """A version ended under a request (the server's shutdown) answers it, rather than leaving it waiting."""
    model = models["bert"]
    batcher = PairBatcher(model)
    waiting = asyncio.create_task(batcher.score([model.pair(QUERY, "d", truncate=False)]))
    await asyncio.sleep(0)  # queued; the worker has not taken it yet
    batcher.close()
    with pytest.raises(BatcherClosedError, match="unloaded"):
        await waiting
