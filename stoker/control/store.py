"""RedisRateLimiter: the per-key limits of control/limits.py kept in Redis, so
several replicas sharing one Redis enforce a key's rpm, tpm and concurrency
together (--redis-url).

Each check-and-take is one Lua script, atomic in Redis: no read-modify-write
race between replicas. Time is Redis's own clock (TIME inside the script), so
replicas with skewed clocks agree; tests may inject a clock instead.

Per API key, under one hash tag (one cluster slot):
  stoker:{<key id>}:requests   hash: tokens, updated, sig   the requests/min bucket
  stoker:{<key id>}:tokens     hash: tokens, updated, sig   the tokens/min bucket
  stoker:{<key id>}:leases     sorted set: lease id -> expiry time   requests in flight
A bucket expires once it would be full again (absent = full); `sig` is the
key's limits, so changed limits start from full buckets, as in process.

Concurrency is a set of expiring leases, not a counter: the replica holding
a lease renews it every third of its TTL while the request runs, so the slots
of a replica that dies free themselves within the TTL. A release that cannot
reach Redis leaves the slot to expire the same way and the estimate charged.

Redis unreachable: fail closed (503 + Retry-After) by default, or with
on_store_failure="open" admit without limits, logging the outage once; the
client reconnects by itself on the next call. Every failed call is counted
(count_failure, stoker:store_failures_total{store="redis"}), since in open
mode nothing else shows the outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from stoker.control.keys import ApiKey
from stoker.control.limit_scripts import ACQUIRE, RELEASE, RENEW
from stoker.control.limits import (
    Lease,
    concurrency_exceeded,
    format_duration,
    rate_exceeded,
    too_large,
    too_many_prompts,
)
from stoker.errors import APIError, StartupRefused
from stoker.redact import redact_url

log = logging.getLogger("stoker.control.store")

PERIOD = 60.0
# A request waits at most about this long on an unreachable Redis before its 503.
SOCKET_TIMEOUT = 1.0
STORE_RETRY_AFTER = 2.0
MAX_CONNECTIONS = 16
# Longest wait for a free connection under a burst before the request gets its 503.
POOL_WAIT = 5.0


def check_redis_url(url: str, timeout: float = 3.0) -> None:
    """Refuse to start (StartupRefused, one line naming the flag) on a malformed
    or unreachable URL."""
    shown = redact_url(url)
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise StartupRefused(
            f"--redis-url {shown}: not a Redis URL (redis://HOST:PORT/DB, rediss://... or unix://PATH)"
        )
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    except ValueError as exc:
        raise StartupRefused(f"--redis-url {shown}: {exc}") from None
    try:
        client.ping()
    except redis.RedisError as exc:
        raise StartupRefused(f"--redis-url {shown}: cannot reach Redis ({exc})") from None
    finally:
        client.close()


@dataclass
class _Held:
    """A lease this replica holds in Redis, renewed until released."""

    leases_key: str
    limits: tuple[int, int]


class RedisRateLimiter:
    """The Limiter of several replicas: same semantics as RateLimiter, state in Redis."""

    def __init__(
        self,
        url: str,
        *,
        on_failure: Literal["closed", "open"] = "closed",
        lease_ttl: float = 30.0,
        clock: Callable[[], float] | None = None,
        prefix: str = "stoker",
        count_failure: Callable[[str], None] | None = None,
        socket_timeout: float = SOCKET_TIMEOUT,
    ) -> None:
        self.url = url
        self.count_failure = count_failure
        """Called with the operation ("acquire", "release", "renew") of each call that failed."""
        self.on_failure = on_failure
        self.lease_ttl = lease_ttl
        self.prefix = prefix
        self._clock = clock
        # A burst of requests waits for one of a few connections (Redis runs the
        # scripts one at a time anyway) rather than failing when a pool runs out.
        # One quick retry on a fresh connection (a pooled one may be stale after a
        # Redis restart), then fail: a request must not hang on a dead store.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=POOL_WAIT,
            socket_connect_timeout=socket_timeout,
            socket_timeout=socket_timeout,
            retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), 1),
            health_check_interval=10,
        )
        self._redis = aioredis.Redis.from_pool(pool)
        self._acquire = self._redis.register_script(ACQUIRE)
        self._release = self._redis.register_script(RELEASE)
        self._renew = self._redis.register_script(RENEW)
        self._held: dict[str, _Held] = {}
        self._pending: set[asyncio.Task[None]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self.unreachable_since: float | None = None
        """time.time() of the first failure of the current outage; None while Redis answers."""

    def _now_arg(self) -> str:
        return "" if self._clock is None else repr(self._clock())

    def _keys(self, key_id: str) -> list[str]:
        base = f"{self.prefix}:{{{key_id}}}"
        return [f"{base}:requests", f"{base}:tokens", f"{base}:leases"]

    # -- acquire ---------------------------------------------------------------------

    async def acquire(self, key: ApiKey | None, estimated_tokens: int, slots: int = 1) -> Lease:
        if key is None:
            return Lease(None, estimated_tokens, slots=slots)
        rpm, tpm = key.rpm or 0, key.tpm or 0
        lease_id = f"{uuid.uuid4().hex}.{slots}"  # the script reads the slots a lease holds from its id
        keys = self._keys(key.id)
        args: list[str | int] = [self._now_arg(), rpm, tpm, key.max_concurrent or 0, estimated_tokens, lease_id]
        args += [repr(self.lease_ttl), f"{rpm}:{tpm}", repr(PERIOD), slots]
        try:
            raw = await self._acquire(keys=keys, args=args)
        except redis.RedisError as exc:
            self._count("acquire")
            return self._store_failed(key, estimated_tokens, exc)
        self._store_answered()
        outcome, wait, _in_flight, *buckets = (v.decode() if isinstance(v, bytes) else str(v) for v in raw)
        headers = _headers(buckets)
        if outcome == "too_large":
            raise too_large(tpm, estimated_tokens, headers)
        if outcome == "too_many_prompts":
            raise too_many_prompts(key, slots, headers)
        if outcome == "concurrency":
            raise concurrency_exceeded(key, headers, slots)
        if outcome != "ok":
            limit = key.rpm if outcome == "requests" else key.tpm
            raise rate_exceeded(outcome, limit, estimated_tokens, float(wait), headers)
        self._held[lease_id] = _Held(keys[2], (rpm, tpm))
        self._ensure_renewer()
        return Lease(key.id, estimated_tokens, headers=headers, store_id=lease_id, slots=slots)

    def _store_failed(self, key: ApiKey, estimated_tokens: int, exc: Exception) -> Lease:
        first = self.unreachable_since is None
        if first:
            self.unreachable_since = time.time()
        if self.on_failure == "open":
            if first:
                log.error(
                    "Redis at %s unreachable (%s): admitting requests WITHOUT rate limits (--on-store-failure open)",
                    redact_url(self.url),
                    exc,
                )
            return Lease(key.id, estimated_tokens)
        if first:
            log.error(
                "Redis at %s unreachable (%s): refusing requests with 503 until it answers", redact_url(self.url), exc
            )
        raise APIError(
            503,
            # No "rate limit" in the words: LiteLLM proxy reads any error saying so as
            # a 429 (the client's quota), whatever the status (docs/routers.md).
            "The store of request limits is unreachable; please retry shortly.",
            "service_unavailable",
            code="store_unavailable",
            reason="store_unavailable",
            retry_after=STORE_RETRY_AFTER,
        )

    def _count(self, operation: str) -> None:
        if self.count_failure is not None:
            self.count_failure(operation)

    def _store_answered(self) -> None:
        if self.unreachable_since is not None:
            log.warning(
                "Redis at %s answers again after %.1f s", redact_url(self.url), time.time() - self.unreachable_since
            )
            self.unreachable_since = None

    # -- release and renewal -------------------------------------------------------------

    def release(self, lease: Lease, actual_tokens: int | None) -> None:
        """Idempotent; the Redis update runs in the background (await settle() to wait for it)."""
        if lease.done:
            return
        lease.done = True
        if lease.key_id is None or lease.store_id is None:
            return  # open mode, or admitted while Redis was down: nothing held there
        held = self._held.pop(lease.store_id, None)
        if held is None:
            return
        rpm, tpm = held.limits
        refund_request = actual_tokens is None
        give = lease.estimated_tokens - (actual_tokens or 0)
        keys = self._keys(lease.key_id)
        args: list[str | int] = [self._now_arg(), rpm, tpm, lease.store_id, int(refund_request), give]
        args += [f"{rpm}:{tpm}", repr(PERIOD)]
        task = asyncio.get_running_loop().create_task(self._run_release(keys, args))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _run_release(self, keys: list[str], args: list[str | int]) -> None:
        try:
            await self._release(keys=keys, args=args)
        except redis.RedisError as exc:
            self._count("release")
            log.warning("could not release a lease in Redis (%s); its slot expires within %.0f s", exc, self.lease_ttl)

    def _ensure_renewer(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_loop())

    async def _renew_loop(self) -> None:
        while self._held:
            await asyncio.sleep(self.lease_ttl / 3)
            await self.renew()

    async def renew(self) -> None:
        """Push back the expiry of every lease this replica holds (one pipelined round trip)."""
        if not self._held:
            return
        now = self._now_arg()
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for lease_id, held in list(self._held.items()):
                    await self._renew(keys=[held.leases_key], args=[now, lease_id, repr(self.lease_ttl)], client=pipe)
                await pipe.execute()
        except redis.RedisError as exc:
            self._count("renew")
            log.warning("could not renew %d leases in Redis (%s)", len(self._held), exc)

    # -- inspection and shutdown -----------------------------------------------------------

    async def in_flight(self, key_id: str) -> int:
        """Concurrency slots a key's unexpired leases hold, across every replica."""
        leases = self._keys(key_id)[2]
        now = self._clock() if self._clock is not None else await self._server_time()
        members = await self._redis.zrangebyscore(leases, f"({now!r}", "+inf")
        return sum(_slots(m.decode() if isinstance(m, bytes) else str(m)) for m in members)

    async def _server_time(self) -> float:
        seconds, micros = await self._redis.time()
        return seconds + micros / 1e6

    async def settle(self) -> None:
        """Wait until every release started so far has reached Redis (or failed)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def aclose(self) -> None:
        await self.settle()
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        await self._redis.aclose()


def _slots(lease_id: str) -> int:
    """The slots a lease holds, from its id ('<hex>.<slots>'; an id without them holds one)."""
    _, _, slots = lease_id.rpartition(".")
    return int(slots) if slots.isdigit() and "." in lease_id else 1


def _headers(buckets: list[str]) -> dict[str, str]:
    """x-ratelimit-* from the script's per-bucket capacity, tokens, seconds to full."""
    out: dict[str, str] = {}
    for i, kind in enumerate(("requests", "tokens")):
        capacity, tokens, reset = buckets[3 * i : 3 * i + 3]
        if capacity == "":
            continue
        out[f"x-ratelimit-limit-{kind}"] = str(int(float(capacity)))
        out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(float(tokens))))
        out[f"x-ratelimit-reset-{kind}"] = format_duration(max(0.0, float(reset)))
    return out
