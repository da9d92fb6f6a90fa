"""/v1/models (and one by id), /tokenize and /detokenize."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Depends, Request

from stoker.errors import APIError
from stoker.server.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
    bad_request,
)
from stoker.server.routes.openai import template_ids
from stoker.server.state import get_state, run_before_hooks

router = APIRouter(dependencies=[Depends(run_before_hooks)])


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """OpenAI's model list, plus vLLM's root/max_model_len and the version in use:
    its digest (the pin operators compare) and, during a canary, the canary's."""
    state = get_state(request)
    data = []
    for model in state.fleet.models.values() if state.loaded else []:
        stable = model.stable
        entry: dict[str, Any] = {
            "id": model.name,
            "object": "model",
            "created": int(stable.ready_at or state.started),
            "owned_by": "stoker",
            "root": os.path.abspath(stable.spec.path),
            "max_model_len": stable.engine.info.max_model_len if stable.engine.info else None,
            "version": stable.label,
            "digest": stable.digest,
        }
        if model.canary is not None:
            entry["canary"] = {
                "version": model.canary.label,
                "digest": model.canary.digest,
                "percent": model.canary_percent,
            }
        data.append(entry)
    if state.embedder is not None:
        data.append(
            {
                "id": state.embedder.name,
                "object": "model",
                "created": int(state.started),
                "owned_by": "stoker",
                "max_model_len": state.embedder.max_tokens,
            }
        )
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    """OpenAI's model retrieval (the SDK's models.retrieve): the list's entry for one id."""
    listed = await list_models(request)
    for entry in listed["data"]:
        if entry["id"] == model_id:
            return dict(entry)
    served = ", ".join(entry["id"] for entry in listed["data"]) or "none yet"
    raise APIError(
        404,
        f"The model `{model_id}` does not exist. Models served here: {served}.",
        param="model",
        code="model_not_found",
    )


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    version = get_state(request).version_for(body.model)
    tokenizer = version.tokenizer
    if isinstance(body, TokenizeChatRequest):
        tokens = template_ids(tokenizer, [m.model_dump(exclude_none=True) for m in body.messages], body)
    else:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": version.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    version = get_state(request).version_for(body.model)
    vocab = version.vocab_size or 0
    if any(t >= vocab for t in body.tokens):
        raise bad_request(f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": version.tokenizer.decode(body.tokens)}
