"""The OpenAPI schema says what this server accepts for the model it serves.

Bounds that depend on the model are unknown when the request models are
declared: the token-id range, the longest completion, the served model's
name. Fields that carry them are tagged `x-stoker` in the request models;
once the model is loaded the schema is refined with the real limits, so a
body valid against /openapi.json is one the server serves (bar combinations
a schema cannot state, such as a prompt plus max_tokens beyond the context).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from stoker.server.state import ServerState

TAG = "x-stoker"


def refine(schema: Any, vocab_size: int, max_model_len: int, model_name: str) -> None:
    """Fill in the model's limits wherever a field is tagged, in place."""
    if isinstance(schema, list):
        for item in schema:
            refine(item, vocab_size, max_model_len, model_name)
        return
    if not isinstance(schema, dict):
        return
    tag = schema.get(TAG)
    if tag == "token_id":
        schema["maximum"] = vocab_size - 1
    elif tag == "max_tokens":
        schema["maximum"] = max(1, max_model_len - 1)
    elif tag == "model":
        schema["enum"] = [model_name]
    for value in schema.values():
        refine(value, vocab_size, max_model_len, model_name)


def install(app: FastAPI, state: ServerState) -> None:
    generate: Callable[[], dict[str, Any]] = app.openapi  # FastAPI's: builds once, then cached
    refined = False

    def openapi() -> dict[str, Any]:
        nonlocal refined
        schema = generate()
        info = state.engine.info
        if not refined and state.loaded and info is not None and state.served_model_name:
            refine(schema, info.model_config.vocab_size, state.engine.max_model_len, state.served_model_name)
            refined = True
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
