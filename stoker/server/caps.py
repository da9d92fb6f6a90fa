"""Caps one generation request cannot exceed, whoever sends it and whatever
its key's limits: prompts per request (--max-prompts-per-request), samples
per prompt (--max-n) and its KV cache footprint against the engine's whole
cache (--max-request-kv-share). The context length is checked where max_tokens
is resolved (routes/openai.py resolve_max_tokens). Each refusal is a 400
naming the field and the maximum; nothing of the request has run yet.

The footprint is control/cost.py's RequestCost.kv_tokens: every sample holds
its prompt and up to max_tokens new tokens. A request beyond the whole cache
would hold the engine on its own for as long as it runs (its samples could
only run in turns, each preempting the others' work).
"""

from __future__ import annotations

from stoker.control.cost import RequestCost
from stoker.errors import APIError
from stoker.server.config import ServerConfig


def check_prompts(config: ServerConfig, prompts: int) -> None:
    """400 for more prompts in one request than --max-prompts-per-request."""
    if prompts > config.max_prompts_per_request:
        raise APIError(
            400,
            f"This request has {prompts} prompts; at most {config.max_prompts_per_request} are accepted "
            "in one request (--max-prompts-per-request). Send them in several requests.",
            param="prompt",
            code="too_many_prompts",
        )


def check_cost(config: ServerConfig, cost: RequestCost, kv_capacity_tokens: int | None) -> None:
    """400 for a request over the caps: its prompts, n, or its KV footprint beyond
    --max-request-kv-share of the engine's cache (kv_capacity_tokens; None: not known yet)."""
    check_prompts(config, cost.prompts)
    if cost.n > config.max_n:
        raise APIError(
            400,
            f"n is {cost.n}; at most {config.max_n} samples per prompt are accepted (--max-n).",
            param="n",
            code="n_too_large",
        )
    if kv_capacity_tokens is None:
        return
    limit = int(kv_capacity_tokens * config.max_request_kv_share)
    if cost.kv_tokens > limit:
        raise APIError(
            400,
            f"This request needs up to {cost.kv_tokens} KV cache tokens ({cost.samples} samples, each its prompt "
            f"plus max_tokens {cost.max_tokens}); one request may take at most {limit} "
            f"(the engine's KV cache holds {kv_capacity_tokens} tokens; --max-request-kv-share "
            f"{config.max_request_kv_share:g}). Lower max_tokens, n or the number of prompts.",
            param="max_tokens",
            code="request_too_large",
        )
