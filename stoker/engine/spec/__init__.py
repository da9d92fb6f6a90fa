"""Speculative decoding: proposers guess a sequence's next tokens and the
ordinary engine step verifies them (stoker/engine/runner.py) — all guesses of
all sequences in one forward pass, beside prefills and plain decodes.

    Proposer.propose(key, token_ids, k) -> up to k draft tokens   (ngram.py)
    SpeculationPolicy.num_drafts(...)    -> how many to ask for    (policy.py)

A proposer only guesses; whether a guess is kept is decided by sampling the
target model at every draft position, so output is exactly what decoding
without speculation gives (greedy: the same tokens; sampled: the same
distribution, and the same tokens for the same seed).
"""

from __future__ import annotations

from typing import Protocol

from stoker.engine.outputs import RequestKey


class Proposer(Protocol):
    """Guesses continuations of sequences, keeping whatever per-sequence state it needs."""

    def propose(self, key: RequestKey, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `token_ids` (the sequence so far); [] for no guess."""
        ...

    def forget(self, key: RequestKey) -> None:
        """The sequence left the engine (finished, aborted): drop its state."""
        ...
