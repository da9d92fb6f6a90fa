"""BlockPool and KVCacheManager: exact block ids, free-queue (LRU) order, ref
counts, hashing and verified hits. No model, no tensors."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from stoker.engine import kv_cache
from stoker.engine.kv_cache import NULL_BLOCK_ID, Block, BlockPool, KVCacheManager, chain_hash
from stoker.engine.params import SamplingParams
from stoker.engine.request import Request

BS = 4


def req(rid: str, prompt: list[int], index: int = 0) -> Request:
    return Request(rid, index, list(prompt), SamplingParams(), 0.0)


def compute(kv: KVCacheManager, r: Request, num_new: int, cached: Sequence[Block] = ()) -> None:
    """Allocate, 'run' num_new tokens and register the full blocks, as a step
    does (the cached prefix counts as computed, as update_from_output counts it)."""
    assert kv.allocate(r, num_new, list(cached))
    r.num_computed_tokens += len(cached) * BS + num_new
    kv.cache_full_blocks(r, r.num_computed_tokens)


def free_ids(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


# ------------------------------------------------------------------ BlockPool


def test_block_zero_is_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.num_blocks == 4
    assert pool.num_free == 4
    blocks = pool.allocate(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    assert NULL_BLOCK_ID not in [b.block_id for b in blocks]
    assert all(b.ref_count == 1 for b in blocks)
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(list(reversed(blocks)))
    assert NULL_BLOCK_ID not in free_ids(pool)


def test_pool_needs_a_usable_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(1)


def test_allocation_follows_the_free_queue() -> None:
    pool = BlockPool(6)
    b1, b2, b3 = pool.allocate(3)
    assert free_ids(pool) == [4, 5]
    pool.free([b3])
    pool.free([b1])
    assert free_ids(pool) == [4, 5, 3, 1]
    assert [b.block_id for b in pool.allocate(3)] == [4, 5, 3]
    assert free_ids(pool) == [1]
    assert b2.ref_count == 1


def test_manager_frees_tail_first_so_the_head_survives_longest() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = req("a", list(range(100, 112)))  # 12 tokens, 3 full blocks
    compute(kv, a, 12)
    assert kv.block_ids(a) == [1, 2, 3]
    assert free_ids(kv.pool) == [4, 5]
    kv.free(a)
    assert free_ids(kv.pool) == [4, 5, 3, 2, 1]
    # Four allocations later the head block (id 1) is still cached and hittable.
    kv.pool.allocate(4)
    again = req("again", list(range(100, 112)) + [7])
    assert [b.block_id for b in kv.find_cached_prefix(again)] == [1]


def test_eviction_on_reallocation_removes_the_hash() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    h = pool.cache_block(b, None, (1, 2, 3, 4))
    assert h == chain_hash(None, (1, 2, 3, 4))
    assert pool.cached == {h: b}
    pool.free([b])
    assert pool.lookup(None, (1, 2, 3, 4)) is b  # free but still hittable
    assert [x.block_id for x in pool.allocate(2)] == [2, 1]  # LRU: 2 was never used, 1 freed later
    assert pool.cached == {}
    assert b.block_hash is None and b.parent_hash is None and b.token_ids is None
    assert pool.lookup(None, (1, 2, 3, 4)) is None


def test_cached_free_block_is_hittable_and_touch_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache_block(b, None, (5, 6))
    pool.free([b])
    assert b.ref_count == 0
    assert free_ids(pool) == [2, 3, 1]
    hit = pool.lookup(None, (5, 6))
    assert hit is b
    pool.touch([hit])
    assert b.ref_count == 1
    assert free_ids(pool) == [2, 3]
    assert pool.num_free == 2
    # Touching a block that is in use only adds a reference.
    pool.touch([hit])
    assert b.ref_count == 2
    assert free_ids(pool) == [2, 3]
    # The next allocation does not evict it.
    assert [x.block_id for x in pool.allocate(2)] == [2, 3]
    assert pool.lookup(None, (5, 6)) is b


def test_double_free_raises() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([b])


def test_lookup_verifies_tokens_and_parent_on_a_forged_collision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "chain_hash", lambda parent, tokens: 42)
    pool = BlockPool(4)
    a, child = pool.allocate(2)
    assert pool.cache_block(a, None, (1, 2)) == 42
    assert pool.lookup(None, (1, 2)) is a
    # Same hash, other tokens: not a hit.
    assert pool.lookup(None, (3, 4)) is None
    # Same hash, same tokens, other parent: not a hit.
    assert pool.lookup(7, (1, 2)) is None
    # A second block with the colliding hash does not displace the first.
    pool.cache_block(child, 42, (3, 4))
    assert pool.cached == {42: a}
    assert pool.lookup(42, (3, 4)) is None
    # Evicting the block that lost the race leaves the registered one alone.
    pool.free([child])
    pool.allocate(2)  # ids 3, then 2 (the loser)
    assert pool.cached == {42: a}
    assert pool.lookup(None, (1, 2)) is a


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(3, enable_caching=False)
    (b,) = pool.allocate(1)
    pool.cache_block(b, None, (1, 2))
    assert pool.cached == {}
    assert b.block_hash is None


def test_reset_prefix_cache_forgets_free_blocks() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache_block(b, None, (1, 2))
    pool.free([b])
    assert pool.reset_prefix_cache() == 1
    assert pool.reset_prefix_cache() == 0  # nothing left to forget
    assert pool.lookup(None, (1, 2)) is None
    assert pool.cached == {}
    assert pool.num_free == 2


# ------------------------------------------------------------- KVCacheManager


def test_ref_counts_with_two_requests_sharing_a_prefix() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prefix = list(range(10, 18))  # two full blocks
    a = req("a", prefix + [1, 2, 3])
    compute(kv, a, 11)
    assert kv.block_ids(a) == [1, 2, 3]
    b = req("b", prefix + [4, 5])
    cached = kv.find_cached_prefix(b)
    assert [x.block_id for x in cached] == [1, 2]
    compute(kv, b, 2, cached)
    assert kv.block_ids(b) == [1, 2, 4]
    assert [kv.pool.blocks[i].ref_count for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert kv.num_used_blocks == 4
    kv.free(a)
    assert [kv.pool.blocks[i].ref_count for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    assert free_ids(kv.pool)[-1] == 3  # only a's private tail went back
    assert kv.num_used_blocks == 3
    kv.free(b)
    assert [kv.pool.blocks[i].ref_count for i in (1, 2, 3, 4)] == [0, 0, 0, 0]
    # b's blocks go back tail first: 4, then the shared 2 and 1.
    assert free_ids(kv.pool) == [5, 6, 7, 8, 9, 3, 4, 2, 1]
    assert kv.num_used_blocks == 0


def test_find_cached_prefix_never_covers_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(20, 28))  # exactly 2 blocks
    a = req("a", tokens)
    compute(kv, a, 8)
    assert kv.num_hashed[a.key] == 2
    # Same 8-token prompt: only 1 of the 2 cached blocks, so the last token is computed.
    same = req("same", tokens)
    assert [b.block_id for b in kv.find_cached_prefix(same)] == [1]
    # One more token: both blocks.
    longer = req("longer", tokens + [99])
    assert [b.block_id for b in kv.find_cached_prefix(longer)] == [1, 2]
    # Shorter than a block: nothing.
    assert kv.find_cached_prefix(req("short", tokens[:4])) == []
    # Stops at the first mismatch, even if a later block's tokens match.
    diverged = req("div", tokens[:3] + [0] + tokens[4:] + [1])
    assert kv.find_cached_prefix(diverged) == []


def test_allocate_with_cached_blocks_takes_them_without_moving_progress() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(30, 42))  # 3 blocks
    a = req("a", tokens)
    compute(kv, a, 12)
    b = req("b", tokens + [1, 2])
    cached = kv.find_cached_prefix(b)
    assert [x.block_id for x in cached] == [1, 2, 3]
    assert kv.allocate(b, 2, cached)
    # Progress is update_from_output's to move; the hit only shapes the block table.
    assert b.num_computed_tokens == 0
    assert kv.block_ids(b) == [1, 2, 3, 4]
    assert kv.num_hashed[b.key] == 3


def test_can_allocate_counts_cached_blocks_sitting_in_the_free_queue() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # usable ids 1..4
    tokens = list(range(50, 62))  # 3 blocks
    a = req("a", tokens)
    compute(kv, a, 12)
    kv.free(a)
    assert free_ids(kv.pool) == [4, 3, 2, 1]
    assert kv.num_used_blocks == 0

    # 3 cached (free) + 1 new = 4 <= 4 free.
    b = req("b", tokens + [1, 2, 3, 4])
    cached_b = kv.find_cached_prefix(b)
    assert [x.block_id for x in cached_b] == [1, 2, 3]
    assert kv.blocks_needed(b, 4, cached_b) == 1
    assert kv.can_allocate(b, 4, cached_b)

    # 3 cached (free) + 2 new = 5 > 4 free, although only 2 blocks are "needed".
    c = req("c", tokens + [1, 2, 3, 4, 5, 6, 7, 8])
    cached_c = kv.find_cached_prefix(c)
    assert [x.block_id for x in cached_c] == [1, 2, 3]
    assert kv.blocks_needed(c, 8, cached_c) == 2
    assert not kv.can_allocate(c, 8, cached_c)
    assert kv.allocate(c, 8, cached_c) is False
    # A failed allocate changes nothing.
    assert c.num_computed_tokens == 0
    assert kv.block_ids(c) == []
    assert [kv.pool.blocks[i].ref_count for i in (1, 2, 3, 4)] == [0, 0, 0, 0]
    assert free_ids(kv.pool) == [4, 3, 2, 1]

    # b fits and takes block 4 as its new one.
    assert kv.allocate(b, 4, cached_b)
    assert kv.block_ids(b) == [1, 2, 3, 4]
    assert kv.pool.num_free == 0

    # Once the cached blocks are in use by b, they cost c nothing extra.
    assert kv.can_allocate(c, 8, cached_c) is False  # still needs 2 new, 0 free
    kv.free(b)
    d = req("d", tokens + [9])
    cached_d = kv.find_cached_prefix(d)
    assert [x.block_id for x in cached_d] == [1, 2, 3]


def test_cache_full_blocks_registers_only_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = req("a", list(range(60, 70)))  # 10 tokens
    assert kv.allocate(a, 10)
    assert kv.block_ids(a) == [1, 2, 3]
    blocks = [kv.pool.blocks[i] for i in (1, 2, 3)]

    # Only 5 tokens written so far (a chunk): block 1 only.
    kv.cache_full_blocks(a, 5)
    assert kv.num_hashed[a.key] == 1
    assert blocks[0].block_hash == chain_hash(None, (60, 61, 62, 63))
    assert blocks[1].block_hash is None

    kv.cache_full_blocks(a, 10)
    assert kv.num_hashed[a.key] == 2
    assert blocks[1].block_hash == chain_hash(blocks[0].block_hash, (64, 65, 66, 67))
    assert blocks[1].parent_hash == blocks[0].block_hash
    assert blocks[1].token_ids == (64, 65, 66, 67)
    assert blocks[2].block_hash is None
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [1, 2]

    # Two decode tokens fill block 3, its hash chains on block 2's.
    a.num_computed_tokens = 10
    a.append_token(70, 0.0)
    a.append_token(71, 0.0)
    assert kv.allocate(a, 1)  # token 70 at position 10
    kv.cache_full_blocks(a, 11)
    assert blocks[2].block_hash is None
    a.num_computed_tokens = 11
    assert kv.allocate(a, 1)  # token 71 at position 11
    assert kv.block_ids(a) == [1, 2, 3]
    kv.cache_full_blocks(a, 12)
    assert kv.num_hashed[a.key] == 3
    assert blocks[2].block_hash == chain_hash(blocks[1].block_hash, (68, 69, 70, 71))


def test_num_used_blocks_after_free() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", list(range(9)))
    compute(kv, a, 9)
    b = req("b", list(range(100, 103)))
    compute(kv, b, 3)
    assert kv.num_blocks == 7
    assert kv.num_used_blocks == 4
    kv.free(a)
    assert kv.num_used_blocks == 1
    assert kv.block_ids(a) == []
    assert a.key not in kv.num_hashed
    kv.free(b)
    assert kv.num_used_blocks == 0
    kv.free(b)  # freeing a request that holds nothing is harmless
    assert kv.num_used_blocks == 0


def test_record_prefix_lookup_accumulates() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)
    kv.record_prefix_lookup(10, 8)
    kv.record_prefix_lookup(5, 0)
    assert (kv.prefix_queries, kv.prefix_hits) == (15, 8)


def test_caching_disabled_manager_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = req("a", list(range(9)))
    compute(kv, a, 9)
    assert kv.pool.cached == {}
    assert kv.find_cached_prefix(req("b", list(range(9)))) == []


def test_duplicate_prefix_computed_twice_keeps_one_entry() -> None:
    """Two requests computing the same prompt at once: the first registration
    wins, the second's chain still continues with the right hashes."""
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(200, 209))
    a, b = req("a", tokens), req("b", tokens)
    assert kv.allocate(a, 9) and kv.allocate(b, 9)
    for r in (a, b):
        r.num_computed_tokens = 9
        kv.cache_full_blocks(r, 9)
    assert kv.block_ids(a) == [1, 2, 3] and kv.block_ids(b) == [4, 5, 6]
    assert kv.pool.blocks[4].block_hash == kv.pool.blocks[1].block_hash
    assert kv.pool.blocks[5].block_hash == kv.pool.blocks[2].block_hash
    assert [x.block_id for x in kv.find_cached_prefix(req("c", tokens))] == [1, 2]


def test_reset_prefix_cache_while_running_does_not_create_false_hits() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(kv, a, 9)  # blocks 1, 2 hashed; block 3 holds token 9
    assert kv.reset_prefix_cache() == 0  # a holds every hashed block: none is dropped
    # a keeps decoding: tokens 10, 11, 12 fill its third block.
    for t in (10, 11, 12):
        a.append_token(t, 0.0)
        compute(kv, a, 1)
    assert kv.num_hashed[a.key] == 3
    # The KV in a's third block was computed after 8 other tokens; it is not
    # the KV of a sequence that starts with 9, 10, 11, 12.
    b = req("b", [9, 10, 11, 12, 13])
    assert kv.find_cached_prefix(b) == []
