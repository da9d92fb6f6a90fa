"""Per-key rate limits: requests/min and tokens/min token buckets, plus a cap
on concurrent requests (a request holds one slot per prompt it carries: each
is a request to the engine, as if sent alone).

A request's token cost is not known until it ends, so admission takes its
estimate (control/cost.py: prompt tokens + prompts x n x max_tokens, the most
it can be billed) and the lease reconciles it with the real count at the
end, refunding what was not used. A request is admitted only when the bucket
holds its whole estimate, so the bucket never goes into debt at admission;
one whose estimate is above the per-minute limit itself could never be
admitted and is refused as too large (429, no Retry-After, as OpenAI's
"Request too large for tokens per min"), naming the limit and the estimate.

Two limiters keep these semantics behind one protocol (`Limiter`), chosen at
start: `RateLimiter` here keeps its state in the server process, touched only
from its event loop, so no locks (one replica); `RedisRateLimiter`
(control/store.py, --redis-url) keeps it in Redis behind atomic scripts, so
replicas sharing one Redis enforce a key's limits together.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from stoker.control.keys import ApiKey
from stoker.errors import APIError


def concurrency_exceeded(key: ApiKey, headers: dict[str, str], slots: int = 1) -> APIError:
    """The 429 for a key at its concurrent-request cap (both limiters answer it alike)."""
    counted = f"; this request counts as {slots}, one per prompt" if slots > 1 else ""
    return APIError(
        429,
        f"Too many concurrent requests for this key (limit {key.max_concurrent}{counted}).",
        "rate_limit_exceeded",
        code="rate_limit_exceeded",
        reason="concurrency",
        headers=headers,
        # The wait depends on running requests we cannot predict; 1s is the shortest honest hint.
        retry_after=1,
    )


def rate_exceeded(
    kind: str, limit: int | None, estimated_tokens: int, wait: float, headers: dict[str, str]
) -> APIError:
    """The 429 for an empty requests (kind "requests") or tokens bucket."""
    return APIError(
        429,
        f"Rate limit reached for {kind} per minute (limit {limit}); "
        f"this request needs {1 if kind == 'requests' else estimated_tokens}. "
        f"Retry after {wait:.1f}s.",
        "rate_limit_exceeded",
        code="rate_limit_exceeded",
        reason=kind,
        headers=headers,
        retry_after=wait,
    )


def too_many_prompts(key: ApiKey, slots: int, headers: dict[str, str]) -> APIError:
    """The 429 for a request of more prompts than the key may have requests in flight:
    no wait would admit it, so it carries no Retry-After."""
    return APIError(
        429,
        f"Request too large for this key's concurrent requests: Limit {key.max_concurrent}, Requested {slots} "
        "(one per prompt). Send fewer prompts in one request.",
        "rate_limit_exceeded",
        code="rate_limit_exceeded",
        reason="concurrency",
        headers=headers,
    )


def too_large(limit: int, estimated_tokens: int, headers: dict[str, str]) -> APIError:
    """The 429 for a request whose estimate is above the key's tokens-per-minute limit:
    no wait would admit it, so it carries no Retry-After."""
    return APIError(
        429,
        f"Request too large for tokens per minute (tpm): Limit {limit}, Requested {estimated_tokens} "
        "(its prompt tokens plus prompts x n x max_tokens). Lower max_tokens, n or the number of prompts.",
        "rate_limit_exceeded",
        code="rate_limit_exceeded",
        reason="tokens",
        headers=headers,
    )


class TokenBucket:
    """capacity tokens, refilled continuously at capacity per `period` seconds."""

    def __init__(self, capacity: float, period: float = 60.0, now: float | None = None) -> None:
        self.capacity = float(capacity)
        self.rate = self.capacity / period
        self.tokens = self.capacity
        self.updated = now if now is not None else time.monotonic()

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def wait_time(self, cost: float, now: float) -> float:
        """Seconds until take(cost) would succeed (0 if now; never for a cost above the capacity)."""
        self.refill(now)
        if cost > self.capacity:
            return math.inf
        missing = cost - self.tokens
        return max(0.0, missing / self.rate)

    def take(self, cost: float, now: float) -> bool:
        self.refill(now)
        if self.tokens + 1e-9 < cost:
            return False
        self.tokens -= cost
        return True

    def give(self, amount: float, now: float) -> None:
        """Return unused tokens (or, with a negative amount, charge more)."""
        self.refill(now)
        self.tokens = min(self.capacity, self.tokens + amount)

    def reset_time(self, now: float) -> float:
        """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        self.refill(now)
        return max(0.0, (self.capacity - self.tokens) / self.rate)


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1.5s", "6m0s", "1h2m3s"."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    total = math.ceil(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"


@dataclass
class KeyState:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0
    limits: tuple[int | None, int | None] = (None, None)


@dataclass
class Lease:
    """What one admitted request holds against its key's limits."""

    key_id: str | None
    estimated_tokens: int
    headers: dict[str, str] = field(default_factory=dict)
    """x-ratelimit-* headers to send with the response."""
    done: bool = False
    store_id: str | None = None
    """The lease's id in a shared store (its concurrency reservation there); None in process."""
    slots: int = 1
    """Concurrency slots it holds: one per prompt (each is one request to the engine)."""


class Limiter(Protocol):
    """What the request gate needs from a rate limiter."""

    async def acquire(self, key: ApiKey | None, estimated_tokens: int, slots: int = 1) -> Lease:
        """Take one request and estimated_tokens from the key's limits and `slots` concurrency
        slots (one per prompt), or raise APIError: 429 (the key's quota), 503 (the limits
        cannot be checked)."""
        ...

    def release(self, lease: Lease, actual_tokens: int | None) -> None:
        """End a lease (idempotent): give back the concurrency slot and reconcile the
        estimate with actual_tokens; None means the request never ran: refund it all."""
        ...

    async def aclose(self) -> None:
        """Let pending releases land and stop background work (at shutdown)."""
        ...


class RateLimiter:
    """The in-process Limiter (one replica)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._state: dict[str, KeyState] = {}

    def _get(self, key: ApiKey, now: float) -> KeyState:
        state = self._state.get(key.id)
        limits = (key.rpm, key.tpm)
        if state is None or state.limits != limits:
            # New key, or its limits were changed: start from full buckets.
            in_flight = state.in_flight if state else 0
            state = KeyState(
                requests=TokenBucket(key.rpm, now=now) if key.rpm else None,
                tokens=TokenBucket(key.tpm, now=now) if key.tpm else None,
                in_flight=in_flight,
                limits=limits,
            )
            self._state[key.id] = state
        return state

    def headers(self, key: ApiKey, now: float | None = None) -> dict[str, str]:
        now = now if now is not None else self._clock()
        state = self._get(key, now)
        out: dict[str, str] = {}
        for kind, bucket in (("requests", state.requests), ("tokens", state.tokens)):
            if bucket is None:
                continue
            bucket.refill(now)
            out[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.tokens)))
            out[f"x-ratelimit-reset-{kind}"] = format_duration(bucket.reset_time(now))
        return out

    async def acquire(self, key: ApiKey | None, estimated_tokens: int, slots: int = 1) -> Lease:
        return self.acquire_now(key, estimated_tokens, slots)

    def acquire_now(self, key: ApiKey | None, estimated_tokens: int, slots: int = 1) -> Lease:
        """Take one request and estimated_tokens from the key's buckets, or
        raise APIError(429) saying how long to wait (or that no wait would do)."""
        if key is None:
            return Lease(None, estimated_tokens, slots=slots)
        now = self._clock()
        state = self._get(key, now)
        if key.tpm and estimated_tokens > key.tpm:
            raise too_large(key.tpm, estimated_tokens, self.headers(key, now))
        if key.max_concurrent is not None and slots > key.max_concurrent:
            raise too_many_prompts(key, slots, self.headers(key, now))
        if key.max_concurrent is not None and state.in_flight + slots > key.max_concurrent:
            raise concurrency_exceeded(key, self.headers(key, now), slots)
        waits = []
        if state.requests is not None:
            waits.append(("requests", state.requests.wait_time(1, now), key.rpm))
        if state.tokens is not None:
            waits.append(("tokens", state.tokens.wait_time(estimated_tokens, now), key.tpm))
        blocking = [(kind, wait, limit) for kind, wait, limit in waits if wait > 0]
        if blocking:
            kind, wait, limit = max(blocking, key=lambda w: w[1])
            raise rate_exceeded(kind, limit, estimated_tokens, wait, self.headers(key, now))
        if state.requests is not None:
            state.requests.take(1, now)
        if state.tokens is not None:
            state.tokens.take(estimated_tokens, now)
        state.in_flight += slots
        return Lease(key.id, estimated_tokens, headers=self.headers(key, now), slots=slots)

    def release(self, lease: Lease, actual_tokens: int | None) -> None:
        """End a lease. actual_tokens=None means the request never ran: refund
        everything, the request itself included."""
        if lease.done or lease.key_id is None:
            lease.done = True
            return
        lease.done = True
        state = self._state.get(lease.key_id)
        if state is None:
            return
        now = self._clock()
        state.in_flight = max(0, state.in_flight - lease.slots)
        if actual_tokens is None:
            if state.requests is not None:
                state.requests.give(1, now)
            if state.tokens is not None:
                state.tokens.give(lease.estimated_tokens, now)
        elif state.tokens is not None:
            state.tokens.give(lease.estimated_tokens - actual_tokens, now)

    async def aclose(self) -> None:
        return None

    def in_flight(self, key_id: str) -> int:
        state = self._state.get(key_id)
        return state.in_flight if state else 0
