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


def refine(schema: Any, vocab_size: int, max_model_len: int, model_names: list[str]) -> None:
    """Fill in the models' limits wherever a field is tagged, in place (with
    several models: the widest of their limits)."""
    if isinstance(schema, list):
        for item in schema:
            refine(item, vocab_size, max_model_len, model_names)
        return
    if not isinstance(schema, dict):
        return
    tag = schema.get(TAG)
    if tag == "token_id":
        schema["maximum"] = vocab_size - 1
    elif tag == "max_tokens":
        schema["maximum"] = max(1, max_model_len - 1)
    elif tag == "model":
        schema["enum"] = list(model_names)
    for value in schema.values():
        refine(value, vocab_size, max_model_len, model_names)


def install(app: FastAPI, state: ServerState) -> None:
    generate: Callable[[], dict[str, Any]] = app.openapi  # FastAPI's: builds once, then cached
    refined_for: list[str] = []

    def openapi() -> dict[str, Any]:
        schema = generate()
        names = state.fleet.names() if state.loaded else []
        infos = [m.stable.engine.info for m in state.fleet.models.values()]
        if names and names != refined_for and all(infos):  # again after a model is loaded or unloaded
            vocab = max(i.model_config.vocab_size for i in infos if i)
            context = max(i.max_model_len for i in infos if i)
            refine(schema, vocab, context, names)
            refined_for[:] = names
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
