"""Per-key token buckets, concurrency, reconciliation, and the 429 headers."""

from __future__ import annotations

import pytest

from stoker.control.keys import ApiKey
from stoker.control.limits import RateLimiter, TokenBucket, format_duration
from stoker.errors import APIError


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def key(**kw) -> ApiKey:
    return ApiKey(id=kw.pop("id", "k1"), name="k", prefix="sk-stoker-k1", **kw)


def test_bucket_refills_continuously():
    b = TokenBucket(60, now=0.0)
    assert b.take(60, 0.0) and not b.take(1, 0.0)
    assert b.wait_time(1, 0.0) == pytest.approx(1.0)
    assert b.take(1, 1.0)
    assert b.reset_time(1.0) == pytest.approx(60.0)


def test_bucket_admits_only_what_it_holds_and_never_more_than_its_capacity():
    b = TokenBucket(100, now=0.0)
    assert not b.take(250, 0.0)  # no debt at admission: an oversized cost is never taken
    assert b.wait_time(250, 0.0) == float("inf")
    assert b.take(100, 0.0) and b.tokens == 0
    assert b.wait_time(10, 0.0) == pytest.approx(10 / (100 / 60))


def test_request_larger_than_tpm_is_refused_as_too_large_without_retry_after():
    clock = Clock()
    lim = RateLimiter(clock)
    k = key(tpm=1000, rpm=10)
    with pytest.raises(APIError) as err:
        lim.acquire_now(k, 1001)
    e = err.value
    assert e.status == 429 and e.code == "rate_limit_exceeded" and e.reason == "tokens"
    assert "Limit 1000, Requested 1001" in e.message and "Retry-After" not in e.headers
    # Nothing was taken: the whole bucket and the request are still there.
    assert lim.headers(k)["x-ratelimit-remaining-tokens"] == "1000"
    assert lim.headers(k)["x-ratelimit-remaining-requests"] == "10"
    assert lim.in_flight("k1") == 0
    lim.acquire_now(k, 1000)


def test_rpm_limit_429_with_retry_after_and_headers():
    clock = Clock()
    lim = RateLimiter(clock)
    k = key(rpm=2)
    lim.acquire_now(k, 10)
    lim.acquire_now(k, 10)
    with pytest.raises(APIError) as err:
        lim.acquire_now(k, 10)
    e = err.value
    assert e.status == 429 and e.type == "rate_limit_exceeded" and e.reason == "requests"
    assert e.headers["Retry-After"] == "30"  # 1 request at 2/min
    assert e.headers["x-ratelimit-limit-requests"] == "2"
    assert e.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert e.body()["error"]["code"] == "rate_limit_exceeded"
    clock.t += 30
    lim.acquire_now(k, 10)


def test_tpm_limit_and_reconcile_refunds_unused():
    clock = Clock()
    lim = RateLimiter(clock)
    k = key(tpm=1000)
    lease = lim.acquire_now(k, 900)  # prompt 100 + max_tokens 800
    with pytest.raises(APIError) as err:
        lim.acquire_now(k, 200)
    assert err.value.reason == "tokens"
    assert err.value.headers["x-ratelimit-remaining-tokens"] == "100"
    assert err.value.headers["Retry-After"] == "6"  # 100 missing at 1000/60 per s
    lim.release(lease, 150)  # it really used 150
    lease2 = lim.acquire_now(k, 200)
    assert lease2.headers["x-ratelimit-remaining-tokens"] == str(1000 - 150 - 200)


def test_actual_usage_above_estimate_is_charged():
    clock = Clock()
    lim = RateLimiter(clock)
    k = key(tpm=1000)
    lim.release(lim.acquire_now(k, 100), 600)
    assert lim.headers(k)["x-ratelimit-remaining-tokens"] == "400"


def test_concurrency_limit_and_refund_when_never_run():
    clock = Clock()
    lim = RateLimiter(clock)
    k = key(max_concurrent=1, rpm=10)
    lease = lim.acquire_now(k, 5)
    with pytest.raises(APIError) as err:
        lim.acquire_now(k, 5)
    assert err.value.reason == "concurrency" and "Retry-After" in err.value.headers
    lim.release(lease, None)  # refused later (e.g. 503): the request is refunded too
    lim.release(lease, None)  # idempotent
    assert lim.in_flight("k1") == 0
    assert lim.headers(k)["x-ratelimit-remaining-requests"] == "10"


def test_no_limits_no_headers_and_open_mode():
    lim = RateLimiter(Clock())
    assert lim.acquire_now(key(), 10**6).headers == {}
    assert lim.acquire_now(None, 10).key_id is None


def test_changed_limits_take_effect():
    clock = Clock()
    lim = RateLimiter(clock)
    lim.acquire_now(key(rpm=1), 1)
    lim.acquire_now(key(rpm=5), 1)  # new limits: fresh buckets


@pytest.mark.parametrize("seconds,text", [(0.02, "20ms"), (1.5, "1.5s"), (360, "6m0s"), (3723, "1h2m3s"), (0, "0ms")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
