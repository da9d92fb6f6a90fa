"""ModelRunner: owns the model and the KV cache tensors, flattens one scheduled
step into tensors (ids, positions, slot mapping, block tables) and returns the
last-token logits of the sequences that sample."""

from __future__ import annotations

import torch

from stoker.config import ModelConfig
from stoker.engine.kv_cache import NULL_BLOCK_ID, KVCacheManager
from stoker.engine.scheduler import SchedulerOutput
from stoker.models.attention import AttentionMetadata, PrefillChunk
from stoker.models.cpu_kernels import load_paged_attention, prefill_kernel_supported
from stoker.models.llama import LlamaModel


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv: KVCacheManager,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = model.device
        # The C kernel reads the paged cache in place; elsewhere decodes gather + SDPA.
        self.direct_decode = (
            self.device.type == "cpu"
            and kv_dtype in (torch.float32, torch.bfloat16)
            and kv_dtype == model.dtype
            and load_paged_attention() is not None
        )
        cfg = model.config
        # Prefill chunks likewise, where the build has the AVX-512 kernel; else causal SDPA.
        self.direct_prefill = self.direct_decode and prefill_kernel_supported(cfg.head_dim)
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeroed, not empty: padded slots are masked out, but masked NaN garbage
        # would still poison the softmax-weighted sum.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=kv_dtype, device=self.device),
                torch.zeros(shape, dtype=kv_dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def prepare(self, step: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for s in step.scheduled:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            table = self.kv.block_ids(r)
            query_start = len(input_ids)
            input_ids.extend(r.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if s.num_new_tokens == 1:
                decode_tables.append(table[: -(-end // bs)])
                decode_lens.append(end)
            else:
                n_blocks = -(-end // bs)
                mask = None
                if start > 0 and not self.direct_prefill:
                    q_pos = torch.arange(start, end, device=self.device)[:, None]
                    mask = torch.arange(end, device=self.device)[None, :] <= q_pos
                prefills.append(PrefillChunk(query_start, s.num_new_tokens, end, self._tensor(table[:n_blocks]), mask))
            if s.samples:
                logits_indices.append(len(input_ids) - 1)

        decode_block_tables = decode_context_lens = decode_mask = None
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            padded = [t + [NULL_BLOCK_ID] * (width - len(t)) for t in decode_tables]
            decode_block_tables = self._tensor(padded)
            decode_context_lens = self._tensor(decode_lens)
            if not self.direct_decode:
                key_pos = torch.arange(width * bs, device=self.device)
                decode_mask = (key_pos[None, :] < decode_context_lens[:, None])[:, None, None, :]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decodes=len(decode_tables),
            decode_block_tables=decode_block_tables,
            decode_context_lens=decode_context_lens,
            decode_mask=decode_mask,
            prefills=prefills,
            direct_prefill=self.direct_prefill,
        )
        return self._tensor(input_ids), self._tensor(positions), meta, self._tensor(logits_indices)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """Returns float32 logits [num sampling sequences, vocab] in step.scheduled order."""
        input_ids, positions, meta, logits_indices = self.prepare(step)
        return self.model.forward(input_ids, positions, self.kv_caches, meta, logits_indices)
