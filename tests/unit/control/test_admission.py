"""Capacity-aware admission: bounded queue in requests and tokens, in-transit
requests counted, 503 with a Retry-After from the measured drain rate."""

from __future__ import annotations

import pytest

from stoker.control.admission import AdmissionController
from stoker.control.keys import ApiKey
from stoker.control.policy import (
    resolve_deadline,
    resolve_priority,
)
from stoker.engine.params import EngineStats
from stoker.errors import APIError


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def ctl(**kw) -> tuple[AdmissionController, Clock]:
    clock = Clock()
    return AdmissionController(clock=clock, **kw), clock


def test_requests_not_yet_visible_count_against_the_queue():
    c, clock = ctl(max_queued_requests=2, max_queued_tokens=10_000)
    c.admit(10)
    c.admit(10)
    with pytest.raises(APIError) as err:
        c.admit(10)
    assert err.value.status == 503 and err.value.type == "overloaded" and err.value.reason == "queue_requests"
    # A snapshot taken after both were admitted: they now count through the engine's numbers.
    clock.t += 0.1
    c.update(EngineStats(num_waiting=0, num_running=2))
    c.admit(10)


def test_engine_waiting_counts():
    c, _ = ctl(max_queued_requests=4, max_queued_tokens=1000)
    c.update(EngineStats(num_waiting=1, num_waiting_tokens=900))
    with pytest.raises(APIError) as err:
        c.admit(200)
    assert err.value.reason == "queue_tokens"
    c.admit(100)


def test_snapshot_older_than_admission_does_not_forget_it():
    c, clock = ctl(max_queued_requests=1)
    c.admit(10)
    c.update(EngineStats(), taken_at=clock.t - 1)
    with pytest.raises(APIError):
        c.admit(10)


def test_mark_visible_releases_transit():
    c, _ = ctl(max_queued_requests=1)
    t = c.admit(10)
    c.mark_visible(t)
    c.mark_visible(t)
    assert c.queue().requests == 0
    c.admit(10)


def test_empty_queue_admits_a_long_prompt():
    c, _ = ctl(max_queued_tokens=100)
    c.admit(5000)


def test_retry_after_follows_measured_drain_rate():
    c, clock = ctl(max_queued_requests=1000, max_queued_tokens=1000, drain_window=10)
    clock.t += 10
    for _ in range(10):  # 10 requests of 100 prompt tokens in the last 10 s: 100 tokens/s
        c.record_finished(100)
    c.update(EngineStats(num_waiting=5, num_waiting_tokens=1000))
    with pytest.raises(APIError) as err:
        c.admit(500)  # 500 tokens over the bound: ~5 s at 100 tokens/s
    assert err.value.headers["Retry-After"] == "5"
    # Twice the drain rate halves the wait: computed, not a constant.
    for _ in range(10):
        c.record_finished(100)
    with pytest.raises(APIError) as err:
        c.admit(500)
    assert err.value.headers["Retry-After"] == "3"  # ceil(2.5)


def test_retry_after_without_measurements_uses_fallback_and_is_clamped():
    c, clock = ctl(max_queued_requests=1, fallback_retry_after=2, max_retry_after=60)
    c.admit(1)
    with pytest.raises(APIError) as err:
        c.admit(1)
    assert err.value.headers["Retry-After"] == "2"
    assert c.retry_after(10**9, 0) == 2
    clock.t += 5
    c.record_finished(1)
    assert c.retry_after(10**9, 0) == 60


def test_old_finishes_leave_the_window():
    c, clock = ctl(drain_window=10)
    clock.t += 100
    c.record_finished(1000)
    assert c.drain_rate()[1] == pytest.approx(100)
    clock.t += 11
    assert c.drain_rate() == (0.0, 0.0)


def test_batch_requests_leave_headroom_for_interactive():
    c, _ = ctl(max_queued_requests=10, batch_share=0.5)
    c.update(EngineStats(num_waiting=5))
    with pytest.raises(APIError):
        c.admit(1, priority=1)
    c.admit(1, priority=0)


def test_draining_refuses():
    c, _ = ctl()
    c.draining = True
    with pytest.raises(APIError) as err:
        c.admit(1)
    assert err.value.status == 503 and err.value.code == "draining"


# -- policy -------------------------------------------------------------------------


def _key(priority: str) -> ApiKey:
    return ApiKey(id="k", name="k", prefix="p", priority=priority)


def test_priority_may_be_lowered_never_raised():
    assert resolve_priority(_key("interactive"), None) == 0
    assert resolve_priority(_key("batch"), None) == 1
    assert resolve_priority(_key("batch"), 0) == 1
    assert resolve_priority(_key("batch"), "interactive") == 1
    assert resolve_priority(_key("interactive"), "batch") == 1
    assert resolve_priority(_key("interactive"), 5) == 5
    assert resolve_priority(None, None) == 0
    for bad in ("urgent", 1.5, True, 10**6):
        with pytest.raises(APIError) as err:
            resolve_priority(None, bad)
        assert err.value.status == 400 and err.value.param == "priority"


def test_deadline_from_header_or_timeout_capped():
    assert resolve_deadline(None, None, 300, now=100.0) is None
    assert resolve_deadline("1500", None, 300, now=100.0) == pytest.approx(101.5)
    assert resolve_deadline(None, 2, 300, now=100.0) == 102.0
    assert resolve_deadline("5000", 2, 300, now=100.0) == 102.0  # the earlier wins
    assert resolve_deadline(None, 3600, 300, now=100.0) == 400.0  # capped by the max queue wait
    assert resolve_deadline(None, 3600, None, now=100.0) == 3700.0
    for header, timeout in (("abc", None), ("-5", None), (None, 0), (None, "3")):
        with pytest.raises(APIError) as err:
            resolve_deadline(header, timeout, 300, now=100.0)
        assert err.value.status == 400
