"""Admin HTTP API for keys: /admin/keys (admin keys only).

POST   /admin/keys          create; the response holds the secret, shown once
GET    /admin/keys          list (never secrets or hashes)
GET    /admin/keys/{id}     one key with its usage this period and in total
PATCH  /admin/keys/{id}     change its limits, budget, allow-list, expiry or name (not its scopes)
DELETE /admin/keys/{id}     revoke (effective at once in this server)
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from stoker.control.auth import get_plane, require_admin
from stoker.control.keys import ApiKey
from stoker.control.plane import ControlPlane
from stoker.errors import APIError
from stoker.json_types import Boolean, Integer, Number

router = APIRouter(prefix="/admin", tags=["admin"])
AdminKey = Annotated[ApiKey, Depends(require_admin)]
MAX_LIMIT = 2**53


class CreateKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    # Bounded so every value fits the database's 64-bit integers.
    rpm: Integer | None = Field(None, ge=1, le=MAX_LIMIT)
    tpm: Integer | None = Field(None, ge=1, le=MAX_LIMIT)
    max_concurrent: Integer | None = Field(None, ge=1, le=MAX_LIMIT)
    budget_tokens: Integer | None = Field(None, ge=1, le=MAX_LIMIT)
    budget_period: Literal["day", "month"] = "month"
    priority: Literal["interactive", "batch"] = "interactive"
    # At least one (create_key's own check says so); in the schema, not enforced
    # by pydantic, so the refusal keeps its message.
    models: list[Annotated[str, Field(min_length=1)]] | None = Field(None, json_schema_extra={"minItems": 1})
    expires_at: Number | None = Field(
        None, gt=0, le=1e11, allow_inf_nan=False, description="Unix time (seconds) after which the key stops working."
    )
    admin: Boolean = False
    scopes: list[Literal["inference", "router", "metrics", "admin"]] | None = Field(
        None,
        max_length=4,
        description="What the key may call: inference (default), router (/get_load, /server_info, /model_info, "
        "/flush_cache), metrics (/metrics), admin (everything; the same as admin: true).",
    )


class EditKey(BaseModel):
    """The fields to change, with POST's bounds; a field left out stays as it is, null removes it."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=200)
    rpm: Integer | None = Field(None, ge=1, le=MAX_LIMIT)
    tpm: Integer | None = Field(None, ge=1, le=MAX_LIMIT)
    max_concurrent: Integer | None = Field(None, ge=1, le=MAX_LIMIT)
    budget_tokens: Integer | None = Field(None, ge=1, le=MAX_LIMIT)
    budget_period: Literal["day", "month"] | None = None
    priority: Literal["interactive", "batch"] | None = None
    models: list[Annotated[str, Field(min_length=1)]] | None = Field(None, json_schema_extra={"minItems": 1})
    expires_at: Number | None = Field(
        None, gt=0, le=1e11, allow_inf_nan=False, description="Unix time (seconds) after which the key stops working."
    )


async def _existing_key(plane: ControlPlane, key_id: str) -> ApiKey:
    """The key with this id, or a 404 naming it."""
    key = await run_in_threadpool(plane.keys.get, key_id)
    if key is None:
        raise APIError(404, f"No API key with id '{key_id}'.", "invalid_request_error", code="key_not_found")
    return key


@router.post("/keys", status_code=201)
async def create_key(body: CreateKey, request: Request, _admin: AdminKey) -> dict[str, Any]:
    plane = get_plane(request)
    if body.expires_at is not None and body.expires_at <= time.time():
        raise APIError(
            400, "expires_at is in the past.", "invalid_request_error", code="invalid_value", param="expires_at"
        )
    try:
        key, secret = await run_in_threadpool(lambda: plane.keys.create(**body.model_dump()))
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_request_error", code="invalid_value") from None
    return {**key.public(), "secret": secret}


@router.get("/keys")
async def list_keys(request: Request, _admin: AdminKey) -> dict[str, Any]:
    keys = await run_in_threadpool(get_plane(request).keys.list_keys)
    return {"object": "list", "data": [k.public() for k in keys]}


@router.get("/keys/{key_id}")
async def show_key(key_id: str, request: Request, _admin: AdminKey) -> dict[str, Any]:
    plane = get_plane(request)
    key = await _existing_key(plane, key_id)
    usage = await run_in_threadpool(plane.ledger.key_report, key.id, key.budget_period, key.budget_tokens)
    return {**key.public(), "usage": usage}


@router.patch("/keys/{key_id}")
async def edit_key(key_id: str, body: EditKey, request: Request, _admin: AdminKey) -> dict[str, Any]:
    plane = get_plane(request)
    await _existing_key(plane, key_id)
    changes = body.model_dump(include=body.model_fields_set)
    for required in ("name", "budget_period", "priority"):
        if required in changes and changes[required] is None:
            raise APIError(
                400, f"{required} cannot be null.", "invalid_request_error", code="invalid_value", param=required
            )
    if changes.get("expires_at") is not None and changes["expires_at"] <= time.time():
        raise APIError(
            400, "expires_at is in the past.", "invalid_request_error", code="invalid_value", param="expires_at"
        )
    try:
        key = await run_in_threadpool(plane.keys.update, key_id, changes)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_request_error", code="invalid_value") from None
    assert key is not None  # found above, and keys are revoked, never deleted
    return key.public()


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, request: Request, _admin: AdminKey) -> dict[str, Any]:
    plane = get_plane(request)
    await _existing_key(plane, key_id)
    revoked = await run_in_threadpool(plane.keys.revoke, key_id)
    return {"id": key_id, "revoked": True, "already_revoked": not revoked}
