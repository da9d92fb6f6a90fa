"""vLLM's run-time LoRA endpoints (docs/lora.md), operators only:

    POST /v1/load_lora_adapter    {"lora_name", "lora_path", "base_model_name"?, "digest"?}
    POST /v1/unload_lora_adapter  {"lora_name"}

They answer as vLLM does, in plain text ("Success: LoRA adapter 'sql' added
successfully."); a refusal is a JSON error naming the adapter and the reason
(400 for a bad adapter or name, 403 for a path outside --model-root, 404 for
an unload of an adapter not loaded, 409 while its base loads a new version). An unloaded adapter takes no new request
at once (404); its requests in flight finish before it leaves the engine.
The same actions go through /admin/models (its `base` field) and
`stoker models load NAME PATH --base BASE` / `stoker models unload NAME`.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from stoker.errors import APIError
from stoker.server.fleet import NAME_PATTERN, FleetError
from stoker.server.state import ServerState, get_state


async def _operator(request: Request) -> None:
    """Before the body is validated: a caller without an admin key learns nothing from a 400."""
    await get_state(request).hooks.run_operator(request)


router = APIRouter(tags=["admin"], dependencies=[Depends(_operator)])

LoraName = Field(min_length=1, max_length=128, json_schema_extra={"pattern": NAME_PATTERN.pattern})


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"lora_name": "sql", "lora_path": "/models/sql-lora"}]}
    )

    lora_name: str = LoraName
    """The name requests send in `model`; not a model's or another adapter's."""
    lora_path: str = Field(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")
    """A PEFT folder or a GGUF LoRA file, as the server's machine sees it, under a --model-root."""
    base_model_name: str | None = Field(None, min_length=1, max_length=128)
    """The served model it applies to (default: the first one)."""
    digest: str | None = Field(None, pattern=r"^sha256:[0-9a-fA-F]{64}$")
    """sha256:<hex> of the GGUF file, or of a PEFT folder's adapter_model.safetensors; refused otherwise."""


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"lora_name": "sql"}]})

    lora_name: str = LoraName
    """The adapter to unload."""


def _ready(request: Request) -> ServerState:
    state = get_state(request)
    if state.draining:
        raise APIError(503, "the server is shutting down", type="service_unavailable", code="draining")
    if not state.loaded:
        raise APIError(503, "the server is still loading its models", type="service_unavailable", retry_after=1)
    return state


def refused(exc: FleetError) -> APIError:
    return APIError(exc.status, str(exc), code=exc.code, param=exc.param)


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapter, request: Request) -> PlainTextResponse:
    """Register an adapter with its base's engines; it serves once this answers."""
    adapters = _ready(request).fleet.adapters
    try:
        spec = await adapters.admit(body.lora_name, body.lora_path, body.digest, body.base_model_name)
        await adapters.add(spec)
    except FleetError as exc:
        raise refused(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapter, request: Request) -> PlainTextResponse:
    """Stop routing to an adapter now; it leaves the engine once its requests in flight finish."""
    _ready(request).fleet.adapters.remove(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
