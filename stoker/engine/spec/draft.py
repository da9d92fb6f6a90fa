"""Draft-model proposals: a smaller model with the same vocabulary guesses
each sequence's next k tokens greedily, one batched forward pass per guess,
in the engine process with its own paged KV cache.

The draft cache follows each sequence lazily: before guessing, the tokens the
cache holds are compared with the sequence's tokens and everything after the
first difference (rejected guesses) is recomputed, together with whatever
the sequence gained since (its prompt the first time, accepted tokens later).
Greedy guesses are exact to verify whatever the request samples with: the
target keeps a guess only where its own sample equals it (runner.accept).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stoker.engine.kv_cache import KVCacheManager
from stoker.engine.outputs import RequestKey, ScheduledRequest, SchedulerOutput
from stoker.engine.params import SamplingParams
from stoker.engine.request import Request
from stoker.engine.runner import ModelRunner
from stoker.engine.sampler import SampleRow, prepare
from stoker.engine.spec import DraftRequest
from stoker.models.registry import DecoderModel

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
_GREEDY_PREPARED = prepare(_GREEDY)  # shared by every draft row: nothing to build per step


@dataclass
class _DraftSequence:
    slot: Request
    """Stands for the sequence in the draft's KV manager (key and computed count)."""
    cached: list[int] = field(default_factory=list)
    """The tokens whose KV the draft cache holds, in order."""


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def load_draft_model(path: str, quantization: str, device: torch.device) -> DecoderModel:
    """The model at `path` built as a draft is: its own dtype for `auto` (float32
    where its weights stay quantized on the CPU), the given quantization."""
    from stoker.engine.devices import resolve_dtype
    from stoker.models.loader import load_model, weights_stay_quantized
    from stoker.models.registry import build_model

    dtype = resolve_dtype("auto", device, weights_stay_quantized(path, str(device), quantization))
    loaded = load_model(path, dtype, str(device), quantization)
    return build_model(loaded.config, loaded.weights, dtype, device, loaded.config.max_position_embeddings)


class DraftProposer:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        self.runner = ModelRunner(model, num_blocks, block_size, kv_dtype)
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
        self.max_positions = model.config.max_position_embeddings
        self._sequences: dict[RequestKey, _DraftSequence] = {}

    @classmethod
    def load(
        cls,
        path: str,
        quantization: str,
        device: torch.device,
        vocab_size: int,
        capacity_tokens: int,
        block_size: int,
    ) -> DraftProposer:
        """The draft model at `path`, with a KV cache of capacity_tokens. Refuses a
        model whose vocabulary differs from the served one's (ValueError naming
        --speculative-model and both sizes): its token ids would mean other text."""
        model = load_draft_model(path, quantization, device)
        if model.config.vocab_size != vocab_size:
            raise ValueError(
                f"--speculative-model {path}: its vocabulary has {model.config.vocab_size} tokens, the served "
                f"model's {vocab_size}; a draft model must share the served model's tokenizer"
            )
        return cls(model, -(-capacity_tokens // block_size) + 1, block_size, model.dtype)

    def _sequence(self, key: RequestKey) -> _DraftSequence:
        seq = self._sequences.get(key)
        if seq is None:
            slot = Request(key[0], key[1], [], _GREEDY, 0.0, prepared=_GREEDY_PREPARED)
            seq = self._sequences[key] = _DraftSequence(slot)
        return seq

    def propose(self, batch: list[DraftRequest]) -> list[list[int]]:
        guesses: dict[RequestKey, list[int]] = {r.key: [] for r in batch}
        # pending[key]: tokens to compute next (the catch-up, then each new guess)
        pending: dict[RequestKey, list[int]] = {}
        wanted = {r.key: min(r.num_tokens, self.max_positions - len(r.token_ids)) for r in batch}
        for r in batch:
            seq = self._sequence(r.key)
            keep = min(_common_prefix(seq.cached, r.token_ids), len(r.token_ids) - 1)
            seq.slot.num_computed_tokens = keep
            seq.cached = r.token_ids[:keep]
            if wanted[r.key] > 0:
                pending[r.key] = r.token_ids[keep:]
        while pending:
            step = SchedulerOutput()
            for key, tokens in pending.items():
                seq = self._sequences[key]
                if not self.kv.allocate(seq.slot, len(tokens)):
                    continue  # the draft cache is full: this sequence guesses no further
                row = SampleRow(_GREEDY, [], [], None, [], prepared=_GREEDY_PREPARED)
                step.scheduled.append(
                    ScheduledRequest(key, tokens, seq.slot.num_computed_tokens, self.kv.block_ids(seq.slot), row)
                )
            if not step.scheduled:
                break
            step.scheduled.sort(key=lambda s: not s.is_decode)
            result = self.runner.execute_model(step)
            pending = {}
            for s, sampled in zip(step.scheduled, result.sampled_token_ids):
                seq = self._sequences[s.key]
                seq.slot.num_computed_tokens += s.num_new_tokens
                seq.cached.extend(s.token_ids)
                guesses[s.key].append(sampled[0])
                if len(guesses[s.key]) < wanted[s.key]:
                    pending[s.key] = [sampled[0]]
        return [guesses[r.key] for r in batch]

    def forget(self, key: RequestKey) -> None:
        seq = self._sequences.pop(key, None)
        if seq is not None:
            self.kv.free(seq.slot)
