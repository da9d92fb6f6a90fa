"""/v1/models (and one by id), /tokenize and /detokenize."""

from __future__ import annotations

import os

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from stoker.errors import APIError
from stoker.models.tokenizer import Tokenizer
from stoker.server.bounds import offload
from stoker.server.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
    bad_request,
)
from stoker.server.serving import JSONObject
from stoker.server.serving.prompt import template_ids
from stoker.server.state import admitted, get_state, run_before_hooks
from stoker.server.strict_json import StrictJSONResponse, dumps

router = APIRouter(dependencies=[Depends(run_before_hooks)])


@router.get("/v1/models")
async def list_models(request: Request) -> JSONObject:
    """OpenAI's model list, plus vLLM's root/max_model_len and the version in use:
    its digest (the pin operators compare) and, during a canary, the canary's.
    Each LoRA adapter follows its base, with vLLM's `parent` naming the base."""
    state = get_state(request)
    # vLLM's root is the model's path: only an admin key sees it, any other caller the served name.
    admin = bool(getattr(getattr(request.state, "api_key", None), "is_admin", False))
    data = []
    for model in state.fleet.models.values() if state.loaded else []:
        stable = model.stable
        entry: JSONObject = {
            "id": model.name,
            "object": "model",
            "created": int(stable.ready_at or state.started),
            "owned_by": "stoker",
            "root": os.path.abspath(stable.spec.path) if admin else model.name,
            "max_model_len": stable.engine.info.max_model_len if stable.engine.info else None,
            "version": stable.label,
            "digest": stable.digest,
            # What it serves ("generate": chat and completions; "rerank"), so a client can offer the right models.
            "kind": stable.kind,
            "sleeping": stable.sleep.asleep,  # its engine sleeps; the next request wakes it (docs/sleep.md)
        }
        if model.canary is not None:
            entry["canary"] = {
                "version": model.canary.label,
                "digest": model.canary.digest,
                "percent": model.canary_percent,
            }
        data.append(entry)
        for adapter in state.fleet.adapters.of_base(model.name):
            if adapter.status == "serving":  # vLLM lists an adapter with its base as parent and its path as root
                data.append(
                    {
                        "id": adapter.name,
                        "object": "model",
                        "created": int(adapter.created),
                        "owned_by": entry["owned_by"],
                        "root": os.path.abspath(adapter.spec.path) if admin else adapter.name,
                        "parent": model.name,
                        "max_model_len": entry["max_model_len"],
                        "digest": adapter.digest,
                    }
                )
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
async def retrieve_model(model_id: str, request: Request) -> JSONObject:
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


# Ids rendered as JSON per slice: json.dumps holds the GIL for the whole list,
# which for a multi-megabyte prompt would stall the event loop from this thread.
RENDER_SLICE = 16_384


def _tokenized(body: TokenizeRequest, tokenizer: Tokenizer, max_model_len: int) -> Response:
    if isinstance(body, TokenizeChatRequest):
        tokens = template_ids(tokenizer, [m.model_dump(exclude_none=True) for m in body.messages], body)
    else:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    ids = ",".join(dumps(tokens[i : i + RENDER_SLICE])[1:-1] for i in range(0, len(tokens), RENDER_SLICE))
    content = f'{{"tokens":[{ids}],"count":{len(tokens)},"max_model_len":{int(max_model_len)}}}'
    return Response(content, media_type="application/json")


# The response classes are given for /openapi.json: the answers are built off the event loop, as responses.
@router.post("/tokenize", response_class=StrictJSONResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    version = get_state(request).version_for(body.model)
    async with admitted(request, "tokenize", version.name):
        return await offload(_tokenized, body, version.tokenizer, version.max_model_len)


def _detokenized(tokens: list[int], tokenizer: Tokenizer, vocab: int) -> JSONObject:
    if any(t >= vocab for t in tokens):
        raise bad_request(f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": tokenizer.decode(tokens)}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONObject:
    version = get_state(request).version_for(body.model)
    async with admitted(request, "detokenize", version.name):
        return await offload(_detokenized, body.tokens, version.tokenizer, version.vocab_size or 0)
