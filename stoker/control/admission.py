"""Capacity-aware admission: a bounded waiting queue, measured in requests
and in prompt tokens, using the engine's own numbers.

The engine reports what is waiting (EngineStats.num_waiting,
num_waiting_tokens), but a snapshot lags: requests admitted after it was
taken are not in it yet. So the controller adds those "in transit" requests
itself, and forgets each one once a snapshot taken after its admission
arrives (by then the engine counts it as waiting, running or finished).

Beyond the bound the answer is 503 `overloaded` with a Retry-After derived
from the measured drain rate (prompt tokens and requests finished per second
over a recent window): roughly how long until the excess has drained. That
is what tells a client "come back in 3s" rather than a constant guess.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from stoker.engine.params import EngineStats
from stoker.errors import APIError


@dataclass
class Ticket:
    """One admitted request, from admission until the engine sees it."""

    admitted_at: float
    prompt_tokens: int
    visible: bool = False


@dataclass
class QueueView:
    requests: int
    tokens: int


class AdmissionController:
    def __init__(
        self,
        max_queued_requests: int = 256,
        max_queued_tokens: int = 65_536,
        batch_share: float = 0.8,
        drain_window: float = 30.0,
        fallback_retry_after: float = 2.0,
        max_retry_after: float = 60.0,
        clock=time.time,  # type: ignore[no-untyped-def]
    ) -> None:
        if max_queued_requests < 1 or max_queued_tokens < 1:
            raise ValueError("max_queued_requests and max_queued_tokens must be at least 1")
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        # Batch requests may fill only this share of the queue, so a queue full
        # of batch work still admits interactive requests (which jump it anyway).
        self.batch_share = batch_share
        self.drain_window = drain_window
        # Used only until something has finished (no rate measured yet).
        self.fallback_retry_after = fallback_retry_after
        self.max_retry_after = max_retry_after
        self._clock = clock
        self._started = clock()
        self._stats = EngineStats()
        self._transit: deque[Ticket] = deque()
        self._transit_requests = 0
        self._transit_tokens = 0
        self._finished: deque[tuple[float, int]] = deque()  # (time, prompt tokens)
        self._finished_tokens = 0
        self.draining = False

    # -- inputs --------------------------------------------------------------

    def update(self, stats: EngineStats, taken_at: float | None = None) -> None:
        """A fresh engine snapshot; taken_at is when the engine produced it
        (default now). Requests admitted before that are in its numbers."""
        taken_at = taken_at if taken_at is not None else self._clock()
        self._stats = stats
        while self._transit and self._transit[0].admitted_at <= taken_at:
            self._forget(self._transit.popleft())

    def mark_visible(self, ticket: Ticket) -> None:
        """The engine has the request (e.g. it produced output, or it ended)."""
        self._forget(ticket)
        # Drop forgotten tickets from the front so the deque stays short even
        # when snapshots are rare.
        while self._transit and self._transit[0].visible:
            self._transit.popleft()

    def record_finished(self, prompt_tokens: int, now: float | None = None) -> None:
        """A request left the engine; feeds the drain-rate measurement."""
        now = now if now is not None else self._clock()
        self._finished.append((now, prompt_tokens))
        self._finished_tokens += prompt_tokens
        self._trim(now)

    def _forget(self, ticket: Ticket) -> None:
        if not ticket.visible:
            ticket.visible = True
            self._transit_requests -= 1
            self._transit_tokens -= ticket.prompt_tokens

    def _trim(self, now: float) -> None:
        while self._finished and self._finished[0][0] < now - self.drain_window:
            self._finished_tokens -= self._finished.popleft()[1]

    # -- measurements --------------------------------------------------------

    def queue(self) -> QueueView:
        return QueueView(
            self._stats.num_waiting + self._transit_requests,
            self._stats.num_waiting_tokens + self._transit_tokens,
        )

    def drain_rate(self, now: float | None = None) -> tuple[float, float]:
        """(requests/s, prompt tokens/s) finished over the recent window; zeros if unmeasured."""
        now = now if now is not None else self._clock()
        self._trim(now)
        if not self._finished:
            return 0.0, 0.0
        # Over the window, or since start if younger, but at least 1s so one
        # early finish cannot claim an absurd rate.
        span = max(1.0, min(self.drain_window, now - self._started))
        return len(self._finished) / span, self._finished_tokens / span

    def retry_after(self, excess_requests: int, excess_tokens: int, now: float | None = None) -> float:
        req_rate, tok_rate = self.drain_rate(now)
        waits = []
        if excess_requests > 0:
            waits.append(excess_requests / req_rate if req_rate > 0 else math.inf)
        if excess_tokens > 0:
            waits.append(excess_tokens / tok_rate if tok_rate > 0 else math.inf)
        wait = max(waits, default=0.0)
        if math.isinf(wait):
            wait = self.fallback_retry_after
        return min(self.max_retry_after, max(1.0, wait))

    # -- decision ------------------------------------------------------------

    def admit(self, prompt_tokens: int, priority: int = 0) -> Ticket:
        """Admit a request of prompt_tokens or raise APIError(503)."""
        now = self._clock()
        if self.draining:
            raise APIError(
                503,
                "The server is shutting down and accepts no new requests.",
                "overloaded",
                code="draining",
                reason="draining",
                retry_after=self.fallback_retry_after,
            )
        share = 1.0 if priority <= 0 else self.batch_share
        limit_requests = max(1, int(self.max_queued_requests * share))
        limit_tokens = max(1, int(self.max_queued_tokens * share))
        q = self.queue()
        excess_requests = q.requests + 1 - limit_requests
        # An empty queue admits any size (it is bounded by the model's context
        # anyway), or a long prompt could never run.
        excess_tokens = q.tokens + prompt_tokens - limit_tokens if q.requests > 0 else 0
        if excess_requests > 0 or excess_tokens > 0:
            reason = "queue_requests" if excess_requests > 0 else "queue_tokens"
            wait = self.retry_after(excess_requests, excess_tokens, now)
            raise APIError(
                503,
                f"The server is overloaded ({q.requests} requests, {q.tokens} prompt tokens waiting); "
                f"retry after {math.ceil(wait)}s.",
                "overloaded",
                code="overloaded",
                reason=reason,
                retry_after=wait,
            )
        ticket = Ticket(now, prompt_tokens)
        self._transit.append(ticket)
        self._transit_requests += 1
        self._transit_tokens += prompt_tokens
        return ticket
