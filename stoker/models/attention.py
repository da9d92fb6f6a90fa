"""Paged attention over a flattened batch, behind one small protocol.

A step's tokens are laid out decodes first (one query token each), then prefill
chunks. A backend turns the runner's backend-neutral view of the step
(`AttentionInputs`) into its own metadata once per step, then serves every layer
from it. Two backends exist:

- `CPUPagedAttention`: the C kernels read the paged cache in place, decodes
  and prefill chunks alike; they are the fused decoder's own attention
  (csrc/attention.h), built for the ISA path in use (STOKER_QUANT_ISA);
- `TorchSDPAAttention`: gather + `scaled_dot_product_attention` on any torch
  device and dtype (the fallback when the C kernels are unavailable or disabled,
  and the shape a CUDA backend would take).

Both read a quantized cache (int8 / fp8 rows with their scales, kv_quant.py)
as well as a float one: the C kernels widen rows as they read them, the torch
path dequantizes the blocks it gathers.

Adding a backend is one class meeting `AttentionBackend` plus a line in
`select_attention_backend` (docs/architecture.md has the recipe).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from stoker.models.cpu_kernels import (
    paged_attention_isa,
    paged_attention_supported,
    paged_decode_attention,
    paged_prefill_attention,
)
from stoker.models.kv_quant import (
    BF16_QUERY_CACHES,
    KV_FORMATS,
    dequantize_rows,
    is_quantized,
    quantize_queries,
    quantize_rows,
)

log = logging.getLogger(__name__)


@dataclass
class PrefillChunk:
    query_start: int
    query_len: int
    context_len: int
    """Tokens in the sequence once this chunk is written (cached + this chunk)."""
    block_ids: torch.Tensor
    """The blocks that cover context_len tokens."""
    causal_mask: torch.Tensor | None = None
    """[query_len, context_len] bool; None when the chunk is the whole context or
    when the C kernels serve it (they read the cache in place)."""


@dataclass
class AttentionInputs:
    """What the runner knows about a step's attention, before any backend choice."""

    slot_mapping: torch.Tensor
    """[num_tokens] KV slot (block_id * block_size + offset) each token writes."""
    decode_block_tables: list[list[int]]
    """One block table per decoding sequence (unpadded), in row order."""
    decode_context_lens: list[int]
    prefills: list[PrefillChunk]
    """Without masks: the backend adds the ones it needs."""
    block_size: int
    null_block_id: int
    """Pads the block tables: a block that is never read unmasked."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor | None
    """[num_decodes, max_blocks], padded with the null block."""
    decode_context_lens: torch.Tensor | None
    """[num_decodes] int64: tokens each decoding sequence attends to."""
    decode_mask: torch.Tensor | None
    """[num_decodes, 1, 1, max_blocks * block_size] bool: which key slots are real.
    Only built by backends that gather the decodes' keys."""
    prefills: list[PrefillChunk]
    backend: AttentionBackend = field(default_factory=lambda: TorchSDPAAttention())
    """The backend that built this metadata and serves the step's layers."""


