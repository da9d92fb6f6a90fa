"""How many KV cache blocks the engine allocates, and why.

llama.cpp sizes its cache by context (`--ctx-size` tokens, shared by its slots);
vLLM by a memory fraction (`--gpu-memory-utilization`). A fraction alone gives a
135M model gigabytes it never fills (15 % of 24 GiB is 3.6 GB, 160k tokens),
and zeroing them costs seconds at start; a context alone ignores what the
machine holds. So, by default, a context in tokens (`kv_cache_tokens`, else
DEFAULT_KV_CACHE_TOKENS or one full context if longer), never
more than `kv_cache_memory_fraction` of memory and never more than every
running sequence at full context could use. An explicit size in bytes,
as a fraction or in blocks replaces the default rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from stoker.config import DEFAULT_KV_CACHE_TOKENS, EngineConfig


@dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int
    """Usable blocks (the engine adds none: block 0 is one of these and is reserved)."""
    rule: str
    """Which setting decided the size, for the start log."""


def total_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def size_kv_cache(
    config: EngineConfig,
    bytes_per_block: int,
    max_model_len: int,
    total_memory: int,
) -> KVCacheSize:
    """The number of blocks for `config` (see the module docstring); ValueError if under 2."""
    block_size = config.block_size
    full_use = config.max_num_seqs * -(-max_model_len // block_size) + 1
    explicit = config.model_fields_set
    fraction_budget = int(total_memory * config.kv_cache_memory_fraction) // bytes_per_block
    if config.num_kv_blocks is not None:
        size = KVCacheSize(config.num_kv_blocks, "num_kv_blocks")
    elif config.kv_cache_memory_bytes is not None:
        size = KVCacheSize(min(config.kv_cache_memory_bytes // bytes_per_block, full_use), "kv_cache_memory_bytes")
    elif "kv_cache_memory_fraction" in explicit and "kv_cache_tokens" not in explicit:
        size = KVCacheSize(min(fraction_budget, full_use), "kv_cache_memory_fraction")
    else:
        tokens = config.kv_cache_tokens or max(DEFAULT_KV_CACHE_TOKENS, max_model_len)
        # +1: block 0 is reserved, so the tokens asked for are all usable.
        wanted = -(-tokens // block_size) + 1
        if wanted <= min(fraction_budget, full_use):
            size = KVCacheSize(wanted, "kv_cache_tokens")
        elif fraction_budget < full_use:
            size = KVCacheSize(fraction_budget, "kv_cache_tokens capped by kv_cache_memory_fraction")
        else:
            size = KVCacheSize(full_use, "kv_cache_tokens capped by max_num_seqs x max_model_len")
    if size.num_blocks < 2:
        raise ValueError(
            f"KV cache too small: {size.num_blocks} blocks of {bytes_per_block} bytes ({size.rule}); "
            "raise kv_cache_tokens, kv_cache_memory_bytes or kv_cache_memory_fraction"
        )
    return size
