"""KV cache sizing: a context in tokens by default, capped by memory and by what
max_num_seqs sequences at full context could use; explicit sizes keep working."""

from __future__ import annotations

from typing import Any

import pytest

from stoker.config import DEFAULT_KV_CACHE_TOKENS, EngineConfig
from stoker.engine.kv_sizing import size_kv_cache

GIB = 2**30
# SmolLM2-135M in fp32: 30 layers x (k, v) x 3 heads x 64 dims x 4 bytes = 46080 bytes a token.
PER_TOKEN = 46080
PER_BLOCK = PER_TOKEN * 16


def size(max_model_len: int = 8192, memory: int = 24 * GIB, **fields: Any) -> tuple[int, str]:
    got = size_kv_cache(EngineConfig.model_validate(fields), PER_BLOCK, max_model_len, memory)
    return got.num_blocks, got.rule


def test_default_is_a_context_in_tokens_not_a_memory_fraction():
    blocks, rule = size()
    assert rule == "kv_cache_tokens"
    assert (blocks - 1) * 16 == DEFAULT_KV_CACHE_TOKENS  # block 0 is reserved; every asked token is usable
    assert blocks * PER_BLOCK < 1.5 * GIB  # was 15 % of 24 GiB (3.6 GiB) for this 135M model


def test_default_holds_one_full_context_when_the_context_is_longer():
    blocks, _ = size(max_model_len=131072, memory=64 * GIB)
    assert (blocks - 1) * 16 == 131072


def test_default_is_capped_by_the_memory_fraction():
    blocks, rule = size(max_model_len=131072, memory=8 * GIB)
    assert rule == "kv_cache_tokens capped by kv_cache_memory_fraction"
    assert blocks == int(8 * GIB * 0.15) // PER_BLOCK


def test_default_is_capped_by_max_num_seqs_at_full_context():
    blocks, rule = size(max_model_len=256, max_num_seqs=4)
    assert rule == "kv_cache_tokens capped by max_num_seqs x max_model_len"
    assert blocks == 4 * 16 + 1


def test_explicit_tokens():
    assert size(kv_cache_tokens=1000) == (-(-1000 // 16) + 1, "kv_cache_tokens")


def test_explicit_fraction_alone_keeps_its_old_meaning():
    blocks, rule = size(kv_cache_memory_fraction=0.05)
    assert rule == "kv_cache_memory_fraction"
    assert blocks == int(24 * GIB * 0.05) // PER_BLOCK


def test_explicit_bytes_and_blocks_keep_working():
    assert size(kv_cache_memory_bytes=100 * PER_BLOCK) == (100, "kv_cache_memory_bytes")
    assert size(num_kv_blocks=7, kv_cache_memory_bytes=100 * PER_BLOCK) == (7, "num_kv_blocks")


def test_too_small_a_cache_is_refused_naming_the_settings():
    with pytest.raises(ValueError, match=r"KV cache too small.*kv_cache_memory_bytes"):
        size(kv_cache_memory_bytes=PER_BLOCK)


def test_tokens_must_be_positive():
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        EngineConfig.model_validate({"kv_cache_tokens": 0})
