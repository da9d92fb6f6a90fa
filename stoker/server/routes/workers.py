"""What a router in front of several replicas (sglang-router, vllm-router)
asks of each one besides the OpenAI routes and /health: its load, its model,
its settings, and a prefix-cache flush. The names and shapes are SGLang's,
which both routers speak; docs/routers.md says which router reads what.

GET  /get_load                       tokens held or queued, in the shape --get-load-format names
GET  /model_info, /get_model_info    model_path, tokenizer_path, served_model_name, ...
GET  /server_info, /get_server_info  the same identity plus the engine's settings
POST /flush_cache                    drop the prefix cache's unused blocks (an operator action)

Who may call them is the control plane's business (stoker.control.server:
the router scope once keys exist; /flush_cache never in open mode). Absolute
paths are shown only to an admin key, and in open mode (sglang-router loads
its tokenizer from model_path); any other key sees the served model's name.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fastapi import APIRouter, Request

import stoker
from stoker.engine.client import EngineUnavailableError
from stoker.engine.params import EngineStats
from stoker.models.identity import model_name, tokenizer_folder
from stoker.server.protocol import unavailable
from stoker.server.state import ServerState, get_state

router = APIRouter(tags=["router"])


def load_tokens(stats: EngineStats) -> int:
    """The engine's load in tokens, as SGLang counts it: KV cache in use by
    running requests plus the prompt tokens still waiting to be computed."""
    return stats.kv_blocks_used * stats.block_size + stats.num_waiting_tokens


@router.get("/get_load")
async def get_load(request: Request) -> Any:
    """Polled by power-of-two routing (sglang-router every 30 s, vllm-router every 5 s)."""
    state = get_state(request)
    every = [e.stats() for e in state.engines()]
    tokens = sum(load_tokens(s) for s in every)
    if state.config.get_load_format == "vllm":
        return {"load": tokens}
    return [
        {
            "dp_rank": 0,
            "num_reqs": sum(s.num_running + s.num_waiting for s in every),
            "num_waiting_reqs": sum(s.num_waiting for s in every),
            "num_tokens": tokens,
        }
    ]


def shows_paths(request: Request) -> bool:
    """Whether this caller may see the server's absolute paths: an admin key, or
    no key at all (open mode, or no control plane)."""
    key = getattr(request.state, "api_key", None)
    return key is None or bool(getattr(key, "is_admin", False))


def _without_paths(value: Any) -> Any:
    """The value with every absolute path in it replaced by None."""
    if isinstance(value, dict):
        return {k: _without_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_paths(v) for v in value]
    if isinstance(value, str) and (os.path.isabs(value) or value.startswith("~")):
        return None
    return value


async def _identity(state: ServerState, paths: bool = True) -> dict[str, Any]:
    """Who this replica is. sglang-router labels the worker with these fields
    when it registers it: served_model_name becomes the model it routes by, and
    it loads its own tokenizer from model_path (a local path it can read never
    sends it to a hub). It registers a worker as soon as /health answers, and
    keeps the labels it got then, so they are answered while the model still
    loads too (all known from the path); /ready keeps the replica out of
    rotation until then."""
    config = state.engine.config
    try:
        model_path = os.path.abspath(config.resolved_model_path())
        tokenizer_path: str | None = await asyncio.to_thread(tokenizer_folder, model_path)
        name = config.served_model_name or await asyncio.to_thread(model_name, model_path)
    except OSError as exc:  # no such model: startup fails (or failed) with the same error
        raise unavailable(f"the model cannot be loaded: {exc}") from None
    info = state.engine.info
    served = state.served_model_name or name
    if not paths:
        # The name stands in for the path: a router reading model_path gets something it may look up.
        model_path, tokenizer_path = served or "", None
    return {
        "model_path": model_path,
        "tokenizer_path": tokenizer_path,
        "served_model_name": served,
        "is_generation": True,
        "architectures": [info.model_config.architecture] if info else None,
        "max_model_len": info.max_model_len if info else None,
        "has_image_understanding": False,
        "loaded": state.loaded,
    }


@router.get("/model_info")
@router.get("/get_model_info", include_in_schema=False)
async def model_info(request: Request) -> dict[str, Any]:
    return await _identity(get_state(request), shows_paths(request))


@router.get("/server_info")
@router.get("/get_server_info", include_in_schema=False)
async def server_info(request: Request) -> dict[str, Any]:
    state = get_state(request)
    paths = shows_paths(request)
    body = await _identity(state, paths)
    engine = state.engine.config
    info = state.engine.info
    body.update(
        version=stoker.__version__,
        max_total_num_tokens=info.kv_capacity_tokens if info else None,
        max_running_requests=engine.max_num_seqs,
        page_size=engine.block_size,
        get_load_format=state.config.get_load_format,
        # SGLang's name for the worker's PD role (docs/disaggregation.md); null: serves requests whole.
        disaggregation_mode=None if engine.kv_role == "both" else engine.kv_role,
        kv_layout=info.kv_layout if info else None,
        kv_transfer_port=info.kv_transfer_port if info else None,
        engine_config=engine.model_dump(mode="json") if paths else _without_paths(engine.model_dump(mode="json")),
    )
    return body


@router.post("/flush_cache")
async def flush_cache(request: Request) -> dict[str, Any]:
    """Forget every prefix-cache block no request is using (the engine does it
    between two steps). Running requests keep theirs, so it is safe under load.
    A key with the router scope (or an admin key); refused in open mode."""
    state = get_state(request)
    try:  # every model's engine: a router flushes a replica, whatever it serves
        flushed = await asyncio.gather(*(e.reset_prefix_cache() for e in state.engines() if e.ready))
    except EngineUnavailableError as exc:
        raise unavailable(str(exc)) from None
    if not flushed:
        if any(v.sleep.asleep for v in state.fleet.versions()):
            return {"flushed": True, "num_blocks": 0}  # a sleeping engine's RAM cache ended with its process
        raise unavailable("no engine is running")
    return {"flushed": True, "num_blocks": sum(flushed)}
