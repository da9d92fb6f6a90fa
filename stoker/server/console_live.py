"""Live figures for the operator console, read from the server's own Prometheus
registry (stoker.observe.metrics), so the console shows what /metrics says.

A sampler reads the registry once a second (SAMPLE_INTERVAL) and keeps the last
HISTORY_SECONDS of samples, so a page opened now draws the last minutes at
once. Per model: requests running and waiting, KV cache usage, output tokens/s
and finished requests/s (counter growth between samples), TTFT and inter-token
latency p50/p99 over the trailing QUANTILE_WINDOW seconds (histogram buckets'
growth, interpolated within a bucket as Prometheus' histogram_quantile does).
Server-wide: refusals per second by reason (503 admission and 429 rate limits;
those counters carry no model label).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram

from stoker.observe.metrics import Metrics

SAMPLE_INTERVAL = 1.0
"""Seconds between samples."""
HISTORY_SECONDS = 300
"""Samples kept: the last five minutes."""
QUANTILE_WINDOW = 60.0
"""Seconds of finished requests the TTFT and ITL quantiles cover."""

Buckets = tuple[tuple[float, float], ...]
"""A histogram's cumulative buckets: (upper bound, count) pairs, +Inf last."""


@dataclass(frozen=True)
class ModelReading:
    """One model's series at one instant, as the registry holds them."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    generation_tokens: float = 0.0
    finished: float = 0.0
    ttft: Buckets = ()
    itl: Buckets = ()


@dataclass(frozen=True)
class Reading:
    at: float
    models: dict[str, ModelReading]
    refusals: dict[str, float]
    """Cumulative refusals by reason: admission's (503) as given, rate limits' (429) as "rate_limit:<limit>"."""


@dataclass
class LiveSample:
    """What one sample tells a person; rates and quantiles are None where nothing happened to measure."""

    t: float
    models: dict[str, dict[str, float | None]] = field(default_factory=dict)
    refusals_per_s: dict[str, float] = field(default_factory=dict)


def _by_label(metric: Gauge | Counter, label: str, suffix: str = "") -> dict[str, float]:
    """{label value: summed value} of a metric's series (a counter's `_total` samples with suffix "_total")."""
    out: dict[str, float] = {}
    for family in metric.collect():
        for sample in family.samples:
            if suffix and not sample.name.endswith(suffix):
                continue
            name = sample.labels.get(label, "")
            out[name] = out.get(name, 0.0) + sample.value
    return out


def _buckets(histogram: Histogram) -> dict[str, Buckets]:
    found: dict[str, list[tuple[float, float]]] = {}
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                found.setdefault(sample.labels["model_name"], []).append((float(sample.labels["le"]), sample.value))
    return {name: tuple(sorted(pairs)) for name, pairs in found.items()}


def read_registry(metrics: Metrics, at: float) -> Reading:
    running = _by_label(metrics.running, "model_name")
    waiting = _by_label(metrics.waiting, "model_name")
    kv_usage = _by_label(metrics.kv_usage, "model_name")
    generated = _by_label(metrics.generation_tokens, "model_name", "_total")
    finished = _by_label(metrics.request_success, "model_name", "_total")
    ttft = _buckets(metrics.ttft)
    itl = _buckets(metrics.itl)
    models = {
        name: ModelReading(
            running=running.get(name, 0.0),
            waiting=waiting.get(name, 0.0),
            kv_usage=kv_usage.get(name, 0.0),
            generation_tokens=generated.get(name, 0.0),
            finished=finished.get(name, 0.0),
            ttft=ttft.get(name, ()),
            itl=itl.get(name, ()),
        )
        for name in set(running) | set(generated) | set(finished)
    }
    refusals = _by_label(metrics.admission_rejections, "reason", "_total")
    for limit, count in _by_label(metrics.rate_limit_rejections, "limit", "_total").items():
        refusals[f"rate_limit:{limit}"] = count
    return Reading(at, models, refusals)


def bucket_quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of observations counted in cumulative buckets, None without any.
    Linear within the bucket that holds it; one in the +Inf bucket reads as the last finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def bucket_growth(now: Buckets, then: Buckets) -> Buckets:
    """Observations added between two readings of one histogram (all of now's when then is empty)."""
    if not then or len(then) != len(now):
        return now
    return tuple((bound, max(0.0, count - before)) for (bound, count), (_, before) in zip(now, then, strict=True))


def _rate(now: float, then: float, seconds: float) -> float:
    # A counter that went back was reset (a fresh registry): count from zero.
    return (now - then if now >= then else now) / seconds


def describe(now: Reading, previous: Reading | None, window_start: Reading | None) -> LiveSample:
    """The sample a person sees at now: rates since previous, quantiles since window_start."""
    sample = LiveSample(t=round(now.at, 3))
    seconds = max(1e-3, now.at - previous.at) if previous is not None else 0.0
    for name, reading in sorted(now.models.items()):
        before = previous.models.get(name) if previous is not None else None
        base = window_start.models.get(name) if window_start is not None else None
        ttft = bucket_growth(reading.ttft, base.ttft if base else ())
        itl = bucket_growth(reading.itl, base.itl if base else ())
        sample.models[name] = {
            "running": reading.running,
            "waiting": reading.waiting,
            "kv_usage": reading.kv_usage,
            # A model absent from the previous reading had counted nothing yet (its series
            # appear with their first values): its first requests count from zero, or a
            # burst that ended within one interval would never show.
            "output_tokens_per_s": _rate(
                reading.generation_tokens, before.generation_tokens if before else 0.0, seconds
            )
            if previous is not None
            else None,
            "requests_per_s": _rate(reading.finished, before.finished if before else 0.0, seconds)
            if previous is not None
            else None,
            "ttft_p50": bucket_quantile(0.5, ttft),
            "ttft_p99": bucket_quantile(0.99, ttft),
            "itl_p50": bucket_quantile(0.5, itl),
            "itl_p99": bucket_quantile(0.99, itl),
        }
    if previous is not None:
        sample.refusals_per_s = {
            reason: _rate(count, previous.refusals.get(reason, 0.0), seconds) for reason, count in now.refusals.items()
        }
    return sample


class LiveSampler:
    """Samples the registry every SAMPLE_INTERVAL seconds while the server runs."""

    def __init__(self, metrics: Metrics, interval: float = SAMPLE_INTERVAL) -> None:
        self.metrics = metrics
        self.interval = interval
        keep = int(HISTORY_SECONDS / interval)
        self.samples: deque[LiveSample] = deque(maxlen=keep)
        self._readings: deque[Reading] = deque(maxlen=int(QUANTILE_WINDOW / interval) + 1)

    def sample(self, at: float | None = None) -> LiveSample:
        reading = read_registry(self.metrics, time.time() if at is None else at)
        previous = self._readings[-1] if self._readings else None
        window_start = self._readings[0] if self._readings else None
        self._readings.append(reading)
        described = describe(reading, previous, window_start)
        self.samples.append(described)
        return described

    def since(self, t: float) -> Iterable[LiveSample]:
        return (s for s in self.samples if s.t > t)

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)
