"""The step loop's messages (vLLM v1's shape).

    Scheduler.schedule()            -> SchedulerOutput     what to compute this step
    ModelRunner.execute_model(...)  -> ModelRunnerOutput   what the model sampled
    Scheduler.update_from_output(SchedulerOutput, ModelRunnerOutput)
                                    -> list[EngineCoreOutput]

The runner sees only these messages: token ids, positions, block tables and
sampling rows, never a Request or the KV cache manager. Request progress
(num_computed_tokens, appended tokens, prefix-cache hashing, finishing) moves
forward in exactly one place, Scheduler.update_from_output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stoker.engine.params import TokenLogprob
from stoker.engine.sampler import SampleRow
from stoker.models.lora import LoraAdapter

RequestKey = tuple[str, int]
"""(request_id, sample index): one sequence. n > 1 gives n keys per request_id."""


@dataclass(frozen=True)
class ScheduledRequest:
    """One sequence's share of a step: compute `token_ids` at positions
    `num_computed_tokens ..`, writing their KV through `block_ids`."""

    key: RequestKey
    token_ids: list[int]
    """The tokens to compute this step: a prefill chunk, or the one decode token
    followed by num_draft_tokens speculative guesses to verify."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache, prefix-cache hits included:
    the position of token_ids[0]."""
    block_ids: list[int]
    """The sequence's block table, covering every position up to the end of this chunk."""
    sampling: SampleRow | None
    """Set when the chunk reaches the end of the sequence: its last token's
    logits are sampled with these settings."""
    num_prompt_logprobs: int | None = None
    """Set for a prompt_logprobs request while this chunk predicts prompt tokens:
    the runner scores each of them, with this many top alternatives."""
    prompt_logprob_targets: list[int] = field(default_factory=list)
    """The prompt tokens this chunk predicts: position num_computed_tokens + i
    predicts prompt_logprob_targets[i] (prompt token num_computed_tokens + 1 + i)."""
    num_draft_tokens: int = 0
    """Speculative tokens at the end of token_ids (stoker/engine/spec/): each
    position is sampled, and the runner keeps the drafts up to the first that
    the target model's own sample disagrees with, plus that sample."""
    draft_bitmasks: list[torch.Tensor] = field(default_factory=list)
    """For a grammar-constrained sequence with drafts: the mask of each position
    after the first (the first's is sampling.token_bitmask), draft_bitmasks[j]
    being the grammar's next-token mask once drafts 0 .. j are consumed."""
    lora: LoraAdapter | None = None
    """The LoRA adapter its rows (drafts included) run with; None: the base model."""

    @property
    def request_id(self) -> str:
        return self.key[0]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def samples(self) -> bool:
        return self.sampling is not None

    @property
    def is_decode(self) -> bool:
        """One token to compute after the cache (plus drafts): attention runs it,
        and each draft, as a decode row of its own position."""
        return self.num_new_tokens - self.num_draft_tokens == 1

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    """Decodes (one new token, perhaps with drafts) first, then prefill chunks."""
    preempted: list[RequestKey] = field(default_factory=list)
    """Sequences preempted while scheduling this step (freed; they recompute later)."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class ModelRunnerOutput:
    """What the model produced for one SchedulerOutput."""

    sampled_keys: list[RequestKey] = field(default_factory=list)
    """The sequences that sampled, in the SchedulerOutput's order."""
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    """Per sampled sequence, its new tokens: the accepted drafts (if any) and
    then the target model's own sample, so always at least one."""
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    """Per sampled sequence, one entry per sampled token (None: not asked for)."""
    prompt_logprobs: dict[RequestKey, list[TokenLogprob]] = field(default_factory=dict)
    """Per prompt_logprobs sequence, the logprobs of the prompt tokens this step's
    chunk predicts, in prompt order (prompt token i from position i - 1's logits)."""
