"""The scheduler's one handle on speculative decoding: what to draft for a
sequence this step, and what to learn from its verification. Cumulative
counters for the vllm:spec_decode_* metrics live here too."""

from __future__ import annotations

from stoker.engine.outputs import RequestKey
from stoker.engine.spec import Proposer
from stoker.engine.spec.ngram import NgramProposer
from stoker.engine.spec.policy import SpeculationPolicy

SPECULATIVE_METHODS = ("auto", "ngram", "none")
MAX_SPECULATIVE_TOKENS = 16


class Speculator:
    def __init__(self, proposer: Proposer, policy: SpeculationPolicy) -> None:
        self.proposer = proposer
        self.policy = policy
        self.num_drafts = 0
        """Verified proposals (cumulative)."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * policy.num_tokens
        """How often the draft token at each position was accepted (cumulative)."""

    @classmethod
    def build(cls, method: str, num_tokens: int, ngram_min: int, ngram_max: int, max_batch: int) -> Speculator | None:
        """None when speculation is off (method none or no tokens)."""
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {method!r}: choose one of {', '.join(SPECULATIVE_METHODS)}")
        if method == "none" or num_tokens == 0:
            return None
        return cls(NgramProposer(ngram_min, ngram_max), SpeculationPolicy(method, num_tokens, max_batch))

    def step_allows(self, num_decoding: int) -> bool:
        return self.policy.step_allows(num_decoding)

    def drafts(self, key: RequestKey, token_ids: list[int], limit: int) -> list[int]:
        """Draft tokens for a decoding sequence, at most `limit` (what its
        max_tokens, the context and the step's token budget leave room for)."""
        k = min(limit, self.policy.num_drafts(key))
        return self.proposer.propose(key, token_ids, k) if k > 0 else []

    def record(self, key: RequestKey, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1
        self.policy.record(key, drafted, accepted)

    def forget(self, key: RequestKey) -> None:
        self.proposer.forget(key)
        self.policy.forget(key)
