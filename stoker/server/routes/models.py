"""/admin/models: load, swap, canary and unload models on a running server.

    GET    /admin/models                       models, versions, state, memory
    POST   /admin/models                       {"name", "path", "digest"?, "canary_percent"?}
                                               with "base": a LoRA adapter of that model (docs/lora.md)
    POST   /admin/models/{name}/promote        the canary becomes the stable version
    POST   /admin/models/{name}/sleep, /wake   end its engine process until needed, start it again (routes/sleep.py)
    POST   /admin/models/{name}/rollback       the canary is dropped
    PUT    /admin/models/{name}/canary         {"percent"}: change the canary's share
    DELETE /admin/models/{name}                drain and unload (a model, or an adapter)

Each takes an operator (an admin key once keys exist, as /admin/keys). A
call that fails changes nothing that serves; the load itself runs as long
as the engine takes to start (seconds for small models), and the call
answers when the new version serves.

A path loads only from under a --model-root (by default the folders of the
models given at start), symlinks resolved, and only a regular file or a
folder; outside the roots the refusal (403) reads the same whether the path
exists or not. docs/models.md has the bounds.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.convertors import Convertor, register_url_convertor

from stoker.errors import APIError
from stoker.json_types import Number
from stoker.server.fleet import NAME_PATTERN, FleetError
from stoker.server.state import ServerState, operator_state

router = APIRouter(prefix="/admin/models", tags=["admin"])


class ModelNameConvertor(Convertor[str]):
    """{name:model_name}: a model name may hold "/" (org/model, as
    /v1/models/{model_id} takes it), but never ends in one of the actions
    below, so DELETE /admin/models/x/promote is a 405 naming POST, not an
    unload of a model "x/promote"."""

    regex = r".+?(?<!/promote)(?<!/rollback)(?<!/canary)(?<!/sleep)(?<!/wake)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("model_name", ModelNameConvertor())


class LoadModel(BaseModel):
    # The name's pattern is stated in the schema and checked by the fleet (the
    # one check for --model, MODEL and this API), so its refusal keeps the
    # fleet's message; the digest's form is checked here.
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"name": "smollm2", "path": "/models/smollm2.gguf"}]}
    )

    name: str = Field(min_length=1, max_length=128, json_schema_extra={"pattern": NAME_PATTERN.pattern})
    """The name clients send; an existing name gets a new version (a swap, or a canary)."""
    path: str = Field(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")  # no file name holds NUL
    """GGUF file or Hugging Face folder, as the server's machine sees it, under a --model-root."""
    digest: str | None = Field(None, pattern=r"^sha256:[0-9a-fA-F]{64}$")
    """sha256:<hex> the files must have; the load is refused otherwise."""
    canary_percent: Number | None = Field(None, ge=0, le=100)
    """Load beside the stable version and give it this share of new requests."""
    base: str | None = Field(None, min_length=1, max_length=128)
    """Load path as a LoRA adapter of this served model, under name (docs/lora.md); no canary then."""


class CanaryShare(BaseModel):
    model_config = ConfigDict(extra="forbid")

    percent: Number = Field(ge=0, le=100)


def _listing(state: ServerState) -> dict[str, Any]:
    return {
        "object": "list",
        "data": state.fleet.describe(),
        "retiring": [v.describe() | {"name": v.name} for v in state.fleet.retiring],
        "max_model_memory": state.fleet.max_memory,
    }


def _bad(exc: FleetError) -> APIError:
    return APIError(exc.status, str(exc), code=exc.code, param=exc.param)


@router.get("")
async def list_models(request: Request) -> dict[str, Any]:
    return _listing(await operator_state(request))


@router.post("")
async def load_model(body: LoadModel, request: Request) -> dict[str, Any]:
    state = await operator_state(request)
    try:
        if body.base is not None:
            if body.canary_percent is not None:
                raise FleetError(f"adapter {body.name}: an adapter has no canary", param="canary_percent")
            adapters = state.fleet.adapters
            adapter = await adapters.add(await adapters.admit(body.name, body.path, body.digest, body.base))
            return adapter.describe(0)
        spec = await state.fleet.admit(body.name, body.path, body.digest)
        version = await state.fleet.load(spec, body.canary_percent)
    except FleetError as exc:
        raise _bad(exc) from None
    return {"name": version.name, **version.describe()}


async def _end_canary(name: str, action: Literal["promote", "rollback"], request: Request) -> dict[str, Any]:
    state = await operator_state(request)
    try:
        version = state.fleet.promote(name) if action == "promote" else state.fleet.rollback(name)
    except FleetError as exc:
        raise _bad(exc) from None
    return {"name": name, **version.describe()}


# Two routes, not one POST /{name}/{action}: that one also caught POST
# /{name}/canary (a 400 for the action) where the path serves PUT only (a 405).
@router.post("/{name:model_name}/promote")
async def promote(name: str, request: Request) -> dict[str, Any]:
    """The canary becomes the stable version."""
    return await _end_canary(name, "promote", request)


@router.post("/{name:model_name}/rollback")
async def rollback(name: str, request: Request) -> dict[str, Any]:
    """The canary is dropped."""
    return await _end_canary(name, "rollback", request)


@router.put("/{name:model_name}/canary")
async def canary_share(name: str, body: CanaryShare, request: Request) -> dict[str, Any]:
    state = await operator_state(request)
    try:
        state.fleet.set_canary_percent(name, body.percent)
    except FleetError as exc:
        raise _bad(exc) from None
    return _listing(state)


@router.delete("/{name:model_name}")
async def unload(name: str, request: Request) -> dict[str, Any]:
    state = await operator_state(request)
    if name not in state.fleet.models and name in state.fleet.adapters.adapters:
        adapter = state.fleet.adapters.remove(name)
        return {"name": name, "base": adapter.base, "unloaded": "adapter", "draining": True}
    try:
        versions = state.fleet.unload(name)
    except FleetError as exc:
        raise _bad(exc) from None
    return {"name": name, "unloaded": [v.label for v in versions], "draining": True}
