"""Prompt lookup (n-gram) proposals: if the sequence's last n tokens occurred
before, in its prompt or its own output, guess that what followed them then
follows now. Pays where answers repeat their context: quoting, extraction,
code edits, summaries with citations. No model, no extra memory beyond an
index per sequence.
"""

from __future__ import annotations

from stoker.engine.outputs import RequestKey
from stoker.engine.spec import DraftRequest


class _SequenceIndex:
    """For each n-gram of the sequence (min_n <= n <= max_n) the position just
    after its latest occurrence that has a successor. Built incrementally: each
    new token adds max_n - min_n + 1 entries, so a step costs O(1) per sequence
    however long the context is."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.indexed = 0
        """Tokens whose successor entries are in `following`."""
        self.following: dict[tuple[int, ...], int] = {}

    def catch_up(self, token_ids: list[int]) -> None:
        # Position p gets a successor once token p + 1 exists: index up to len - 1.
        for end in range(self.indexed, len(token_ids) - 1):
            for n in range(self.min_n, self.max_n + 1):
                if end + 1 >= n:
                    self.following[tuple(token_ids[end + 1 - n : end + 1])] = end + 1
        self.indexed = max(self.indexed, len(token_ids) - 1)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        self.catch_up(token_ids)
        for n in range(min(self.max_n, len(token_ids)), self.min_n - 1, -1):
            start = self.following.get(tuple(token_ids[len(token_ids) - n :]))
            if start is not None:
                return token_ids[start : start + k]
        return []


class NgramProposer:
    """Longest match first: an n of max_n that matches predicts better than a shorter one."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got min {min_n}, max {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[RequestKey, _SequenceIndex] = {}

    def propose(self, batch: list[DraftRequest]) -> list[list[int]]:
        return [self.propose_one(r.key, r.token_ids, r.num_tokens) for r in batch]

    def propose_one(self, key: RequestKey, token_ids: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = _SequenceIndex(self.min_n, self.max_n)
        return index.propose(token_ids, k)

    def forget(self, key: RequestKey) -> None:
        self._indexes.pop(key, None)
