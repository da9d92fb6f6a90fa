"""How many draft tokens each sequence gets this step.

A verified draft token costs a row of every matmul; it pays only when it is
accepted often enough and the step is bound by reading weights rather than by
arithmetic. `ngram` always asks for k tokens. `auto` (the default) adapts:

- per sequence, an running acceptance rate decides the draft length (about the
  expected accepted run plus one); a sequence whose guesses keep failing stops
  speculating for a while (doubling each time) and then tries again;
- per step, nothing is drafted while more than `max_batch` sequences decode:
  there a step is compute-bound, so rejected rows cost nearly what they
  weigh (docs/perf/speculative.md has the measurements behind the default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stoker.engine.outputs import RequestKey

_PRIOR_ACCEPTANCE = 0.5
_SMOOTHING = 0.3
"""Weight of the latest step in the running acceptance rate."""
_MIN_ACCEPTANCE = 0.15
_FIRST_PAUSE = 8
_MAX_PAUSE = 256


@dataclass
class _SequenceStats:
    acceptance: float = _PRIOR_ACCEPTANCE
    pause: int = 0
    """Steps left without drafts."""
    next_pause: int = _FIRST_PAUSE


class SpeculationPolicy:
    def __init__(self, method: str, num_tokens: int, max_batch: int) -> None:
        self.method = method
        self.num_tokens = num_tokens
        self.max_batch = max_batch
        self._stats: dict[RequestKey, _SequenceStats] = {}

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_tokens > 0

    def step_allows(self, num_decoding: int) -> bool:
        """Whether this step drafts at all, given how many sequences decode in it."""
        if not self.enabled:
            return False
        return self.method != "auto" or num_decoding <= self.max_batch

    def num_drafts(self, key: RequestKey) -> int:
        if self.method != "auto":
            return self.num_tokens
        stats = self._stats.setdefault(key, _SequenceStats())
        if stats.pause > 0:
            stats.pause -= 1
            return 0
        expected_run = stats.acceptance / max(1e-6, 1.0 - stats.acceptance)
        return max(1, min(self.num_tokens, math.ceil(expected_run) + 1))

    def record(self, key: RequestKey, drafted: int, accepted: int) -> None:
        """A verified proposal: `accepted` of its `drafted` tokens were kept."""
        if drafted <= 0 or self.method != "auto":
            return
        stats = self._stats.setdefault(key, _SequenceStats())
        stats.acceptance += _SMOOTHING * (accepted / drafted - stats.acceptance)
        if stats.acceptance < _MIN_ACCEPTANCE:
            stats.pause = stats.next_pause
            stats.next_pause = min(_MAX_PAUSE, stats.next_pause * 2)
            stats.acceptance = _PRIOR_ACCEPTANCE
        elif accepted == drafted:
            stats.next_pause = _FIRST_PAUSE

    def forget(self, key: RequestKey) -> None:
        self._stats.pop(key, None)
