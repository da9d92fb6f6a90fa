"""Figures of `stoker bench pd` from what the client saw: per configuration the
streams' ITL and TTFT, the long prompts' TTFT, tokens/s and errors pooled over
its rounds; the KV the split's workers moved, from their own counters; the
markdown table and the plot."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

from stoker.bench.prefix_restart import BenchError
from stoker.bench.stats import RequestResult, percentiles

QUANTILES = (50, 99)
STATS_SETTLE_S = 2.0
"""The engine sends its stats to the front end every second or so (as prefix-restart waits too)."""
SPLIT_ITL_P99_TARGET = 1.5
"""Issue 40: the split's ITL p99 within 1.5x of the streams alone."""


@dataclass
class Round:
    """What the client saw in one configuration during one round."""

    config: str
    round: int
    duration_s: float
    """From the first request sent to the last answer received."""
    streams: list[RequestResult]
    longs: list[RequestResult]


def figures(config: str, rounds: list[Round]) -> dict[str, Any]:
    """One configuration's figures over all its rounds: percentiles over every request of
    every round, tokens/s over the rounds' summed wall time."""
    streams = [r for rd in rounds for r in rd.streams]
    longs = [r for rd in rounds for r in rd.longs]
    ok_streams = [r for r in streams if r.ok]
    ok_longs = [r for r in longs if r.ok]
    failed = [r for r in (*streams, *longs) if not r.ok]
    duration = sum(rd.duration_s for rd in rounds)
    return {
        "config": config,
        "rounds": len(rounds),
        "stream_requests": len(streams),
        "long_requests": len(longs),
        "itl": percentiles([x for r in ok_streams for x in r.itls], QUANTILES),
        "ttft": percentiles([r.ttft for r in ok_streams if r.ttft is not None], QUANTILES),
        "long_ttft": percentiles([r.ttft for r in ok_longs if r.ttft is not None], QUANTILES),
        "output_tok_s": sum(r.output_tokens for r in (*ok_streams, *ok_longs)) / duration if duration > 0 else None,
        "errors": len(failed),
        "error_samples": list(dict.fromkeys(r.error or "error" for r in failed))[:3],
    }


def itl_p99_ratio(by_config: dict[str, dict[str, Any]], config: str) -> float | None:
    """config's stream ITL p99 over alone's; None where either is missing."""
    if "alone" not in by_config or config not in by_config:
        return None
    base, other = by_config["alone"]["itl"]["p99"], by_config[config]["itl"]["p99"]
    return other / base if base and other is not None else None


def transfer_counters(workers: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each worker's stoker:kv_transfer_*_total counters (summed over their labels) from its /metrics,
    read once the last requests' stats have reached it."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, dict[str, float]] = {}
    if workers:
        time.sleep(STATS_SETTLE_S)
    for role, url in workers.items():
        reply = httpx.get(f"{url}/metrics", timeout=30)
        if reply.status_code != 200:
            raise BenchError(f"{role} worker's /metrics answered {reply.status_code}")
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(reply.text):
            for sample in family.samples:
                if sample.name.startswith("stoker:kv_transfer_") and sample.name.endswith("_total"):
                    name = sample.name.removeprefix("stoker:kv_transfer_").removesuffix("_total")
                    totals[name] = totals.get(name, 0.0) + sample.value
        counters[role] = totals
    return counters


def transfer_delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    return {
        role: {k: v - before.get(role, {}).get(k, 0.0) for k, v in totals.items()} for role, totals in after.items()
    }


def transfer_line(moved: dict[str, dict[str, float]]) -> str:
    decode, prefill = moved.get("decode", {}), moved.get("prefill", {})
    pulls = decode.get("pulls", 0.0)
    mean = f", {decode.get('pull_seconds', 0.0) / pulls * 1000:.1f} ms per pull" if pulls else ""
    return (
        f"split KV transfer in the measured rounds: the decode worker received {decode.get('blocks_received', 0):.0f} "
        f"blocks ({decode.get('received_bytes', 0) / 1e6:.1f} MB) in {pulls:.0f} pulls{mean}, skipped "
        f"{decode.get('blocks_skipped', 0):.0f} it held already; {decode.get('pulls_failed', 0):.0f} pulls failed, "
        f"{decode.get('pulls_timed_out', 0):.0f} timed out; the prefill worker sent {prefill.get('blocks_sent', 0):.0f} "
        f"blocks, {prefill.get('rooms_expired', 0):.0f} parked prompts expired unpulled"
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def markdown(results: list[dict[str, Any]], skipped: dict[str, str], moved: dict[str, dict[str, float]]) -> str:
    by_config = {r["config"]: r for r in results}
    lines = [
        "| configuration | rounds | stream ITL p50 (ms) | ITL p99 (ms) | ITL p99 / alone | stream TTFT p50 (ms) "
        "| TTFT p99 (ms) | long TTFT p50 (ms) | long TTFT p99 (ms) | output tok/s | requests | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = itl_p99_ratio(by_config, r["config"])
        tok_s = r["output_tok_s"]
        lines.append(
            f"| {r['config']} | {r['rounds']} | {_ms(r['itl']['p50'])} | {_ms(r['itl']['p99'])} "
            f"| {'-' if ratio is None else f'{ratio:.2f}x'} | {_ms(r['ttft']['p50'])} | {_ms(r['ttft']['p99'])} "
            f"| {_ms(r['long_ttft']['p50'])} | {_ms(r['long_ttft']['p99'])} "
            f"| {'-' if tok_s is None else f'{tok_s:.1f}'} | {r['stream_requests'] + r['long_requests']} | {r['errors']} |"
        )
    for config, why in skipped.items():
        lines.append(f"\n{config}: skipped ({why})")
    split = itl_p99_ratio(by_config, "split")
    if split is not None:
        verdict = "within" if split <= SPLIT_ITL_P99_TARGET else "above"
        lines.append(f"\nsplit ITL p99 / alone ITL p99 = {split:.2f}x ({verdict} the {SPLIT_ITL_P99_TARGET}x target)")
    if moved:
        lines.append(f"\n{transfer_line(moved)}")
    for r in results:
        for sample in r["error_samples"]:
            lines.append(f"\n{r['config']} error: {sample}")
    return "\n".join(lines) + "\n"


def plot(path: str, rounds: list[Round]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, (itl_ax, ttft_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    long_ttfts: dict[str, list[float]] = {}
    for config in dict.fromkeys(rd.config for rd in rounds):
        mine = [rd for rd in rounds if rd.config == config]
        itls = sorted(x * 1000 for rd in mine for r in rd.streams if r.ok for x in r.itls)
        if itls:
            itl_ax.plot(itls, [(i + 1) / len(itls) for i in range(len(itls))], label=config)
        ttfts = [r.ttft * 1000 for rd in mine for r in rd.longs if r.ok and r.ttft is not None]
        if ttfts:
            long_ttfts[config] = ttfts
    if long_ttfts:
        ttft_ax.boxplot(list(long_ttfts.values()), tick_labels=list(long_ttfts))
    itl_ax.set(
        xscale="log", xlabel="stream inter-token latency (ms)", ylabel="share of gaps", title="streams' ITL (CDF)"
    )
    itl_ax.legend()
    itl_ax.grid(alpha=0.3)
    ttft_ax.set(ylabel="ms", title="long prompts' TTFT")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
