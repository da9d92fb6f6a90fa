"""/v1/models, /tokenize and /detokenize."""

from __future__ import annotations

from typing import Any

import jinja2
from fastapi import APIRouter, Depends, Request

from stoker.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest, bad_request
from stoker.server.state import get_state, run_before_hooks

router = APIRouter(dependencies=[Depends(run_before_hooks)])


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = get_state(request)
    data = []
    if state.served_model_name is not None and state.engine.info is not None:
        data.append(
            {
                "id": state.served_model_name,
                "object": "model",
                "created": int(state.started),
                "owned_by": "stoker",
                "max_model_len": state.engine.max_model_len,
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


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = get_state(request)
    state.check_model(body.model)
    tokenizer = state.engine.tokenizer
    if isinstance(body, TokenizeChatRequest):
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            tokens = tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, tokenize=True
            )
        except (ValueError, jinja2.TemplateError) as exc:
            raise bad_request(str(exc), param="messages") from None
    else:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = get_state(request)
    state.check_model(body.model)
    vocab = state.engine.info.model_config.vocab_size if state.engine.info else 0
    if any(t >= vocab for t in body.tokens):
        raise bad_request(f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": state.engine.tokenizer.decode(body.tokens)}
