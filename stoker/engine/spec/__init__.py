"""Speculative decoding: proposers guess a sequence's next tokens and the
ordinary engine step verifies them (stoker/engine/runner.py) — all guesses of
all sequences in one forward pass, beside prefills and plain decodes.

    Proposer.propose([DraftRequest])  -> up to k guesses each  (ngram.py, draft.py)
    SpeculationPolicy.num_drafts(key) -> how many to ask for   (policy.py)
    Speculator                        -> the scheduler's handle (speculator.py)

A proposer only guesses; whether a guess is kept is decided by sampling the
target model at every draft position, so output is exactly what decoding
without speculation gives (greedy: the same tokens; sampled: the same
distribution, and the same tokens for the same seed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from stoker.engine.outputs import RequestKey


@dataclass(frozen=True)
class DraftRequest:
    """One decoding sequence asking for guesses this step."""

    key: RequestKey
    token_ids: list[int]
    """The sequence so far (prompt and output)."""
    num_tokens: int
    """Most guesses wanted."""


class Proposer(Protocol):
    """Guesses continuations of sequences, keeping whatever per-sequence state it needs."""

    def propose(self, batch: list[DraftRequest]) -> list[list[int]]:
        """Per request, up to num_tokens tokens likely to follow its token_ids ([] for no guess)."""
        ...

    def forget(self, key: RequestKey) -> None:
        """The sequence left the engine (finished, aborted): drop its state."""
        ...