class AttentionBackend(Protocol):
    name: str
    """Logged once at start: which path serves attention."""
    runs_in_fused_stack: bool
    """Whether the fused C decoder (fused_decoder.py) may serve a step's attention
    inside its one call for all layers: true where this backend's kernels are the
    ones that stack runs (csrc/attention.h), so a step computes the same either way."""

    def build_metadata(self, inputs: AttentionInputs) -> AttentionMetadata:
        """Once per step: tensors and masks every layer's call reuses."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] (this
        step's, already written to the cache). Returns [tokens, heads * head_dim]."""
        ...


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Caches are [num_blocks, block_size, kv_heads, row] (row: head_dim, or
    head_dim + 4 for a quantized cache, see kv_quant.py); k/v are [tokens, kv_heads, head_dim],
    quantized here on the way in."""
    for cache, x in ((k_cache, k), (v_cache, v)):
        if is_quantized(cache.dtype):
            # Copied as bytes: index_copy_ has no float8 kernel on the CPU.
            rows = quantize_rows(x, cache.dtype)
            cache.view(torch.uint8).view(-1, x.shape[1], rows.shape[-1]).index_copy_(0, slots, rows)
        else:
            cache.view(-1, x.shape[1], x.shape[2]).index_copy_(0, slots, x.to(cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The model's one call: the backend that built `meta` serves it (q rounded
    through int8 first where the cache is int8: kv_quant.quantize_queries)."""
    return meta.backend.forward(quantize_queries(q, k_cache.dtype), k, v, k_cache, v_cache, meta, scale)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Block ids [..., n] -> keys [..., kv_heads, n * block_size, head_dim] in `dtype`
    (a quantized cache is dequantized here, only the blocks asked for)."""
    if is_quantized(cache.dtype):
        blocks = dequantize_rows(cache.view(torch.uint8)[block_ids], cache.dtype, dtype)
    else:
        blocks = cache[block_ids].to(dtype)  # [..., n, block_size, kv_heads, head_dim]
    *lead, n, bs, h, d = blocks.shape
    return blocks.reshape(*lead, n * bs, h, d).transpose(-3, -2)


def _padded_tables(inputs: AttentionInputs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not inputs.decode_block_tables:
        return None
    width = max(len(t) for t in inputs.decode_block_tables)
    padded = [t + [inputs.null_block_id] * (width - len(t)) for t in inputs.decode_block_tables]
    return (
        torch.tensor(padded, dtype=torch.long, device=device),
        torch.tensor(inputs.decode_context_lens, dtype=torch.long, device=device),
    )


def _causal_mask(start: int, end: int, device: torch.device) -> torch.Tensor:
    return torch.arange(end, device=device)[None, :] <= torch.arange(start, end, device=device)[:, None]


class TorchSDPAAttention:
    """Gather the blocks, mask, and let torch's SDPA do the rest (any device/dtype)."""

    name = "torch-sdpa"
    runs_in_fused_stack = False

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")

    def build_metadata(self, inputs: AttentionInputs) -> AttentionMetadata:
        tables = _padded_tables(inputs, self.device)
        decode_mask = None
        if tables is not None:
            key_pos = torch.arange(tables[0].shape[1] * inputs.block_size, device=self.device)
            decode_mask = (key_pos[None, :] < tables[1][:, None])[:, None, None, :]
        prefills = [self._with_mask(c) for c in inputs.prefills]
        return AttentionMetadata(
            inputs.slot_mapping,
            len(inputs.decode_block_tables),
            tables[0] if tables else None,
            tables[1] if tables else None,
            decode_mask,
            prefills,
            backend=self,
        )

    def _with_mask(self, chunk: PrefillChunk) -> PrefillChunk:
        start = chunk.context_len - chunk.query_len
        if start == 0:  # the whole context is this step's: plain causal attention on the fresh k/v
            return chunk
        return PrefillChunk(
            chunk.query_start,
            chunk.query_len,
            chunk.context_len,
            chunk.block_ids,
            _causal_mask(start, chunk.context_len, self.device),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_tokens, heads, head_dim = q.shape
        out = torch.empty(num_tokens, heads, head_dim, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            self.decode(q[:nd], k_cache, v_cache, meta, scale, out[:nd])
        for chunk in meta.prefills:
            s, n = chunk.query_start, chunk.query_len
            self.prefill(q[s : s + n], k[s : s + n], v[s : s + n], k_cache, v_cache, chunk, scale, out[s : s + n])
        return out.reshape(num_tokens, heads * head_dim)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        tables = meta.decode_block_tables
        if tables is None or meta.decode_mask is None:
            raise ValueError("decode rows without block tables or mask in the attention metadata")
        keys = _gather(k_cache, tables, q.dtype)
        values = _gather(v_cache, tables, q.dtype)
        gqa = q.shape[1] != keys.shape[1]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )
        out.copy_(o.squeeze(2))

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: PrefillChunk,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """One chunk's causal attention, written into out [n, heads, head_dim] (contiguous)."""
        gqa = q.shape[1] != k_cache.shape[2]
        qs = q.transpose(0, 1).unsqueeze(0)
        if chunk.causal_mask is None and k_cache.dtype == q.dtype:
            ks, vs = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # A cache narrower than the activations (int8, fp8, or bf16 under float32) is
            # read back even for a whole prompt: attending to the fresh k/v instead would
            # make a prompt's result depend on how it was chunked or cached.
            ks = _gather(k_cache, chunk.block_ids, q.dtype)[:, : chunk.context_len].unsqueeze(0)
            vs = _gather(v_cache, chunk.block_ids, q.dtype)[:, : chunk.context_len].unsqueeze(0)
            if chunk.causal_mask is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=chunk.causal_mask, scale=scale, enable_gqa=gqa)
        out.copy_(o.squeeze(0).transpose(0, 1))


class CPUPagedAttention(TorchSDPAAttention):
    """The C kernels read K/V from the paged cache in place: no gather, no mask.
    A prefill row computes exactly what a decode row at its position does. The
    fused decoder stack runs these same kernels inside its one call per step."""

    runs_in_fused_stack = True

    def __init__(self, head_dim: int) -> None:
        super().__init__(torch.device("cpu"))
        self.name = f"cpu-paged-c ({paged_attention_isa()} path)"

    def build_metadata(self, inputs: AttentionInputs) -> AttentionMetadata:
        tables = _padded_tables(inputs, self.device)
        return AttentionMetadata(
            inputs.slot_mapping,
            len(inputs.decode_block_tables),
            tables[0] if tables else None,
            tables[1] if tables else None,
            None,
            inputs.prefills,
            backend=self,
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if tables is None or lens is None:
            raise ValueError("decode rows without block tables or context lengths in the attention metadata")
        if paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out) is None:
            raise RuntimeError("the C decode kernel could not serve a step it was chosen for")

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: PrefillChunk,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        # The kernel writes straight into the step's output rows: no temporary, no copy.
        if not paged_prefill_attention(
            q.contiguous(), k_cache, v_cache, chunk.block_ids, chunk.context_len, scale, out
        ):
            raise RuntimeError("the C prefill kernel could not serve a step it was chosen for")


def select_attention_backend(
    device: torch.device, kv_dtype: torch.dtype, model_dtype: torch.dtype, head_dim: int
) -> AttentionBackend:
    """The C kernels where they can read the cache (CPU, float32 activations over
    any cache they read, bf16 ones over a bf16 or int8/fp8 cache, a head size
    they take, a compiler at hand); torch SDPA everywhere else."""
    backend: AttentionBackend
    if (
        device.type == "cpu"
        and kv_dtype in KV_FORMATS
        and (model_dtype == torch.float32 or (model_dtype == torch.bfloat16 and kv_dtype in BF16_QUERY_CACHES))
        and paged_attention_supported(head_dim)
    ):
        backend = CPUPagedAttention(head_dim)
    else:
        backend = TorchSDPAAttention(device)
    log.info("attention backend: %s; KV cache %s", backend.name, str(kv_dtype).removeprefix("torch."))
    return backend
