"""What a million tokens costs, from the machine's price and measured throughput.

`--cost-per-hour DOLLARS` is the price of the machine. Over a sliding window
(COST_WINDOW_SECONDS) the meter follows, per model, the prompt tokens
computed, the tokens generated and the seconds its engine spent in steps.
Each model is charged the machine's price for the window in proportion to
its share of the engines' busy time (when no engine was busy, in proportion
to tokens), idle time included: an idle machine costs money too, so a
lightly used model's tokens are dear. Then

    cost per 1M generated tokens = model's charge / generated tokens x 1e6
    cost per 1M prompt tokens    = model's charge / prompt tokens x 1e6

Each is the price if that kind of token paid for everything, as providers
quote "$ per 1M output tokens" for a throughput; they do not add up. At
saturation, with one model, the generation figure equals what `stoker bench
serve --cost-per-hour` derives from its measured output throughput.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

COST_WINDOW_SECONDS = 60.0


@dataclass(frozen=True)
class _Sample:
    at: float
    prompt_tokens: int
    generation_tokens: int
    busy_seconds: float


def cost_per_million(cost_per_hour: float, tokens_per_second: float) -> float | None:
    """Dollars per 1M tokens at a sustained throughput (None: no throughput)."""
    if tokens_per_second <= 0:
        return None
    return cost_per_hour / (tokens_per_second * 3600.0) * 1e6


class CostMeter:
    def __init__(
        self, cost_per_hour: float, window: float = COST_WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.cost_per_hour = cost_per_hour
        self.window = window
        self._clock = clock
        self._started = clock()
        self._samples: dict[str, deque[_Sample]] = {}

    def add(self, model: str, prompt_tokens: int, generation_tokens: int, busy_seconds: float) -> None:
        """Growth of a model's counters since the last call (any engine of it)."""
        if prompt_tokens <= 0 and generation_tokens <= 0 and busy_seconds <= 0:
            return
        self._samples.setdefault(model, deque()).append(
            _Sample(self._clock(), prompt_tokens, generation_tokens, busy_seconds)
        )

    def forget(self, model: str) -> None:
        self._samples.pop(model, None)

    def costs(self) -> dict[str, dict[str, float]]:
        """{model: {"prompt": $/1M, "generation": $/1M}} for the kinds seen in the window."""
        now = self._clock()
        totals: dict[str, tuple[int, int, float]] = {}
        for model, samples in self._samples.items():
            while samples and samples[0].at < now - self.window:
                samples.popleft()
            totals[model] = (
                sum(s.prompt_tokens for s in samples),
                sum(s.generation_tokens for s in samples),
                sum(s.busy_seconds for s in samples),
            )
        busy = sum(t[2] for t in totals.values())
        tokens = sum(t[0] + t[1] for t in totals.values())
        span = min(self.window, max(now - self._started, 1e-9))
        machine = self.cost_per_hour * span / 3600.0
        out: dict[str, dict[str, float]] = {}
        for model, (prompt, generated, seconds) in totals.items():
            share = seconds / busy if busy > 0 else ((prompt + generated) / tokens if tokens else 0.0)
            charge = machine * share
            kinds = {"prompt": prompt, "generation": generated}
            out[model] = {kind: charge / n * 1e6 for kind, n in kinds.items() if n > 0}
        return out
