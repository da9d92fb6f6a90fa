"""/v1/rerank (also /rerank and /v2/rerank) and /v1/score (also /score).

A reranker (a cross-encoder in the fleet, stoker/server/pooling.py) scores
each (query, document) pair; for /v1/score the embedding model may serve
instead, scoring a pair by the cosine of its two embeddings. Both run in the
front end's worker threads through micro-batchers, never on a chat engine's
step loop. Tokenizing (up to MAX_RERANK_DOCUMENTS texts) runs off the event
loop; a request is admitted (allow-list, budget, rate, tokens) once its
token count is known. Audience: any key (open mode: anyone), as /v1/embeddings.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
from fastapi import APIRouter, Depends, Request

from stoker.errors import APIError
from stoker.models.cross_encoder import CrossEncoder, PairTokens, PairTooLongError
from stoker.models.embedding import EmbeddingBatcher
from stoker.models.micro_batch import BatcherClosedError
from stoker.server.bounds import offload
from stoker.server.fleet import ModelVersion
from stoker.server.hooks import AdmissionInfo, FinishedRecord
from stoker.server.protocol import bad_request, unavailable
from stoker.server.rerank_protocol import RerankRequest, ScoreRequest
from stoker.server.serving import JSONObject
from stoker.server.state import ServerState, get_state, run_before_hooks

router = APIRouter(dependencies=[Depends(run_before_hooks)])


@dataclass
class Scorer:
    """What serves one request: a reranker's version, or the embedding model."""

    name: str
    version: ModelVersion | None = None
    embedder: EmbeddingBatcher | None = None


def _scorer(state: ServerState, name: str | None, endpoint: str) -> Scorer:
    state.check_accepting()
    embedder = state.embedder
    if embedder is not None and name == embedder.name:
        if endpoint != "score":
            raise APIError(
                400,
                f"model {name} is an embedding model (kind embedding): it does not serve /v1/{endpoint} "
                "(it serves /v1/embeddings and /v1/score); name a reranker",
                param="model",
                code="wrong_model_kind",
            )
        return Scorer(embedder.name, embedder=embedder)
    if name is None:
        rerankers = [m for m in state.fleet.models.values() if m.stable.kind == "rerank"]
        if rerankers:
            model = rerankers[0]
        elif endpoint == "score" and embedder is not None:
            return Scorer(embedder.name, embedder=embedder)
        else:
            raise bad_request(f"no reranker is served here: /v1/{endpoint} needs one (docs/rerank.md)", param="model")
    else:
        model = state.fleet.resolve(name)
    state.fleet.check_kind(model, "rerank", f"/v1/{endpoint}")
    state.fleet.check_available(model)
    return Scorer(model.name, version=state.fleet.pick(model))


@contextlib.asynccontextmanager
async def _served(request: Request, endpoint: str, scorer: Scorer) -> AsyncIterator[list[int]]:
    """Holds the version (a retiring one drains first) and sends the finished
    record however the request ends; the route appends its token count to the
    list it is given, once known."""
    state = get_state(request)
    version = scorer.version
    tokens: list[int] = []
    status = 500
    if version is not None:
        version.holds += 1
    try:
        yield tokens
        status = 200
    except APIError as exc:
        status = exc.status
        raise
    finally:
        if version is not None:
            version.holds -= 1
        state.hooks.run_finished(
            FinishedRecord(
                request_id="",
                endpoint=endpoint,
                model=scorer.name,
                status=status,
                model_version=version.label if version is not None else None,
                prompt_tokens=sum(tokens),
                started=getattr(request.state, "arrival", None) or time.time(),
                http_request=request,
            )
        )


async def _scores(
    request: Request, endpoint: str, scorer: Scorer, pairs: list[tuple[str, str]], truncate: bool
) -> tuple[list[float], int]:
    """Each pair's score and the tokens read, admitted before any forward pass."""
    state = get_state(request)
    if scorer.version is not None:
        await state.fleet.sleep.wake(scorer.version)  # a sleeping reranker reads its weights again
        pooling = scorer.version.pooling
        assert pooling is not None and pooling.batcher is not None
        batcher = pooling.batcher
        encoded = await offload(_pair_tokens, batcher.model, pairs, truncate, endpoint)
        tokens = sum(len(p.ids) for p in encoded)
        await state.hooks.run_admit(request, AdmissionInfo(endpoint, scorer.name, tokens, 0, 1, False))
        try:
            return await batcher.score(encoded), tokens
        except BatcherClosedError as exc:
            raise unavailable(str(exc)) from None
    assert scorer.embedder is not None
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
    ids = await offload(_text_tokens, scorer.embedder, texts, truncate)
    tokens = sum(map(len, ids))
    await state.hooks.run_admit(request, AdmissionInfo(endpoint, scorer.name, tokens, 0, 1, False))
    rows = dict(zip(texts, await scorer.embedder.embed(ids)))
    # Rows are unit length: their dot product is the cosine.
    return [float(np.dot(rows[a], rows[b])) for a, b in pairs], tokens


def _pair_tokens(model: CrossEncoder, pairs: list[tuple[str, str]], truncate: bool, endpoint: str) -> list[PairTokens]:
    encoded = []
    for i, (first, second) in enumerate(pairs):
        try:
            encoded.append(model.pair(first, second, truncate))
        except PairTooLongError as exc:
            where, param = (f"documents[{i}]", "documents") if endpoint == "rerank" else (f"pair {i}", "text_2")
            raise bad_request(f"{where}: {exc}", param=param, code="context_length_exceeded") from None
    return encoded


def _text_tokens(embedder: EmbeddingBatcher, texts: list[str], truncate: bool) -> list[list[int]]:
    out = []
    limit = embedder.max_tokens
    for text in texts:
        ids = embedder.model.encode_text(text)
        if len(ids) > limit:
            if not truncate:
                raise bad_request(
                    f"a text has {len(ids)} tokens; {embedder.name} reads at most {limit} "
                    "(send truncate: true to cut it to fit)",
                    param="text_2",
                    code="context_length_exceeded",
                )
            ids = [*ids[: limit - 1], embedder.model.sep_id]
        out.append(ids)
    return out


def _usage(tokens: int) -> JSONObject:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request) -> JSONObject:
    """Documents sorted by their relevance to the query (Jina's and Cohere's response shape)."""
    scorer = _scorer(get_state(request), body.model, "rerank")
    documents = body.texts()
    async with _served(request, "rerank", scorer) as counted:
        scores, tokens = await _scores(request, "rerank", scorer, [(body.query, d) for d in documents], body.truncate)
        counted.append(tokens)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep the documents' order
    if body.top_n:
        order = order[: body.top_n]
    results: list[JSONObject] = []
    for i in order:
        result: JSONObject = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": scorer.name, "results": results, "usage": _usage(tokens)}


@router.post("/v1/score")
@router.post("/score")
async def score(body: ScoreRequest, request: Request) -> JSONObject:
    """One score per (text_1, text_2) pair, in the pairs' order (vLLM's response shape)."""
    scorer = _scorer(get_state(request), body.model, "score")
    async with _served(request, "score", scorer) as counted:
        scores, tokens = await _scores(request, "score", scorer, body.pairs(), body.truncate)
        counted.append(tokens)
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": scorer.name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": _usage(tokens),
    }
