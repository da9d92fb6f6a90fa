"""The bench's arithmetic on hand-written timings: percentiles, throughput,
goodput under an SLO, alternating order and paired ratios."""

from __future__ import annotations

import math

import pytest

from stoker.bench.stats import (
    RequestResult,
    alternating_schedule,
    compare_runs,
    merge_repetitions,
    metric,
    paired_ratios,
    parse_slo,
    percentiles,
    summarize,
)


def ok(
    index: int, ttft: float, e2e: float, out: int, prompt: int = 10, itls: list[float] | None = None
) -> RequestResult:
    return RequestResult(
        index=index, ok=True, status=200, ttft=ttft, e2e=e2e, output_tokens=out, prompt_tokens=prompt, itls=itls or []
    )


def test_percentiles_interpolate_between_order_statistics() -> None:
    p = percentiles([float(x) for x in range(1, 101)])  # 1..100
    assert p["p50"] == pytest.approx(50.5)
    assert p["p90"] == pytest.approx(90.1)
    assert p["p99"] == pytest.approx(99.01)
    assert p["max"] == 100.0 and p["mean"] == pytest.approx(50.5)


def test_percentiles_of_nothing_are_none_not_errors() -> None:
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}


def test_tpot_excludes_the_first_token() -> None:
    r = ok(0, ttft=0.5, e2e=1.5, out=11)
    assert r.tpot == pytest.approx(0.1)
    assert ok(1, 0.5, 0.5, out=1).tpot is None  # one token: no decode interval


def test_summary_counts_throughput_over_wall_time_and_failures_by_status() -> None:
    results = [
        ok(0, 0.1, 1.1, out=11, prompt=100, itls=[0.1] * 10),
        ok(1, 0.3, 2.3, out=21, prompt=50, itls=[0.1] * 20),
        RequestResult(index=2, status=503, error="HTTP 503: busy"),
        RequestResult(index=3, status=503, error="HTTP 503: busy"),
        RequestResult(index=4, status=200, error="stream error: {}"),
        RequestResult(index=5, status=None, error="ConnectError: refused"),
    ]
    s = summarize(results, duration=4.0)
    assert (s["requests"], s["completed"], s["failed"]) == (6, 2, 4)
    assert s["failures"] == {"503": 2, "stream error": 1, "ConnectError": 1}
    assert s["output_tok_s"] == pytest.approx(32 / 4)
    assert s["total_tok_s"] == pytest.approx((32 + 150) / 4)
    assert s["req_s"] == pytest.approx(0.5)
    assert s["ttft"]["p50"] == pytest.approx(0.2)
    assert s["ttft"]["max"] == pytest.approx(0.3)
    assert s["itl"]["p50"] == pytest.approx(0.1)
    assert s["tpot"]["max"] == pytest.approx(0.1)
    assert s["e2e"]["max"] == pytest.approx(2.3)
    assert "goodput" not in s


def test_parse_slo_units() -> None:
    assert parse_slo("ttft=500ms,tpot=100ms") == {"ttft": 0.5, "tpot": 0.1}
    assert parse_slo("e2e=2s, ttft=250") == {"e2e": 2.0, "ttft": 0.25}
    assert parse_slo(None) == {}
    with pytest.raises(ValueError, match="itl"):
        parse_slo("itl=5ms")


def test_goodput_counts_failures_as_misses() -> None:
    slo = parse_slo("ttft=500ms,tpot=100ms")
    results = [
        ok(0, ttft=0.2, e2e=1.2, out=11),  # tpot 0.1: meets (limit inclusive)
        ok(1, ttft=0.6, e2e=1.0, out=5),  # ttft too slow
        ok(2, ttft=0.1, e2e=3.1, out=11),  # tpot 0.3: too slow
        ok(3, ttft=0.1, e2e=0.1, out=1),  # one token, no tpot: meets
        RequestResult(index=4, status=500, error="HTTP 500"),
    ]
    s = summarize(results, duration=2.0, slo=slo)
    assert s["goodput"] == pytest.approx(2 / 5)
    assert s["goodput_req_s"] == pytest.approx(1.0)


def test_alternating_schedule_interleaves_targets_per_repetition() -> None:
    assert alternating_schedule(["A", "B"], 3) == [(0, "A"), (0, "B"), (1, "A"), (1, "B"), (2, "A"), (2, "B")]
    assert alternating_schedule(["A", "B", "C"], 1) == [(0, "A"), (0, "B"), (0, "C")]


def test_paired_ratios_pair_by_repetition_and_use_the_geometric_mean() -> None:
    r = paired_ratios([200.0, 100.0], [100.0, 100.0])
    assert r["ratio"] == pytest.approx(math.sqrt(2.0))
    assert (r["min"], r["max"], r["pairs"]) == (1.0, 2.0, 2)
    # A pair with a missing side is dropped, not zero.
    assert paired_ratios([2.0, None], [1.0, 3.0])["pairs"] == 1
    assert paired_ratios([None], [None])["ratio"] is None


def _run(target: str, rep: int, tok_s: float, ttft: float) -> dict:
    results = [ok(0, ttft=ttft, e2e=ttft + 1.0, out=int(tok_s))]
    return {
        "target": target,
        "stage": "c=4",
        "stage_value": 4,
        "repetition": rep,
        "summary": summarize(results, 1.0),
        "requests": [r.to_dict() for r in results],
    }


def test_compare_runs_pairs_same_stage_and_repetition() -> None:
    # Drift: both servers slow down in repetition 1; paired ratios stay 2.0.
    runs = [_run("A", 0, 200, 0.1), _run("B", 0, 100, 0.2), _run("A", 1, 100, 0.2), _run("B", 1, 50, 0.4)]
    (row,) = compare_runs(runs, "A")
    assert (row["stage"], row["base"], row["other"]) == ("c=4", "A", "B")
    assert row["ratios"]["output_tok_s"]["ratio"] == pytest.approx(2.0)
    assert row["ratios"]["output_tok_s"]["min"] == pytest.approx(2.0)
    assert row["ratios"]["ttft.p50"]["ratio"] == pytest.approx(0.5)


def test_merge_repetitions_pools_requests_and_durations() -> None:
    runs = [_run("A", 0, 200, 0.1), _run("A", 1, 100, 0.3)]
    (m,) = merge_repetitions(runs)
    assert m["summary"]["completed"] == 2
    assert m["summary"]["output_tok_s"] == pytest.approx(300 / 2.0)
    assert metric(m["summary"], "ttft.max") == pytest.approx(0.3)
    assert metric(m["summary"], "nope.p50") is None


def test_request_result_round_trips_through_json_dicts() -> None:
    r = ok(3, 0.1, 0.5, out=5, itls=[0.1, 0.1])
    d = r.to_dict()
    assert d["tpot"] == pytest.approx(0.1)
    assert RequestResult.from_dict(d) == r
