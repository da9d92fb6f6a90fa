"""The scheduler's one handle on speculative decoding: what to draft for a
sequence this step, and what to learn from its verification. Cumulative
counters for the vllm:spec_decode_* metrics live here too."""

from __future__ import annotations

from stoker.engine.outputs import RequestKey
from stoker.engine.spec import DraftRequest, Proposer
from stoker.engine.spec.policy import SpeculationPolicy


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

    def step_allows(self, num_decoding: int) -> bool:
        return self.policy.step_allows(num_decoding)

    def drafts(self, wanted: list[tuple[RequestKey, list[int], int]]) -> dict[RequestKey, list[int]]:
        """Guesses for decoding sequences, given as (key, tokens so far, limit):
        at most `limit` each (what its max_tokens and the context leave room
        for), fewer where the policy says so. One proposer call for the step,
        so a draft model runs the sequences as one batch."""
        batch = []
        for key, token_ids, limit in wanted:
            k = min(limit, self.policy.num_drafts(key))
            if k > 0:
                batch.append(DraftRequest(key, token_ids, k))
        if not batch:
            return {}
        return {r.key: drafts for r, drafts in zip(batch, self.proposer.propose(batch)) if drafts}

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
