"""The OpenAPI schema says what this server accepts for the model it serves.

Bounds that depend on the model are unknown when the request models are
declared: the token-id range, the longest completion, the served model's
name. Fields that carry them are tagged `x-stoker` in the request models;
once the model is loaded the schema is refined with the real limits, so a
body valid against /openapi.json is one the server serves (bar combinations
a schema cannot state, such as a prompt plus max_tokens beyond the context).

Every operation documents the errors it may answer, and every answer that
creates something (a key, a stored response, a model) links to the
operations that read, change or delete it (LINKS), so a stateful client or
fuzzer can follow what a POST made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
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


# The one error body (stoker.errors.APIError), OpenAI's shape.
ERROR_BODY = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
# What a route may answer besides its success. Every route sits behind the
# same authentication, body limit and error handlers, so one list serves all.
# No 422: a body that fails validation is a 400 here, as with OpenAI.
ERRORS = {
    "400": "Malformed JSON, a field of the wrong type or out of range, or values the server refuses together; "
    "the message names the field.",
    "401": "No API key, or one that is unknown, revoked or expired.",
    "403": "The key may not use this route or this model.",
    "404": "No such model, key or route.",
    "405": "The route exists for other methods (see Allow).",
    "413": "The body is larger than the server accepts (--max-body-bytes).",
    "429": "A rate limit, concurrency cap, budget or queue bound was reached; Retry-After says when to retry.",
    "503": "Loading, draining, overloaded, or the store of keys and limits is unreachable; Retry-After says when "
    "to retry.",
    "504": "The request's deadline passed before it could be served.",
}


# Answers only some routes give, by path prefix.
ROUTE_ERRORS = {
    "/admin/models": {
        "409": "The call conflicts with what is loaded: another load in progress, no canary to promote, roll "
        "back or resize, the last model served, or not enough memory."
    },
    "/admin/prefixes": {"409": "The model has no disk tier for its prefix cache (start it with --kv-cache-disk)."},
    "/v1/load_lora_adapter": {"409": "The adapter's base model is loading a new version; retry when it is done."},
}


def document_errors(schema: dict[str, Any]) -> None:
    """Give every operation the error answers above, in place, in place of
    FastAPI's 422 (which this server never sends)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ERROR_BODY
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    reference = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in schema.get("paths", {}).items():
        errors = dict(ERRORS)
        for prefix, extra in ROUTE_ERRORS.items():
            if path == prefix or path.startswith(prefix + "/"):
                errors.update(extra)
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status, description in sorted(errors.items()):
                responses.setdefault(
                    status, {"description": description, "content": {"application/json": {"schema": reference}}}
                )


@dataclass(frozen=True)
class Link:
    """An operation a created thing's answer leads to (an OpenAPI 3 link):
    path parameters and body fields taken from that answer by runtime
    expressions. A stateful fuzzer (schemathesis) follows them, so reading,
    changing and deleting what a POST made is tested, not only the POST."""

    method: str
    path: str
    parameters: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] | None = None


# (method, path, status) of an answer that creates something -> link name -> where it leads.
LINKS: dict[tuple[str, str, str], dict[str, Link]] = {
    ("post", "/admin/keys", "201"): {
        "ShowKey": Link("get", "/admin/keys/{key_id}", {"key_id": "$response.body#/id"}),
        "RevokeKey": Link("delete", "/admin/keys/{key_id}", {"key_id": "$response.body#/id"}),
    },
    ("post", "/v1/responses", "200"): {
        "RetrieveResponse": Link("get", "/v1/responses/{response_id}", {"response_id": "$response.body#/id"}),
        "DeleteResponse": Link("delete", "/v1/responses/{response_id}", {"response_id": "$response.body#/id"}),
        "ContinueResponse": Link("post", "/v1/responses", body={"previous_response_id": "$response.body#/id"}),
    },
    ("post", "/admin/models", "200"): {
        "ListModels": Link("get", "/admin/models"),
        "RetrieveModel": Link("get", "/v1/models/{model_id}", {"model_id": "$response.body#/name"}),
        "PromoteCanary": Link("post", "/admin/models/{name}/promote", {"name": "$response.body#/name"}),
        "RollBackCanary": Link("post", "/admin/models/{name}/rollback", {"name": "$response.body#/name"}),
        "SetCanaryShare": Link("put", "/admin/models/{name}/canary", {"name": "$response.body#/name"}),
        "UnloadModel": Link("delete", "/admin/models/{name}", {"name": "$response.body#/name"}),
    },
    ("post", "/admin/prefixes", "201"): {
        "ListPrefixes": Link("get", "/admin/prefixes"),
        "UnpinPrefix": Link("delete", "/admin/prefixes/{label}", {"label": "$response.body#/label"}),
    },
}


def declare_links(schema: dict[str, Any], links: dict[tuple[str, str, str], dict[str, Link]] = LINKS) -> None:
    """Add the links above to the answers they start from, in place. A link
    whose source or target is not served (a route this server does not
    mount) is left out, so every declared link can be followed."""
    paths = schema.get("paths", {})
    for (method, path, status), targets in links.items():
        answer = paths.get(path, {}).get(method, {}).get("responses", {}).get(status)
        if answer is None:
            continue
        for name, link in targets.items():
            target = paths.get(link.path, {}).get(link.method)
            if target is None or "operationId" not in target:
                continue
            declared: dict[str, Any] = {"operationId": target["operationId"]}
            if link.parameters:
                declared["parameters"] = dict(link.parameters)
            if link.body is not None:
                declared["requestBody"] = dict(link.body)
            answer.setdefault("links", {})[name] = declared


def install(app: FastAPI, state: ServerState) -> None:
    generate: Callable[[], dict[str, Any]] = app.openapi  # FastAPI's: builds once, then cached
    refined_for: list[str] = []

    def openapi() -> dict[str, Any]:
        schema = generate()
        if "ErrorResponse" not in schema.get("components", {}).get("schemas", {}):
            document_errors(schema)
            declare_links(schema)
        names = state.fleet.names() if state.loaded else []
        infos = [m.stable.engine.info for m in state.fleet.models.values()]
        if names and names != refined_for and all(infos):  # again after a model is loaded or unloaded
            vocab = max(i.model_config.vocab_size for i in infos if i)
            context = max(i.max_model_len for i in infos if i)
            refine(schema, vocab, context, names)
            refined_for[:] = names
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
