"""Paged attention over a flattened batch (CPU and any torch device).

A step's tokens are laid out decodes first (one query token each), then prefill
chunks. Decodes are served by one batched call per layer over their gathered
block tables; each prefill chunk gets its own causal call, so no padding to the
longest prompt is ever computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stoker.models.cpu_kernels import paged_decode_attention, paged_prefill_attention


@dataclass
class PrefillChunk:
    query_start: int
    query_len: int
    context_len: int
    """Tokens in the sequence once this chunk is written (cached + this chunk)."""
    block_ids: torch.Tensor
    """The blocks that cover context_len tokens."""
    causal_mask: torch.Tensor | None
    """[query_len, context_len] bool; None when the chunk is the whole context or
    when the C prefill kernel serves it (it reads the cache in place)."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] KV slot (block_id * block_size + offset) each token writes."""
    num_decodes: int
    decode_block_tables: torch.Tensor | None
    """[num_decodes, max_blocks], padded with the null block."""
    decode_context_lens: torch.Tensor | None
    """[num_decodes] int64: tokens each decoding sequence attends to."""
    decode_mask: torch.Tensor | None
    """[num_decodes, 1, 1, max_blocks * block_size] bool: which key slots are real.
    Only built when the C kernel cannot serve the decodes."""
    prefills: list[PrefillChunk]
    direct_prefill: bool = False
    """Prefill chunks go to the C kernel, which reads K/V from the cache in place."""


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Caches are [num_blocks, block_size, kv_heads, head_dim]; k/v are [tokens, kv_heads, head_dim]."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Block ids [..., n] -> keys [..., kv_heads, n * block_size, head_dim]."""
    blocks = cache[block_ids]  # [..., n, block_size, kv_heads, head_dim]
    *lead, n, bs, h, d = blocks.shape
    return blocks.reshape(*lead, n * bs, h, d).transpose(-3, -2)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] (this step's,
    already written to the cache). Returns [tokens, heads * head_dim]."""
    num_tokens, heads, head_dim = q.shape
    gqa = heads != k.shape[1]
    out = torch.empty(num_tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    nd = meta.num_decodes
    tables, context_lens = meta.decode_block_tables, meta.decode_context_lens
    if nd and (tables is None or context_lens is None):
        raise ValueError("decode rows without block tables or context lengths in the attention metadata")
    if nd and meta.decode_mask is None:
        assert tables is not None and context_lens is not None
        # The kernel writes straight into the first rows of `out` (contiguous).
        served = paged_decode_attention(q[:nd], k_cache, v_cache, tables, context_lens, scale, out=out[:nd])
        if served is None:
            raise RuntimeError("the C decode kernel failed and no mask was prepared for the torch path")
    elif nd:
        assert tables is not None
        keys = _gather(k_cache, tables)
        values = _gather(v_cache, tables)
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )
        out[:nd] = o.squeeze(2)
    for chunk in meta.prefills:
        s, n = chunk.query_start, chunk.query_len
        if meta.direct_prefill:
            if not paged_prefill_attention(
                q[s : s + n], k_cache, v_cache, chunk.block_ids, chunk.context_len, scale, out[s : s + n]
            ):
                raise RuntimeError("the C prefill kernel failed and no mask was prepared for the torch path")
            continue
        qs = q[s : s + n].transpose(0, 1).unsqueeze(0)
        if chunk.causal_mask is None:
            # The whole context is in this step: attend to the fresh k/v directly.
            ks = k[s : s + n].transpose(0, 1).unsqueeze(0)
            vs = v[s : s + n].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            ks = _gather(k_cache, chunk.block_ids)[:, : chunk.context_len].unsqueeze(0)
            vs = _gather(v_cache, chunk.block_ids)[:, : chunk.context_len].unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=chunk.causal_mask, scale=scale, enable_gqa=gqa)
        out[s : s + n] = o.squeeze(0).transpose(0, 1)
    return out.reshape(num_tokens, heads * head_dim)
