"""Paged KV cache bookkeeping: which block holds which tokens for whom.

The tensors themselves live in the runner; this file only hands out block ids.
A full block is keyed by a chained hash of (parent key, its tokens); freed
blocks keep their key and stay reusable until they are reallocated, least
recently used first. A base request's chain starts from None, a LoRA
request's from its adapter's root (Request.hash_root), so the two never meet.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stoker.engine.kv_events import KVEventLog

if TYPE_CHECKING:
    # Only for annotations: the request imports the sampler (torch), and the
    # front end imports chain_hash (pins) before it spawns the engine.
    from stoker.engine.request import Request

NULL_BLOCK_ID = 0
"""Block 0 is never handed out: padded block tables and slots point at it."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    """The tokens the hash was computed from, checked on every hit."""


def chain_hash(parent_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    # A cryptographic digest: with Python's hash() a crafted collision could chain
    # one tenant's block under another tenant's prefix and serve it to them.
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def hashes_past(request: Request, cached: Sequence[Block], block_size: int) -> tuple[bytes | None, list[bytes]]:
    """The chained hashes of the request's full prompt blocks after its RAM hits `cached`, and the hash
    the first of them chains from: what a second tier (the disk, a prefill worker) may hold for it.
    The block of its last token is never among them: that token's logits are needed."""
    first_parent = cached[-1].block_hash if cached else request.hash_root
    parent, hashes = first_parent, []
    for start in range(len(cached) * block_size, (request.num_tokens - 1) // block_size * block_size, block_size):
        parent = chain_hash(parent, tuple(request.token_ids[start : start + block_size]))
        hashes.append(parent)
    return first_parent, hashes


class BlockPool:
    """Owns every block: reference counts, the LRU free queue and the hash index."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, events: KVEventLog | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is reserved), got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        # Least recently freed first; a cached block here is free but still hittable.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[bytes, Block] = {}
        self.events = events
        """Where hash-index changes are recorded for publishing (--kv-events-endpoint); None: not recorded.
        Events follow `cached`, the index lookups use: a key is stored when it enters it, removed when it leaves."""
        self.spill: Callable[[Block], None] | None = None
        """Called with a hashed block as it leaves RAM (freed by its last holder, or taken from the free
        queue for reuse) while its bytes are intact: the disk tier's copy-out (--kv-cache-disk). None: off."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[Block]:
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            if self.spill is not None and block.block_hash is not None:
                self.spill(block)
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = block.parent_hash = block.token_ids = None

    def lookup(self, parent_hash: bytes | None, token_ids: tuple[int, ...]) -> Block | None:
        block = self.cached.get(chain_hash(parent_hash, token_ids))
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[Block]) -> None:
        """Blocks should be given tail first, so a sequence's tail is evicted before its head."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block
                if self.spill is not None and block.block_hash is not None:
                    self.spill(block)

    def cache_block(
        self,
        block: Block,
        parent_hash: bytes | None,
        token_ids: tuple[int, ...],
        lora_name: str | None = None,
        chain_root: bytes | None = None,
    ) -> bytes:
        """lora_name and chain_root: a LoRA adapter's blocks, whose chain starts from chain_root
        (announced as vLLM does: no parent for a chain's first block, the adapter's name on each)."""
        block_hash = chain_hash(parent_hash, token_ids)
        if self.enable_caching and block.block_hash is None:
            block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
            # A second copy of a cached block (two requests computed it at once) is not
            # indexed, so it is not announced either.
            if self.cached.setdefault(block_hash, block) is block and self.events is not None:
                parent = None if parent_hash == chain_root else parent_hash
                self.events.stored(block_hash, parent, token_ids, lora_name=lora_name)
        return block_hash

    def reset_prefix_cache(self) -> int:
        """Forget free blocks' keys; returns how many were forgotten. Blocks in
        use keep theirs: their holders' hash chains continue from them."""
        dropped = 0
        for block in self.free_queue.values():
            if block.block_hash is not None:
                dropped += 1
                self._evict(block)
        if self.events is not None and not self.cached:
            self.events.cleared()  # nothing is left: one event says so, not one per block
        return dropped


class KVCacheManager:
    """Maps requests to block tables and decides what fits."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, events: KVEventLog | None = None
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, events)
        self.req_blocks: dict[tuple[str, int], list[Block]] = {}
        self.num_hashed: dict[tuple[str, int], int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request.key, [])]

    def _full_block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(request.token_ids[start : start + self.block_size])

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """Longest run of cached blocks matching the request's tokens. The last
        token is never served from cache: its logits are needed."""
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        parent = request.hash_root
        for i in range(max_blocks):
            block = self.pool.lookup(parent, self._full_block_tokens(request, i))
            if block is None:
                break
            hits.append(block)
            parent = block.block_hash
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per request admitted to running, not per lookup attempt."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def blocks_needed(self, request: Request, num_new_tokens: int, cached: Sequence[Block] = ()) -> int:
        held = len(self.req_blocks.get(request.key, ())) + len(cached)
        computed = request.num_computed_tokens + len(cached) * self.block_size
        total = -(-(computed + num_new_tokens) // self.block_size)
        return max(0, total - held)

    def can_allocate(self, request: Request, num_new_tokens: int, cached: Sequence[Block] = ()) -> bool:
        # Cached hits that sit in the free queue stop being free once touched.
        reclaimed = sum(1 for b in cached if b.ref_count == 0)
        return self.blocks_needed(request, num_new_tokens, cached) + reclaimed <= self.pool.num_free

    def allocate(self, request: Request, num_new_tokens: int, cached: Sequence[Block] = ()) -> bool:
        """Give the request room for num_new_tokens beyond what it (plus the cached
        prefix) has computed. Returns False, changing nothing, if it does not fit.
        The request's own progress is left alone: the scheduler accounts the
        cached prefix in this step's ScheduledRequest, and update_from_output
        moves num_computed_tokens."""
        if not self.can_allocate(request, num_new_tokens, cached):
            return False
        needed = self.blocks_needed(request, num_new_tokens, cached)
        blocks = self.req_blocks.setdefault(request.key, [])
        if cached:
            self.pool.touch(list(cached))
            blocks.extend(cached)
            self.num_hashed[request.key] = len(blocks)
        blocks.extend(self.pool.allocate(needed))
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that num_tokens (tokens whose KV is written) fills."""
        if not self.enable_caching:
            return
        blocks = self.req_blocks[request.key]
        start = self.num_hashed.get(request.key, 0)
        end = min(num_tokens // self.block_size, len(blocks))
        root = request.hash_root
        parent = blocks[start - 1].block_hash if start > 0 else root
        for i in range(start, end):
            block = blocks[i]
            tokens = self._full_block_tokens(request, i)
            if block.block_hash is not None and block.token_ids == tokens and block.parent_hash == parent:
                parent = block.block_hash
            else:
                parent = self.pool.cache_block(block, parent, tokens, request.lora_name, root)
        self.num_hashed[request.key] = max(start, end)

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.key, [])
        self.num_hashed.pop(request.key, None)
        self.pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()
