"""ModelRunner: owns the model and the KV cache tensors. It takes a
SchedulerOutput, flattens it into tensors (ids, positions, slot mapping, block
tables), runs the model for the logits it needs (each sampling sequence's last
token, and every prompt position of prompt_logprobs requests), samples, and
returns a ModelRunnerOutput. It reads only the message, never a Request or the
KV cache manager, and changes no request state."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from stoker.config import ModelConfig
from stoker.engine.kv_cache import NULL_BLOCK_ID
from stoker.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from stoker.engine.params import TokenLogprob
from stoker.engine.sampler import SampledToken, Sampler, SampleRow, is_greedy
from stoker.models.attention import AttentionInputs, AttentionMetadata, PrefillChunk, select_attention_backend
from stoker.models.kv_quant import row_width
from stoker.models.lora import LoraAdapter, LoraBatch
from stoker.models.registry import DecoderModel


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block; a quantized cache's rows include their scales."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * row_width(config.head_dim, dtype) * element


def zeroed_lazily(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose pages the OS zeroes on first touch, on the CPU: numpy's
    zeros is calloc, which maps fresh zero pages for a large size, where torch.zeros
    writes every byte at once (4 s and all of it resident for a 3.6 GB cache).
    So start-up costs nothing and memory grows with the blocks actually used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % _ALIGN  # 64-byte aligned like torch's own allocations
    return torch.from_numpy(raw[skip : skip + nbytes]).view(dtype).view(shape)


_ALIGN = 64


# vLLM's stand-in for a logprob of -inf, so every logprob is a finite JSON number.
LOGPROB_FLOOR = -9999.0
# Prompt positions scored per log_softmax call, bounding the temporary's size.
_SCORE_ROWS = 256


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    """The sampling sequences' last tokens first, then the scored prompt positions."""
    num_sampling: int
    lora: LoraBatch | None = None
    """Each row's LoRA adapter; None when no scheduled sequence has one (the base model's path exactly)."""


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.sampler = Sampler()
        self.block_size = block_size
        self.device = model.device
        cfg = model.config
        self.attention = select_attention_backend(self.device, kv_dtype, model.dtype, cfg.head_dim)
        shape = (num_blocks, block_size, cfg.num_kv_heads, row_width(cfg.head_dim, kv_dtype))
        # Zeroed, not empty: padded slots are masked out, but masked NaN garbage
        # would still poison the softmax-weighted sum (a zero quantized row is 0 * scale 0).
        self.kv_caches = [
            (zeroed_lazily(shape, kv_dtype, self.device), zeroed_lazily(shape, kv_dtype, self.device))
            for _ in range(cfg.num_layers)
        ]

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def prepare(self, step: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        prompt_indices: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for s in step.scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            table = s.block_ids
            query_start = len(input_ids)
            input_ids.extend(s.token_ids)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if s.is_decode:
                # A draft is a decode row of its own position (its context ends at
                # itself), so it computes exactly what decoding it would: the
                # same kernel and arithmetic, which keeps speculation exact.
                for p in range(start, end):
                    decode_tables.append(table[: p // bs + 1])
                    decode_lens.append(p + 1)
            else:
                prefills.append(PrefillChunk(query_start, s.num_new_tokens, end, self._tensor(table[: -(-end // bs)])))
            if s.samples:
                logits_indices.extend(range(len(input_ids) - 1 - s.num_draft_tokens, len(input_ids)))
            prompt_indices.extend(range(query_start, query_start + len(s.prompt_logprob_targets)))

        meta = self.attention.build_metadata(
            AttentionInputs(self._tensor(slots), decode_tables, decode_lens, prefills, bs, NULL_BLOCK_ID)
        )
        return StepInputs(
            self._tensor(input_ids),
            self._tensor(positions),
            meta,
            self._tensor(logits_indices + prompt_indices),
            len(logits_indices),
            lora_batch(step),
        )

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """float32 logits: one row per sampling sequence in step.scheduled
        order, then one per scored prompt position."""
        inputs = self.prepare(step)
        return self.model.forward(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, inputs.logits_indices, inputs.lora
        )

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        logits = self.execute(step)
        sampling = [s for s in step.scheduled if s.sampling is not None]
        rows: list[SampleRow] = []
        for s in sampling:
            rows.extend(verification_rows(s) if s.num_draft_tokens else [s.sampling] if s.sampling else [])
        generators = _generator_states(sampling)
        sampled = self.sampler(logits[: len(rows)], rows) if rows else []
        out = ModelRunnerOutput(sampled_keys=[s.key for s in sampling])
        row = 0
        for s in sampling:
            tokens = sampled[row : row + 1 + s.num_draft_tokens]
            row += len(tokens)
            if s.num_draft_tokens:
                tokens = accept(tokens, s.draft_token_ids)
                if s.key in generators:
                    _rewind(generators[s.key], len(tokens))
            out.sampled_token_ids.append([t.token_id for t in tokens])
            logprobs = [t.logprob for t in tokens if t.logprob is not None]
            out.logprobs.append(logprobs if logprobs else None)
        row = len(rows)
        for s in step.scheduled:
            count = len(s.prompt_logprob_targets)
            if count and s.num_prompt_logprobs is not None:
                out.prompt_logprobs[s.key] = score_prompt(logits[row : row + count], s, s.num_prompt_logprobs)
                row += count
        return out


def lora_batch(step: SchedulerOutput) -> LoraBatch | None:
    """Each flattened row's adapter, as an index into the step's distinct adapters (-1: the base);
    a sequence's drafts run with its adapter like its other rows."""
    if all(s.lora is None for s in step.scheduled):
        return None
    adapters: dict[LoraAdapter, int] = {}
    rows: list[int] = []
    for s in step.scheduled:
        index = -1 if s.lora is None else adapters.setdefault(s.lora, len(adapters))
        rows.extend([index] * s.num_new_tokens)
    return LoraBatch(list(adapters), torch.tensor(rows, dtype=torch.int32))


def verification_rows(s: ScheduledRequest) -> list[SampleRow]:
    """One sampling row per position of a decode with drafts: row j samples the
    token after draft j - 1, as if drafts 0 .. j - 1 had been generated (so
    penalties and min_tokens see them, and a grammar-constrained row gets the
    grammar's mask at that point)."""
    first = s.sampling
    if first is None:
        raise ValueError("drafts on a sequence that does not sample")
    drafts = s.draft_token_ids
    masks = s.draft_bitmasks
    if first.token_bitmask is not None and len(masks) != len(drafts):
        raise ValueError(f"a constrained sequence with {len(drafts)} drafts needs as many bitmasks, got {len(masks)}")
    return [first] + [
        replace(
            first,
            output_token_ids=first.output_token_ids + drafts[:j],
            token_bitmask=masks[j - 1] if masks else None,
        )
        for j in range(1, len(drafts) + 1)
    ]


def accept(sampled: list[SampledToken], drafts: list[int]) -> list[SampledToken]:
    """The drafts the target model's own samples agree with, then its sample at
    the first disagreement (or after the last draft). For a guess that is one
    token (n-gram, greedy drafts) this is exact rejection sampling: a draft d
    is kept with probability p(d), and on rejection the sample is p's draw
    conditioned on not being d, i.e. the residual distribution."""
    kept = 0
    while kept < len(drafts) and sampled[kept].token_id == drafts[kept]:
        kept += 1
    return sampled[: kept + 1]


def _generator_states(sampling: list[ScheduledRequest]) -> dict[tuple[str, int], tuple[torch.Generator, torch.Tensor]]:
    """Generator states of sampled sequences with drafts, before the sampler draws
    one uniform per position from each."""
    states = {}
    for s in sampling:
        row = s.sampling
        if s.num_draft_tokens and row is not None and row.generator is not None and not is_greedy(row.params):
            states[s.key] = (row.generator, row.generator.get_state())
    return states


def _rewind(saved: tuple[torch.Generator, torch.Tensor], num_tokens: int) -> None:
    """Leave the generator as if it had drawn for the kept tokens only, so a
    seeded request samples the same tokens with speculation as without."""
    generator, state = saved
    generator.set_state(state)
    for _ in range(num_tokens):
        torch.rand(1, generator=generator, device=generator.device)


def score_prompt(logits: torch.Tensor, s: ScheduledRequest, top_k: int) -> list[TokenLogprob]:
    """Each prompt token's logprob under the raw model distribution (no
    penalties or temperature, as vLLM), its rank and the top_k alternatives."""
    out: list[TokenLogprob] = []
    targets = s.prompt_logprob_targets
    for lo in range(0, len(targets), _SCORE_ROWS):
        chunk = torch.log_softmax(logits[lo : lo + _SCORE_ROWS].float(), dim=-1).clamp_min(LOGPROB_FLOOR)
        target = torch.tensor(targets[lo : lo + _SCORE_ROWS], dtype=torch.long, device=chunk.device)
        chosen = chunk.gather(1, target[:, None])
        ranks = (chunk > chosen).sum(dim=-1) + 1
        top_lp, top_ids = chunk.topk(top_k, dim=-1) if top_k else (chunk[:, :0], target[:, None][:, :0])
        for t, lp, rank, ids, lps in zip(
            target.tolist(), chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist()
        ):
            out.append(TokenLogprob(t, lp, list(zip(ids, lps)), rank))
    return out
