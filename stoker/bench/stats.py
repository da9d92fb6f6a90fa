"""Statistics over recorded request timings: latency percentiles, throughput,
goodput under an SLO, and paired ratios between servers.

Everything here is pure arithmetic on `RequestResult`s so it can be tested on
hand-written timings, without a server."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "itl", "tpot", "e2e")
# Throughput metrics where more is better; used to orient ratios.
HIGHER_IS_BETTER = {"output_tok_s", "total_tok_s", "req_s", "goodput"}


@dataclass
class RequestResult:
    """What the client saw for one request. Times are seconds; `start` is
    relative to the start of the run it belongs to."""

    index: int
    start: float = 0.0
    ok: bool = False
    status: int | None = None
    """HTTP status; None when no response arrived (connection error, timeout)."""
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    """Gaps between successive content chunks after the first."""
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    """Prompt tokens the server served from its prefix cache (usage.prompt_tokens_details), when it says."""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (the decode speed one user sees)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestResult:
        d = {k: v for k, v in d.items() if k != "tpot"}
        return cls(**d)


def percentiles(values: Sequence[float], qs: Iterable[float] = PERCENTILES) -> dict[str, float | None]:
    """p50/p90/p99 (linear interpolation between order statistics), mean and max."""
    qs = list(qs)
    if len(values) == 0:
        return {**{f"p{q:g}": None for q in qs}, "mean": None, "max": None}
    arr = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}
    out["mean"] = float(arr.mean())
    out["max"] = float(arr.max())
    return out


_SLO_ITEM = re.compile(r"^\s*(ttft|tpot|e2e)\s*=\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


def parse_slo(spec: str | None) -> dict[str, float]:
    """'ttft=500ms,tpot=100ms' -> {'ttft': 0.5, 'tpot': 0.1} (seconds; bare numbers are ms)."""
    if not spec:
        return {}
    slo: dict[str, float] = {}
    for item in spec.split(","):
        m = _SLO_ITEM.match(item)
        if not m:
            raise ValueError(f"bad SLO item {item!r}: expected ttft|tpot|e2e=<number>[ms|s]")
        name, number, unit = m.groups()
        slo[name] = float(number) / (1.0 if unit == "s" else 1000.0)
    return slo


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.ok:
        return False
    for name, limit in slo.items():
        value = getattr(r, name)
        # A one-token answer has no TPOT; it cannot have been slow at decoding.
        if value is not None and value > limit:
            return False
    return True


def summarize(results: Sequence[RequestResult], duration: float, slo: dict[str, float] | None = None) -> dict[str, Any]:
    """One run's figures. Throughputs divide by the run's wall time, which covers
    failures too: a server that fails fast must not look fast."""
    ok = [r for r in results if r.ok]
    failures: dict[str, int] = {}
    for r in results:
        if not r.ok:
            # HTTP errors by status; failures inside a 200 stream by kind.
            if r.status is not None and r.status != 200:
                key = str(r.status)
            else:
                key = (r.error or "error").split(":")[0]
            failures[key] = failures.get(key, 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    duration = max(duration, 1e-9)
    summary: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": failures,
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration,
        "total_tok_s": (in_tokens + out_tokens) / duration,
        "req_s": len(ok) / duration,
        # Share of the prompt tokens served from the prefix cache, by the servers' own usage; None if none said.
        "cached_share": (
            sum(r.cached_tokens or 0 for r in ok) / max(1, in_tokens)
            if any(r.cached_tokens is not None for r in ok)
            else None
        ),
    }
    summary["ttft"] = percentiles([r.ttft for r in ok if r.ttft is not None])
    summary["itl"] = percentiles([x for r in ok for x in r.itls])
    summary["tpot"] = percentiles([t for r in ok if (t := r.tpot) is not None])
    summary["e2e"] = percentiles([r.e2e for r in ok if r.e2e is not None])
    if slo:
        good = sum(meets_slo(r, slo) for r in results)
        summary["slo"] = dict(slo)
        summary["goodput"] = good / len(results) if results else 0.0
        summary["goodput_req_s"] = good / duration
    return summary


def metric(summary: dict[str, Any], name: str) -> float | None:
    """'output_tok_s' or 'ttft.p99' style lookup into a summary."""
    value: object = summary
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return float(value) if isinstance(value, (int, float)) else None


def alternating_schedule(targets: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repetition, target) in the order runs happen: A, B, A, B, ... so slow
    drift of a noisy machine (thermal, neighbours) lands on every target alike."""
    return [(rep, t) for rep in range(repeats) for t in targets]


def paired_ratios(base: Sequence[float | None], other: Sequence[float | None]) -> dict[str, Any]:
    """Ratios base/other pairing repetition i of one with repetition i of the
    other (they ran back to back). The geometric mean is the summary because
    ratios multiply; min and max show how much the pairs disagree."""
    ratios = [b / o for b, o in zip(base, other) if b is not None and o is not None and o > 0 and b > 0]
    if not ratios:
        return {"ratio": None, "min": None, "max": None, "pairs": 0}
    gmean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    return {"ratio": gmean, "min": min(ratios), "max": max(ratios), "pairs": len(ratios)}


COMPARE_METRICS = (
    "output_tok_s",
    "total_tok_s",
    "req_s",
    "ttft.p50",
    "ttft.p99",
    "itl.p50",
    "itl.p99",
    "tpot.p50",
    "e2e.p50",
)


def compare_runs(runs: Sequence[dict[str, Any]], base_target: str) -> list[dict[str, Any]]:
    """For each stage and each non-base target: paired ratios base/other of the
    main metrics. `runs` are dicts with target, stage, repetition, summary."""
    by_key = {(r["target"], r["stage"], r["repetition"]): r["summary"] for r in runs}
    stages = list(dict.fromkeys(r["stage"] for r in runs))
    others = list(dict.fromkeys(r["target"] for r in runs if r["target"] != base_target))
    reps = sorted({r["repetition"] for r in runs})
    rows = []
    for stage in stages:
        for other in others:
            row = {"stage": stage, "base": base_target, "other": other, "ratios": {}}
            for name in COMPARE_METRICS:
                b = [
                    metric(by_key[(base_target, stage, i)], name) if (base_target, stage, i) in by_key else None
                    for i in reps
                ]
                o = [metric(by_key[(other, stage, i)], name) if (other, stage, i) in by_key else None for i in reps]
                row["ratios"][name] = paired_ratios(b, o)
            rows.append(row)
    return rows


def merge_repetitions(runs: Sequence[dict[str, Any]], slo: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Pool every repetition of a (target, stage) into one summary: latency
    percentiles over all requests, throughput over the summed durations."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["target"], r["stage"]), []).append(r)
    merged = []
    for (target, stage), group in groups.items():
        results = [RequestResult.from_dict(d) for r in group for d in r["requests"]]
        duration = sum(r["summary"]["duration_s"] for r in group)
        merged.append(
            {
                "target": target,
                "stage": stage,
                "stage_value": group[0].get("stage_value"),
                "summary": summarize(results, duration, slo),
            }
        )
    return merged
