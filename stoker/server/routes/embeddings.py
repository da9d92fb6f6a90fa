"""/v1/embeddings: the embedding model runs in the front-end process (it is
small, and its micro-batcher runs forwards in a worker thread), so the chat
engine's step loop never waits for it."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request

from stoker.errors import APIError
from stoker.server.bounds import offload
from stoker.server.hooks import AdmissionInfo, FinishedRecord
from stoker.server.protocol import (
    EmbeddingRequest,
    bad_request,
    flatten_prompts,
    unavailable,
)
from stoker.server.state import get_state, run_before_hooks

if TYPE_CHECKING:
    from stoker.models.embedding import EmbeddingBatcher

router = APIRouter(dependencies=[Depends(run_before_hooks)])


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    state = get_state(request)
    embedder = state.embedder
    if state.draining:
        raise unavailable("the server is shutting down")
    if embedder is None:
        if not state.loaded:
            raise unavailable("the model is still loading")
        raise APIError(
            404, state.embeddings_disabled or "no embedding model is served", param="model", code="model_not_found"
        )
    if body.model is not None and body.model != embedder.name:
        raise APIError(
            404,
            f"The model `{body.model}` does not exist or is not an embedding model.",
            param="model",
            code="model_not_found",
        )
    inputs = await offload(_encoded, body, embedder)
    tokens = sum(map(len, inputs))
    await state.hooks.run_admit(request, AdmissionInfo("embedding", embedder.name, tokens, 0, 1, False))
    rows = await embedder.embed(inputs)
    data = []
    for i, row in enumerate(rows):
        vector: Any = row.tolist()
        if body.encoding_format == "base64":  # little-endian float32, as OpenAI encodes it
            vector = base64.b64encode(row.astype("<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    state.hooks.run_finished(
        FinishedRecord(
            request_id="",
            endpoint="embedding",
            model=embedder.name,
            status=200,
            prompt_tokens=tokens,
            http_request=request,
        )
    )
    return {
        "object": "list",
        "data": data,
        "model": embedder.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _encoded(body: EmbeddingRequest, embedder: EmbeddingBatcher) -> list[list[int]]:
    """Each input as the embedding model's token ids (off the event loop: inputs are up to 2048 texts)."""
    model = embedder.model
    inputs: list[list[int]] = []
    for i, item in enumerate(flatten_prompts(body.input)):
        if isinstance(item, str):
            # Lone surrogates raise UnicodeEncodeError here (the app's 400); the tokenizer would raise TypeError.
            item.encode("utf-8")
            ids = model.encode_text(item)
        else:
            if any(t >= model.config.vocab_size for t in item):
                raise bad_request(f"input[{i}]: token ids must be in [0, {model.config.vocab_size})", param="input")
            ids = model.wrap_ids(list(item))
        if len(ids) > embedder.max_tokens:
            raise bad_request(
                f"input[{i}] has {len(ids)} tokens; {embedder.name} accepts at most {embedder.max_tokens}",
                param="input",
                code="context_length_exceeded",
            )
        inputs.append(ids)
    return inputs
