"""How many draft tokens each sequence gets this step.

A verified draft token costs a row of every matmul; it pays only when it is
accepted often enough. `ngram` and `draft` always ask for k tokens. `auto`
(the default) adapts:

- per sequence, a running estimate of the chance that each next guess is
  accepted (accepted guesses over verified positions up to the first
  rejection, so a long draft does not bias it down);
- the draft length that gives the most expected tokens per unit of step time,
  from what steps of 1 .. k + 1 rows cost on this machine (measured once at
  start, `row_costs`): on a CPU, rows beyond the first few cost nearly what
  they weigh, so two or three good guesses beat four mediocre ones;
- a sequence whose guesses keep failing stops speculating for a while
  (doubling each time) and then tries again;
- per step, nothing is drafted while more than `max_batch` sequences decode:
  there the step is compute-bound and every rejected row is a loss
  (docs/perf/speculative.md has the measurements behind the defaults).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from stoker.engine.outputs import RequestKey

_PRIOR_ACCEPTANCE = 0.5
_DECAY = 0.7
"""Weight of the past in the running acceptance counts."""
_MIN_ACCEPTANCE = 0.15
_FIRST_PAUSE = 8
_MAX_PAUSE = 256


@dataclass
class _SequenceStats:
    accepted: float = _PRIOR_ACCEPTANCE
    trials: float = 1.0
    pause: int = 0
    """Steps left without drafts."""
    next_pause: int = _FIRST_PAUSE

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials


def row_costs(run_rows: Callable[[int], object], max_rows: int, repeats: int = 5) -> list[float]:
    """Seconds a step of r decode rows of one sequence takes, r = 1 .. max_rows
    (index r - 1). After one unmeasured run of each, the counts take turns
    `repeats` times and each keeps its best: a burst of other work on the
    machine (another engine loading, the front end starting) then spoils one
    run of every count rather than all runs of one. And since a step of more
    rows does the work of one of fewer and more, no cost is kept below the
    one before it (measured on a busy machine, 15.0 15.8 19.4 15.8 15.0 ms for
    1..5 rows would have made 4 and 5 rows look free)."""
    for rows in range(1, max_rows + 1):
        run_rows(rows)
    costs = [float("inf")] * max_rows
    for _ in range(repeats):
        for rows in range(1, max_rows + 1):
            started = time.perf_counter()
            run_rows(rows)
            costs[rows - 1] = min(costs[rows - 1], time.perf_counter() - started)
    for i in range(1, max_rows):
        costs[i] = max(costs[i], costs[i - 1])
    return costs


def best_draft_length(acceptance: float, costs: list[float], most: int) -> int:
    """The k in 1 .. most with the most expected tokens per second: a step
    with k guesses yields 1 + a + a^2 + ... + a^k tokens (a = acceptance)
    and costs costs[k] (k + 1 rows)."""
    best_k, best_rate = 1, 0.0
    expected, term = 1.0, 1.0
    for k in range(1, min(most, len(costs) - 1) + 1):
        term *= acceptance
        expected += term
        rate = expected / costs[k]
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


class SpeculationPolicy:
    def __init__(self, method: str, num_tokens: int, max_batch: int) -> None:
        self.method = method
        self.num_tokens = num_tokens
        self.max_batch = max_batch
        self.costs: list[float] = []
        """Step seconds by rows (row_costs); empty: unknown, draft about the expected accepted run."""
        self._stats: dict[RequestKey, _SequenceStats] = {}

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_tokens > 0

    @property
    def adaptive(self) -> bool:
        return self.method == "auto"

    def step_allows(self, num_decoding: int) -> bool:
        """Whether this step drafts at all, given how many sequences decode in it."""
        if not self.enabled:
            return False
        return not self.adaptive or num_decoding <= self.max_batch

    def num_drafts(self, key: RequestKey) -> int:
        if not self.adaptive:
            return self.num_tokens
        stats = self._stats.setdefault(key, _SequenceStats())
        if stats.pause > 0:
            stats.pause -= 1
            return 0
        a = stats.acceptance
        if len(self.costs) > 1:
            return best_draft_length(a, self.costs, self.num_tokens)
        expected_run = a / max(1e-6, 1.0 - a)
        return max(1, min(self.num_tokens, int(expected_run) + 1))

    def record(self, key: RequestKey, drafted: int, accepted: int) -> None:
        """A verified proposal: `accepted` of its `drafted` tokens were kept."""
        if drafted <= 0 or not self.adaptive:
            return
        stats = self._stats.setdefault(key, _SequenceStats())
        # Positions tried: every accepted guess, and the first rejected one.
        trials = accepted + (1 if accepted < drafted else 0)
        stats.accepted = _DECAY * stats.accepted + accepted
        stats.trials = _DECAY * stats.trials + trials
        if stats.acceptance < _MIN_ACCEPTANCE:
            stats.pause = stats.next_pause
            stats.next_pause = min(_MAX_PAUSE, stats.next_pause * 2)
            stats.accepted, stats.trials = _PRIOR_ACCEPTANCE, 1.0
        elif accepted == drafted:
            stats.next_pause = _FIRST_PAUSE

    def forget(self, key: RequestKey) -> None:
        self._stats.pop(key, None)
