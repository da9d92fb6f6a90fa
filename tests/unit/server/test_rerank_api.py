"""/v1/rerank and /v1/score on a real server (127.0.0.1): two random-weight
cross-encoders (BERT and XLM-R) in the fleet beside a chat model (the fake
core) and the bundled embedding model. Scores against transformers within
1e-4 in the same order; the shapes; each kind refusing the endpoints it does
not serve; bounds; the key's allow-list and budget; hot swap; metrics."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import FAKE_CORE, ServerProcess, start_server
from tiny_rerankers import make_tiny_cross_encoder, reference_scores

from stoker.config import default_model_path
from stoker.control.db import open_db
from stoker.control.keys import KeyStore
from stoker.models.embedding import bundled_model_path
from stoker.server.rerank_protocol import MAX_RERANK_DOCUMENTS

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "Berlin is the capital of Germany.",
    "The quick brown fox jumps over the lazy dog.",
    "x",
    "Rerankers sort documents by relevance to a query.",
]
KEYS: dict[str, str] = {}
KEY_IDS: dict[str, str] = {}
BUDGET = 60


def _digest(folder: Path) -> str:
    from stoker.models.digest import model_digest

    return model_digest(str(folder))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rerankers")
    return {
        "rr": make_tiny_cross_encoder("bert", root / "rr"),
        "xr": make_tiny_cross_encoder("xlm-roberta", root / "xr", seed=1),
        "rr-next": make_tiny_cross_encoder("bert", root / "rr-next", seed=2),
    }


@pytest.fixture(scope="module")
def server(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("rerank-server")
    db = str(tmp / "keys.db")
    store = KeyStore(open_db(db))
    for name, options in {
        "admin": {"admin": True},
        "chat-only": {"models": ["chat"]},
        "budgeted": {"budget_tokens": BUDGET},
    }.items():
        key, secret = store.create(name, **options)  # type: ignore[arg-type]
        KEYS[name], KEY_IDS[name] = secret, key.id
    server = start_server(
        ["--engine-core", FAKE_CORE, "--max-model-len", "256", "--model", f"chat={default_model_path()}"]
        + ["--model", f"rr={folders['rr']}@{_digest(folders['rr'])}", "--model", f"xr={folders['xr']}"]
        + ["--model-root", str(folders["rr"].parent)],
        str(tmp),
        env={"STOKER_DB": db},
    )
    server.key = KEYS["admin"]
    try:
        yield server
    finally:
        server.stop()


def post(server: ServerProcess, path: str, body: dict, key: str = "admin") -> httpx.Response:
    # json.dumps escapes lone surrogates ("\\ud800"), which httpx's own encoder cannot send.
    headers = {"Authorization": f"Bearer {KEYS[key]}", "content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), timeout=60, headers=headers)


@pytest.mark.parametrize("model", ["rr", "xr"])
def test_rerank_matches_transformers(server: ServerProcess, folders: dict[str, Path], model: str) -> None:
    expected, lengths = reference_scores(folders[model], QUERY, DOCUMENTS)
    reply = post(server, "/v1/rerank", {"model": model, "query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == model and body["id"].startswith("rerank-")
    assert body["usage"] == {"prompt_tokens": sum(lengths), "total_tokens": sum(lengths)}
    results = body["results"]
    assert [r["index"] for r in results] == np.argsort(-np.array(expected), kind="stable").tolist()
    for result in results:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-4)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}


def test_rerank_shapes_aliases_top_n_and_documents(server: ServerProcess) -> None:
    full = post(server, "/v1/rerank", {"model": "rr", "query": QUERY, "documents": DOCUMENTS}).json()["results"]
    # Cohere's objects, its path, top_n and no documents back: the same scores, the best two.
    cohere = post(
        server,
        "/v2/rerank",
        {"model": "rr", "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 2},
    ).json()["results"]
    assert [r["index"] for r in cohere] == [r["index"] for r in full[:2]]
    assert [r["relevance_score"] for r in cohere] == pytest.approx([r["relevance_score"] for r in full[:2]], abs=1e-5)
    bare = post(
        server, "/rerank", {"model": "rr", "query": QUERY, "documents": DOCUMENTS, "return_documents": False}
    ).json()["results"]
    assert all("document" not in r for r in bare)
    assert [r["index"] for r in bare] == [r["index"] for r in full]
    # No model named: the first reranker served.
    unnamed = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()
    assert unnamed["model"] == "rr" and [r["index"] for r in unnamed["results"]] == [r["index"] for r in full]
    # /v1/score, one to many and paired, gives the same scores in the pairs' order.
    by_index = {r["index"]: r["relevance_score"] for r in full}
    one_to_many = post(server, "/v1/score", {"model": "rr", "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert one_to_many["object"] == "list" and one_to_many["model"] == "rr"
    assert [d["index"] for d in one_to_many["data"]] == list(range(len(DOCUMENTS)))
    assert all(d["object"] == "score" for d in one_to_many["data"])
    assert [d["score"] for d in one_to_many["data"]] == pytest.approx(
        [by_index[i] for i in range(len(DOCUMENTS))], abs=1e-5
    )
    paired = post(server, "/score", {"model": "rr", "text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]}).json()
    assert [d["score"] for d in paired["data"]] == pytest.approx([by_index[0], by_index[1]], abs=1e-5)
    assert paired["usage"]["total_tokens"] > 0


def test_score_with_the_embedding_model_matches_transformers(server: ServerProcess) -> None:
    from transformers import AutoModel, AutoTokenizer

    path = bundled_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    encoded = tokenizer([QUERY, *DOCUMENTS], padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    vectors = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)
    expected = (vectors[1:] @ vectors[0]).tolist()
    reply = post(server, "/v1/score", {"model": "all-MiniLM-L6-v2", "text_1": QUERY, "text_2": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    scores = [d["score"] for d in reply.json()["data"]]
    assert scores == pytest.approx(expected, abs=1e-4)
    assert np.argsort(scores).tolist() == np.argsort(expected).tolist()
    assert reply.json()["usage"]["prompt_tokens"] == int(encoded["attention_mask"].sum())


def test_each_kind_refuses_what_it_does_not_serve(server: ServerProcess) -> None:
    for path, body, kind in [
        ("/v1/rerank", {"model": "chat", "query": "q", "documents": ["d"]}, "chat model"),
        ("/v1/score", {"model": "chat", "text_1": "q", "text_2": "d"}, "chat model"),
        ("/v1/rerank", {"model": "all-MiniLM-L6-v2", "query": "q", "documents": ["d"]}, "embedding model"),
        ("/tokenize", {"model": "rr", "prompt": "hi"}, "reranker"),
        ("/v1/completions", {"model": "rr", "prompt": "hi"}, "reranker"),
    ]:
        reply = post(server, path, body)
        assert reply.status_code == 400, (path, reply.text)
        assert kind in reply.json()["error"]["message"] and reply.json()["error"]["code"] == "wrong_model_kind"
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["admin"], max_retries=0)
    with pytest.raises(openai.BadRequestError, match="rr is a reranker"):
        client.chat.completions.create(model="rr", messages=[{"role": "user", "content": "hi"}])
    assert post(server, "/v1/rerank", {"model": "nope", "query": "q", "documents": ["d"]}).status_code == 404


def test_bounds_answer_400_never_500(server: ServerProcess) -> None:
    long_text = " ".join(["relevance ranking of long documents"] * 60)
    refused = [
        {"model": "rr", "query": "q", "documents": []},
        {"model": "rr", "query": "q", "documents": ["d"] * (MAX_RERANK_DOCUMENTS + 1)},
        {"model": "rr", "query": "q", "documents": ["d", long_text]},
        {"model": "rr", "query": long_text, "documents": ["d"], "truncate": True},
        {"model": "rr", "query": "q", "documents": ["d"], "top_n": -1},
        {"model": "rr", "query": "q", "documents": [{"title": "no text"}]},
        {"model": "rr", "documents": ["d"]},
        {"model": "rr", "query": "\ud800", "documents": ["d"]},  # a lone surrogate no tokenizer encodes
        {"model": "rr", "query": "q", "documents": [{"text": "d\udfff"}]},
    ]
    for body in refused:
        reply = post(server, "/v1/rerank", body)
        assert reply.status_code == 400, (body, reply.text)
    too_long = post(server, "/v1/rerank", {"model": "rr", "query": "q", "documents": ["d", long_text]}).json()
    assert "documents[1]" in too_long["error"]["message"] and "truncate" in too_long["error"]["message"]
    assert too_long["error"]["code"] == "context_length_exceeded"
    cut = post(server, "/v1/rerank", {"model": "rr", "query": "q", "documents": ["d", long_text], "truncate": True})
    assert cut.status_code == 200 and cut.json()["usage"]["total_tokens"] <= 128 + 10
    mismatched = post(server, "/v1/score", {"model": "rr", "text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert mismatched.status_code == 400 and "paired" in mismatched.json()["error"]["message"]
    embedding_long = {"model": "all-MiniLM-L6-v2", "text_1": "q", "text_2": " ".join(["word"] * 400)}
    assert post(server, "/v1/score", embedding_long).status_code == 400
    assert post(server, "/v1/score", {**embedding_long, "truncate": True}).status_code == 200
    assert post(server, "/v1/score", {**embedding_long, "text_1": "\ud800"}).status_code == 400
    assert post(server, "/v1/embeddings", {"input": "\ud800"}).status_code == 400


def test_allow_list_budget_and_usage(server: ServerProcess) -> None:
    body = {"model": "rr", "query": QUERY, "documents": DOCUMENTS[:2]}
    score = {"model": "rr", "text_1": "a", "text_2": "b"}
    for path, sent in [
        ("/v1/rerank", body),
        ("/rerank", body),
        ("/v2/rerank", body),
        ("/v1/score", score),
        ("/score", score),
    ]:
        assert httpx.post(f"{server.url}{path}", json=sent, timeout=30).status_code == 401, path
    refused = post(server, "/v1/rerank", body, key="chat-only")
    assert refused.status_code == 403, refused.text
    assert post(server, "/v1/score", {"model": "xr", "text_1": "a", "text_2": "b"}, key="chat-only").status_code == 403
    first = post(server, "/v1/rerank", body, key="budgeted")
    assert first.status_code == 200, first.text
    used = first.json()["usage"]["total_tokens"]
    assert BUDGET / 2 < used <= BUDGET
    assert post(server, "/v1/rerank", body, key="budgeted").status_code == 429  # the budget counted its tokens
    admin = {"Authorization": f"Bearer {KEYS['admin']}"}
    usage = httpx.get(f"{server.url}/admin/keys/{KEY_IDS['budgeted']}", headers=admin, timeout=10).json()["usage"]
    assert usage["this_period"]["total_tokens"] == used


def test_models_metrics_and_hot_swap(server: ServerProcess, folders: dict[str, Path]) -> None:
    admin = {"Authorization": f"Bearer {KEYS['admin']}"}
    listed = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models", headers=admin).json()["data"]}
    assert {"chat", "rr", "xr", "all-MiniLM-L6-v2"} <= set(listed)
    assert listed["rr"]["max_model_len"] == 128 and listed["rr"]["digest"] == _digest(folders["rr"])
    metrics = httpx.get(f"{server.url}/metrics", headers=admin).text
    assert 'stoker:model_version_requests_total{model_name="rr",outcome="ok",version="v1"}' in metrics
    described = httpx.get(f"{server.url}/admin/models", headers=admin).json()["data"]
    assert {m["name"]: m["stable"]["kind"] for m in described} == {"chat": "generate", "rr": "rerank", "xr": "rerank"}
    # It runs in the front end's process: that process's size is not the reranker's.
    assert next(m for m in described if m["name"] == "rr")["stable"]["memory_bytes"] is None
    # A chat model's folder cannot become a new version of a reranker (refused before anything loads).
    chat_folder = folders["rr"].parent / "chat"
    chat_folder.mkdir()
    (chat_folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    mismatch = httpx.post(f"{server.url}/admin/models", json={"name": "rr", "path": str(chat_folder)}, headers=admin)
    assert mismatch.status_code == 409 and "rerank" in mismatch.json()["error"]["message"]
    swap = httpx.post(
        f"{server.url}/admin/models", json={"name": "rr", "path": str(folders["rr-next"])}, headers=admin, timeout=60
    )
    assert swap.status_code == 200, swap.text
    assert swap.json()["version"] == "v2"
    expected, _ = reference_scores(folders["rr-next"], QUERY, DOCUMENTS)
    reply = post(server, "/v1/score", {"model": "rr", "text_1": QUERY, "text_2": DOCUMENTS})
    assert reply.headers.get("x-stoker-model-version") in (None, "v2")
    assert [d["score"] for d in reply.json()["data"]] == pytest.approx(expected, abs=1e-4)


def test_digest_pin_is_checked(folders: dict[str, Path], tmp_path: Path) -> None:
    """A reranker pinned to other bytes does not start: the pin covers it as it covers a chat model."""
    wrong = "sha256:" + hashlib.sha256(b"other").hexdigest()
    with pytest.raises(RuntimeError, match="digest mismatch"):
        start_server(
            ["--engine-core", FAKE_CORE, "--no-embedding-model", "--model", f"rr={folders['rr']}@{wrong}"],
            str(tmp_path),
            ready_timeout=60,
        )
