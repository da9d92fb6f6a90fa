"""Rate limits in Redis (--redis-url) against a real redis-server: the same
semantics as the in-process limiter (the same tests run on both), limits that
hold across replicas, expiring concurrency leases, and Redis going away."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from redis_server import RedisServer
from test_limits import Clock, key

from stoker.control.limits import Lease, Limiter, RateLimiter
from stoker.control.store import RedisRateLimiter
from stoker.errors import APIError
from stoker.observe.metrics import STORE_OPERATIONS, Metrics

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


_prefix = iter(range(10**6))


def redis_limiter(server: RedisServer, **kw) -> RedisRateLimiter:
    # A fresh key prefix per limiter group keeps tests apart in the one Redis.
    kw.setdefault("prefix", f"t{next(_prefix)}-{time.monotonic_ns()}")
    # A live Redis gets a long timeout here: on a loaded CI machine this process was once
    # not scheduled for over a second, and asyncio ran the 1 s connect timeout before the
    # finished connect, so a request got the store's 503 in a test about concurrency.
    kw.setdefault("socket_timeout", 10.0)
    return RedisRateLimiter(server.url, **kw)


@pytest.fixture(params=["process", "redis"])
async def make(request, redis_server) -> AsyncIterator:
    """make(clock) -> a limiter of the parametrized kind on that clock."""
    made: list[Limiter] = []

    def build(clock: Clock) -> Limiter:
        lim: Limiter = RateLimiter(clock) if request.param == "process" else redis_limiter(redis_server, clock=clock)
        made.append(lim)
        return lim

    yield build
    for lim in made:
        await lim.aclose()


async def release(lim: Limiter, lease: Lease, actual: int | None) -> None:
    lim.release(lease, actual)
    if isinstance(lim, RedisRateLimiter):
        await lim.settle()


# -- the in-process semantics, on both limiters ----------------------------------------


async def test_rpm_limit_429_with_retry_after_and_headers(make):
    clock = Clock()
    lim = make(clock)
    k = key(rpm=2)
    first = await lim.acquire(k, 10)
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    await lim.acquire(k, 10)
    with pytest.raises(APIError) as err:
        await lim.acquire(k, 10)
    e = err.value
    assert e.status == 429 and e.type == "rate_limit_exceeded" and e.reason == "requests"
    assert e.headers["Retry-After"] == "30"  # 1 request at 2/min
    assert e.headers["x-ratelimit-limit-requests"] == "2"
    assert e.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.headers["x-ratelimit-reset-requests"] == "1m0s"
    clock.t += 30
    await lim.acquire(k, 10)


async def test_tpm_limit_and_reconcile_refunds_unused(make):
    clock = Clock()
    lim = make(clock)
    k = key(tpm=1000)
    lease = await lim.acquire(k, 900)  # prompt 100 + max_tokens 800
    with pytest.raises(APIError) as err:
        await lim.acquire(k, 200)
    assert err.value.reason == "tokens"
    assert err.value.headers["x-ratelimit-remaining-tokens"] == "100"
    assert err.value.headers["Retry-After"] == "6"  # 100 missing at 1000/60 per s
    await release(lim, lease, 150)  # it really used 150
    lease2 = await lim.acquire(k, 200)
    assert lease2.headers["x-ratelimit-remaining-tokens"] == str(1000 - 150 - 200)


async def test_request_larger_than_tpm_is_refused_without_taking_anything(make):
    clock = Clock()
    lim = make(clock)
    k = key(tpm=100, rpm=5)
    with pytest.raises(APIError) as err:
        await lim.acquire(k, 250)  # no wait would admit it: no debt, no Retry-After
    e = err.value
    assert e.status == 429 and e.code == "rate_limit_exceeded" and e.reason == "tokens"
    assert "Limit 100, Requested 250" in e.message and "Retry-After" not in e.headers
    assert e.headers["x-ratelimit-remaining-tokens"] == "100"
    lease = await lim.acquire(k, 100)  # the whole bucket and the request were left alone
    assert lease.headers["x-ratelimit-remaining-requests"] == "4"
    with pytest.raises(APIError) as err:
        await lim.acquire(k, 10)
    assert err.value.headers["Retry-After"] == "6"  # 10 missing at 100/60 per s: an honest wait
    clock.t += 6
    await lim.acquire(k, 10)


async def test_a_debt_of_years_is_kept(make):
    clock = Clock()
    lim = make(clock)
    k = key(tpm=1)
    # Settled far above its estimate (only usage beyond an estimate can put a bucket in debt):
    # a bucket that takes ~2 million years to refill.
    await release(lim, await lim.acquire(k, 1), 2**40)
    with pytest.raises(APIError) as err:
        await lim.acquire(k, 1)
    assert int(err.value.headers["Retry-After"]) == 60 * 2**40


async def test_actual_usage_above_estimate_is_charged(make):
    clock = Clock()
    lim = make(clock)
    k = key(tpm=1000)
    await release(lim, await lim.acquire(k, 100), 600)
    lease = await lim.acquire(k, 1)
    assert lease.headers["x-ratelimit-remaining-tokens"] == "399"


async def test_concurrency_limit_and_refund_when_never_run(make):
    clock = Clock()
    lim = make(clock)
    k = key(max_concurrent=1, rpm=10)
    lease = await lim.acquire(k, 5)
    with pytest.raises(APIError) as err:
        await lim.acquire(k, 5)
    assert err.value.reason == "concurrency" and err.value.headers["Retry-After"] == "1"
    await release(lim, lease, None)  # refused later (e.g. 503): the request is refunded too
    await release(lim, lease, None)  # idempotent
    again = await lim.acquire(k, 5)
    assert again.headers["x-ratelimit-remaining-requests"] == "9"


async def test_a_request_holds_one_concurrency_slot_per_prompt(make):
    clock = Clock()
    lim = make(clock)
    k = key(max_concurrent=4, rpm=10)
    three = await lim.acquire(k, 5, slots=3)  # a list of three prompts
    with pytest.raises(APIError) as err:
        await lim.acquire(k, 5, slots=2)
    assert err.value.reason == "concurrency" and "counts as 2" in err.value.message
    assert err.value.headers["Retry-After"] == "1"
    with pytest.raises(APIError) as err:
        await lim.acquire(k, 5, slots=5)  # more prompts than the key may ever have in flight
    assert "Limit 4, Requested 5" in err.value.message and "Retry-After" not in err.value.headers
    one = await lim.acquire(k, 5)
    assert await _in_flight(lim, k.id) == 4
    await release(lim, three, 5)
    assert await _in_flight(lim, k.id) == 1
    await lim.acquire(k, 5, slots=3)
    await release(lim, one, 5)
    assert await _in_flight(lim, k.id) == 3


async def _in_flight(lim: Limiter, key_id: str) -> int:
    if isinstance(lim, RedisRateLimiter):
        return await lim.in_flight(key_id)
    assert isinstance(lim, RateLimiter)
    return lim.in_flight(key_id)


async def test_no_limits_no_headers_and_open_mode(make):
    lim = make(Clock())
    assert (await lim.acquire(key(), 10**6)).headers == {}
    assert (await lim.acquire(None, 10)).key_id is None


async def test_changed_limits_start_from_full_buckets(make):
    lim = make(Clock())
    await lim.acquire(key(rpm=1), 1)
    lease = await lim.acquire(key(rpm=5), 1)
    assert lease.headers["x-ratelimit-remaining-requests"] == "4"


# -- across replicas -------------------------------------------------------------------


async def test_rpm_holds_exactly_across_two_replicas(redis_server):
    a = redis_limiter(redis_server)
    b = redis_limiter(redis_server, prefix=a.prefix)  # two replicas: same Redis, same keys
    k = key(rpm=10)

    async def attempt(lim: RedisRateLimiter) -> bool:
        try:
            await lim.acquire(k, 1)
            return True
        except APIError as exc:
            assert exc.status == 429 and exc.reason == "requests"
            return False

    # 40 at once, interleaved over two connections; at 10/min one more refills every 6 s.
    results = await asyncio.gather(*(attempt(a if i % 2 else b) for i in range(40)))
    assert sum(results) == 10
    await a.aclose()
    await b.aclose()


async def test_concurrency_cap_holds_across_two_replicas(redis_server):
    a = redis_limiter(redis_server)
    b = redis_limiter(redis_server, prefix=a.prefix)
    k = key(max_concurrent=3)

    async def attempt(lim: RedisRateLimiter) -> Lease | None:
        try:
            return await lim.acquire(k, 1)
        except APIError as exc:
            assert exc.reason == "concurrency"
            return None

    leases = await asyncio.gather(*(attempt(a if i % 2 else b) for i in range(12)))
    held = [(lease, a if i % 2 else b) for i, lease in enumerate(leases) if lease is not None]
    assert len(held) == 3 and await a.in_flight(k.id) == 3
    lease, owner = held[0]
    owner.release(lease, 1)
    await owner.settle()
    other = b if owner is a else a
    await other.acquire(k, 1)  # the freed slot is usable from the other replica
    with pytest.raises(APIError):
        await a.acquire(k, 1)
    await a.aclose()
    await b.aclose()


async def test_tpm_is_shared_across_replicas(redis_server):
    clock = Clock()
    a = redis_limiter(redis_server, clock=clock)
    b = redis_limiter(redis_server, clock=clock, prefix=a.prefix)
    k = key(tpm=600)
    lease = await a.acquire(k, 500)
    with pytest.raises(APIError) as err:
        await b.acquire(k, 200)
    assert err.value.headers["Retry-After"] == "10"  # 100 missing at 10 per s
    with pytest.raises(APIError) as err:
        await b.acquire(k, 601)  # above the limit itself, on the other replica too
    assert "Requested 601" in err.value.message and "Retry-After" not in err.value.headers
    a.release(lease, 300)  # it used 300: 200 refunded on replica a
    await a.settle()
    assert (await b.acquire(k, 10)).headers["x-ratelimit-remaining-tokens"] == "290"
    await a.aclose()
    await b.aclose()


async def test_a_burst_waits_for_a_connection_instead_of_failing(redis_server):
    lim = redis_limiter(redis_server)
    k = key(rpm=10**6)
    leases = await asyncio.gather(*(lim.acquire(k, 1) for _ in range(300)))  # far more than the pool's connections
    assert len({lease.store_id for lease in leases}) == 300
    assert leases[-1].headers["x-ratelimit-limit-requests"] == str(10**6)
    for lease in leases:
        lim.release(lease, 1)
    await lim.settle()
    assert await lim.in_flight(k.id) == 0
    await lim.aclose()


async def test_a_dead_replicas_slots_expire_and_a_live_ones_are_renewed(redis_server):
    dead = redis_limiter(redis_server, lease_ttl=1.0)
    live = redis_limiter(redis_server, lease_ttl=1.0, prefix=dead.prefix)
    k = key(max_concurrent=2)
    await dead.acquire(k, 1)
    await live.acquire(k, 1)
    assert dead._renewer is not None
    dead._renewer.cancel()  # the replica dies: nobody renews or releases its lease
    with pytest.raises(APIError):
        await live.acquire(k, 1)
    await asyncio.sleep(1.5)  # past the TTL: the dead lease is gone, the live one (renewed every 1/3 s) is not
    assert await live.in_flight(k.id) == 1
    await live.acquire(k, 1)
    with pytest.raises(APIError):
        await live.acquire(k, 1)
    await live.aclose()
    await dead._redis.aclose()


# -- Redis away ---------------------------------------------------------------------------


def failures(metrics: Metrics) -> dict[str, float]:
    """stoker:store_failures_total of Redis, by operation."""
    return {
        op: metrics.registry.get_sample_value("stoker:store_failures_total", {"store": "redis", "operation": op}) or 0
        for op in STORE_OPERATIONS["redis"]
    }


async def test_redis_down_fails_closed_then_recovers_by_itself(tmp_path, caplog):
    server = RedisServer(str(tmp_path))
    server.start()
    metrics = Metrics("m")
    lim = RedisRateLimiter(server.url, count_failure=metrics.store_failure_counter("redis"))
    try:
        k = key(rpm=100)
        held = await lim.acquire(k, 1)
        other = await lim.acquire(k, 1)
        assert failures(metrics) == {"acquire": 0, "release": 0, "renew": 0}
        server.stop()
        lim.release(held, 1)  # a request that ends while Redis is away: logged, its slot left to expire
        await lim.settle()
        assert any("could not release a lease" in r.getMessage() for r in caplog.records)
        await lim.renew()  # `other` is still held: its renewal fails too
        started = time.monotonic()
        with pytest.raises(APIError) as err:
            await lim.acquire(k, 1)
        assert time.monotonic() - started < 3  # refused quickly, not hung
        assert err.value.status == 503 and err.value.code == "store_unavailable"
        assert err.value.headers["Retry-After"] == "2"
        assert lim.unreachable_since is not None
        assert failures(metrics) == {"acquire": 1, "release": 1, "renew": 1}
        server.start()  # same port, empty: the scripts must be loaded again
        lease = await lim.acquire(k, 1)
        assert lease.headers["x-ratelimit-remaining-requests"] == "99" and lim.unreachable_since is None
        assert failures(metrics)["acquire"] == 1
        lim.release(other, 1)
    finally:
        await lim.aclose()
        server.stop()


async def test_redis_down_fail_open_admits_without_limits(tmp_path, caplog):
    server = RedisServer(str(tmp_path))
    server.start()
    metrics = Metrics("m")
    lim = RedisRateLimiter(server.url, on_failure="open", count_failure=metrics.store_failure_counter("redis"))
    try:
        k = key(rpm=1)
        await lim.acquire(k, 1)
        server.stop()
        leases = [await lim.acquire(k, 1) for _ in range(3)]  # over rpm=1, admitted: opt-in
        assert all(lease.headers == {} and lease.store_id is None for lease in leases)
        assert sum("WITHOUT rate limits" in r.getMessage() for r in caplog.records) == 1  # logged once per outage
        # ... and counted every time: in open mode the metric is what shows the outage.
        assert failures(metrics)["acquire"] == 3
        for lease in leases:
            lim.release(lease, 1)
    finally:
        await lim.aclose()
        server.stop()
