"""/admin/prefixes: pinned prefixes, kept in the prefix cache's disk tier and never
evicted (docs/prefix-cache.md).

    POST   /admin/prefixes           {"label", "model"?, one of "prompt" | "messages" | "token_ids"}
    GET    /admin/prefixes?model=    the model's pins, with how many of their blocks are on disk
    DELETE /admin/prefixes/{label}?model=

A pin is computed once by the model's engine (a prompt-only request, queued as
any other) and its full KV blocks are kept on disk under the label, across
restarts, for every replica sharing the folder. The call answers when the
prefix is computed; its blocks reach the disk a moment later (blocks_on_disk
in the listing). Operators only: an admin key, refused in open mode, as
/admin/models. A model served without --kv-cache-disk answers 409.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stoker.engine.client import EngineUnavailableError
from stoker.engine.kv_disk import PinnedPrefix
from stoker.engine.pins import LABEL_RULE, PIN_LABEL_PATTERN, PrefixAnswer
from stoker.errors import APIError
from stoker.json_types import Boolean
from stoker.server.bounds import MAX_TEMPLATE_KWARGS, offload
from stoker.server.fleet import ModelVersion
from stoker.server.protocol import ChatMessage, ChatTemplateFields, ModelName, TokenIds, bad_request, unavailable
from stoker.server.serving.prompt import template_ids
from stoker.server.state import ServerState, get_state


async def _operator(request: Request) -> None:
    """Before the body is validated: a caller without an admin key learns nothing from a 400."""
    await get_state(request).hooks.run_operator(request)


router = APIRouter(prefix="/admin/prefixes", tags=["admin"], dependencies=[Depends(_operator)])

PIN_TIMEOUT_S = 900.0
"""Longest a pin call waits for its prefix to be computed (a long prefix on a big model takes minutes on a CPU)."""
MAX_PROMPT_CHARS = 4_000_000
"""A prompt's characters; the context bounds its tokens (400 beyond it)."""

Label = Annotated[str, Field(pattern=PIN_LABEL_PATTERN, description=LABEL_RULE)]


class PinPrefix(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"label": "support-bot", "messages": [{"role": "system", "content": "..."}]}]},
    )

    label: Label
    """The pin's name: a second pin of the same label replaces the first."""
    model: ModelName | None = None
    """The served model (default: the first one)."""
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = None
    """Text, tokenized as /v1/completions tokenizes a prompt (with the model's BOS)."""
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=2048)] | None = None
    """Chat messages, rendered with the model's chat template as /v1/chat/completions renders them."""
    token_ids: TokenIds | None = None
    """The prefix's token ids, as they are."""
    add_generation_prompt: Boolean = False
    """messages only: end with the opening of an assistant turn (pin a whole prompt rather than a prefix)."""
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None
    """messages only: extra variables for the chat template."""

    @model_validator(mode="after")
    def _one_prefix(self) -> PinPrefix:
        given = [name for name in ("prompt", "messages", "token_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, messages or token_ids (got {', '.join(given) or 'none'})")
        return self


def _describe(pin: PinnedPrefix, version: ModelVersion) -> dict[str, Any]:
    return {
        "object": "prefix",
        "label": pin.label,
        "model": version.name,
        "version": version.label,
        "num_tokens": pin.num_tokens,
        "num_blocks": pin.num_blocks,
        "blocks_on_disk": pin.blocks_on_disk,
        "created": int(pin.created),
    }


async def _versions(request: Request, model: str | None) -> list[ModelVersion]:
    """The model's ready versions (stable, and a canary: each keeps its own blocks), for an operator."""
    state: ServerState = get_state(request)
    served = state.resolve(model)
    if served.lora_name is not None:  # its blocks hash apart from its base's, and a pin is computed without it
        raise bad_request(f"`{served.name}` is a LoRA adapter: pin prefixes of its base model", param="model")
    versions = [v for v in (served.stable, served.canary) if v is not None and v.ready]
    if not versions:
        state.fleet.check_available(served)
    for version in versions:
        if version.config.kv_cache_disk is None:
            raise APIError(
                409,
                f"The model `{served.name}` has no disk tier for its prefix cache: pinning needs the server "
                "started with --kv-cache-disk DIR.",
                code="no_disk_tier",
            )
    for version in versions:
        await state.fleet.sleep.wake(version)  # pins live in the engine: a sleeping one wakes
    return versions


def _prefix_ids(body: PinPrefix, version: ModelVersion) -> list[int]:
    tokenizer = version.tokenizer
    if body.token_ids is not None:
        ids = list(body.token_ids)
        vocab = version.vocab_size or 0
        if any(t >= vocab for t in ids):
            raise bad_request(f"token ids must be in [0, {vocab})", param="token_ids")
    elif body.prompt is not None:
        ids = tokenizer.encode(body.prompt)
    else:
        assert body.messages is not None
        fields = ChatTemplateFields(
            messages=body.messages,
            add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        ids = template_ids(tokenizer, [m.model_dump(exclude_none=True) for m in body.messages], fields)
    # The pin runs as a prompt that generates one token: it must leave that room.
    if len(ids) >= version.max_model_len:
        raise bad_request(
            f"the prefix is {len(ids)} tokens; this model's context is {version.max_model_len}, "
            f"so a pin may be at most {version.max_model_len - 1}",
            param="prompt" if body.prompt is not None else "messages" if body.messages is not None else "token_ids",
            code="context_length_exceeded",
        )
    return ids


async def _ask(
    version: ModelVersion,
    action: Literal["pin", "unpin", "list"],
    label: str = "",
    token_ids: list[int] | None = None,
    timeout: float = 10.0,
) -> PrefixAnswer:
    try:
        answer = await version.engine.prefixes(action, label, token_ids, timeout)
    except EngineUnavailableError as exc:
        raise unavailable(str(exc)) from None
    if answer.error is not None:
        # What the engine refuses is the prefix itself (too long for the KV cache, shorter than a block).
        raise bad_request(answer.error, code="invalid_prefix")
    return answer


@router.post("", status_code=201)
async def pin_prefix(body: PinPrefix, request: Request) -> dict[str, Any]:
    """Compute the prefix once and keep its KV blocks on disk under the label (on the
    stable version, and on a canary too); the answer describes the stable version's pin."""
    pinned: list[dict[str, Any]] = []
    for version in await _versions(request, body.model):
        ids = await offload(_prefix_ids, body, version)
        answer = await _ask(version, "pin", body.label, ids, timeout=PIN_TIMEOUT_S)
        pinned.extend(_describe(pin, version) for pin in answer.pins)
    return pinned[0] | {"versions": [pin["version"] for pin in pinned]}


@router.get("")
async def list_prefixes(request: Request, model: Annotated[ModelName | None, Query()] = None) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for version in await _versions(request, model):
        answer = await _ask(version, "list")
        data.extend(_describe(pin, version) for pin in answer.pins)
    return {"object": "list", "data": data}


@router.delete("/{label}")
async def unpin_prefix(
    label: str, request: Request, model: Annotated[ModelName | None, Query()] = None
) -> dict[str, Any]:
    """Unpin: the blocks stay on disk as ordinary cache entries, evicted by the LRU as any other."""
    versions = await _versions(request, model)
    removed = False
    for version in versions:
        removed = (await _ask(version, "unpin", label)).removed or removed
    if not removed:
        raise APIError(
            404,
            f"No prefix is pinned as `{label}` for the model `{versions[0].name}`.",
            code="prefix_not_found",
            param="label",
        )
    return {"object": "prefix", "label": label, "model": versions[0].name, "deleted": True}
