"""`stoker bench pd`: do long prompts stall the decode streams, and does splitting
prefill from decode (issue 40) keep them steady?

N streams (short prompts, fixed-length greedy answers, a closed loop) run in
three configurations that the bench starts itself on this machine, in rounds
that alternate between them (alone, colocated, split, alone, ...):

- alone:     one `stoker serve` on every core, only the N streams: the baseline;
- colocated: the same server, the N streams plus a long prompt (random words,
             so nothing is cached) every --long-every seconds;
- split:     a `--role prefill` worker pinned with taskset to --prefill-cpus, a
             `--role decode` worker pinned to --decode-cpus (each with as many
             --num-threads as CPUs), sglang-router `--pd-disaggregation` in front
             of them, and the colocated load sent to the router.

Per configuration: the streams' inter-token latency (ITL) and time to first token
(TTFT) p50/p99, the long prompts' TTFT p50/p99, output tokens/s and errors; and
split ITL p99 / alone ITL p99 (issue 40 asks for at most 1.5x). A configuration
that cannot start (no taskset, no router binary, a worker that exits) is skipped
with one line saying why; the others still run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from stoker.bench.pd_workers import CONFIGS, Deployment, parse_cpus, start_deployments, stop_all
from stoker.bench.prefix_restart import BenchError, ServedTokenizer, checked, complete, settle
from stoker.bench.serve import BenchConfig, build_payload, send_request
from stoker.bench.stats import RequestResult, percentiles
from stoker.bench.workload import LengthDist, RequestSpec, synthetic

QUANTILES = (50, 99)
STREAM_POOL_PER_STREAM = 8
"""Distinct prompts drawn per stream and round; a stream that finishes more answers cycles through them."""
SPLIT_ITL_P99_TARGET = 1.5
"""Issue 40: the split's ITL p99 within 1.5x of the streams alone."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("servers (started and stopped by the bench)")
    s.add_argument(
        "--model", default=None, help="model every server serves (`stoker serve --model`; default: its default)"
    )
    s.add_argument(
        "--serve-args",
        default="",
        help='more `stoker serve` flags for every server, one string, e.g. "--kv-cache-dtype int8"',
    )
    s.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    s.add_argument("--prefill-cpus", default="0", help="CPUs the split's prefill worker is pinned to (taskset -c list)")
    s.add_argument("--decode-cpus", default="1", help="CPUs the split's decode worker is pinned to (taskset -c list)")
    s.add_argument(
        "--router", default=None, help="the sglang-router executable (default: beside this Python, then PATH)"
    )
    s.add_argument(
        "--ready-timeout", type=float, default=600, help="seconds each server and the router may take to start"
    )
    w = p.add_argument_group("load")
    w.add_argument("--streams", type=int, default=8, help="concurrent decode streams (a closed loop)")
    w.add_argument("--stream-prompt", type=int, default=64, help="prompt tokens of each stream request")
    w.add_argument("--stream-tokens", type=int, default=128, help="tokens each stream request generates (ignore_eos)")
    w.add_argument("--long-len", type=int, default=2000, help="prompt tokens of each long prompt")
    w.add_argument("--long-every", type=float, default=4.0, help="seconds between long prompts (colocated and split)")
    w.add_argument("--long-tokens", type=int, default=16, help="tokens each long prompt generates")
    w.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens every long prompt shares at its start (a prefix-cache hit after the first; 0: nothing shared)",
    )
    w.add_argument(
        "--duration", type=float, default=30.0, help="seconds per configuration and round in which requests start"
    )
    w.add_argument("--rounds", type=int, default=3, help="rounds; each runs every configuration once, in turn")
    w.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    w.add_argument("--seed", type=int, default=0, help="seed of the prompts' random words")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, metavar="FILE", help="write the figures and every request as JSON here")
    o.add_argument("--plot", default=None, metavar="PNG", help="draw the streams' ITL and the long prompts' TTFT here")


@dataclass
class Load:
    streams: int
    duration: float
    long_every: float | None
    """None: no long prompts (the alone configuration)."""
    timeout: float


@dataclass
class Round:
    """What the client saw in one configuration during one round."""

    config: str
    round: int
    duration_s: float
    """From the first request sent to the last answer received."""
    streams: list[RequestResult]
    longs: list[RequestResult]


async def run_round(
    url: str, model: str, streams: list[RequestSpec], longs: list[RequestSpec], load: Load
) -> tuple[list[RequestResult], list[RequestResult], float]:
    """N streams in a closed loop for load.duration seconds and, when load.long_every is set,
    long prompts sent on a fixed clock (one every long_every seconds from long_every on), each
    answered in full before the round ends."""
    cfg = BenchConfig(targets=[], stages=[], endpoint="completions", ignore_eos=True, temperature=0.0)
    endpoint = f"{url}/v1/completions"
    stream_results: list[RequestResult] = []
    long_results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=load.streams + 8)
    timeout = httpx.Timeout(load.timeout, connect=min(load.timeout, 30.0))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t_run = time.perf_counter()
        deadline = t_run + load.duration
        counter = itertools.count()

        async def stream() -> None:
            while time.perf_counter() < deadline:
                i = next(counter)
                spec = streams[i % len(streams)]
                payload = build_payload(spec, cfg, model)
                stream_results.append(await send_request(client, endpoint, payload, {}, i, t_run, spec.input_len))

        async def long_prompt(k: int, spec: RequestSpec) -> None:
            payload = build_payload(spec, cfg, model)
            long_results.append(await send_request(client, endpoint, payload, {}, k, t_run, spec.input_len))

        async def long_prompts() -> None:
            if load.long_every is None:
                return
            sent: list[asyncio.Task[None]] = []
            for k, spec in enumerate(longs):
                due = t_run + (k + 1) * load.long_every
                if due >= deadline:
                    break
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                sent.append(asyncio.create_task(long_prompt(k, spec)))
            await asyncio.gather(*sent)

        await asyncio.gather(long_prompts(), *(stream() for _ in range(load.streams)))
    duration = time.perf_counter() - t_run
    return sorted(stream_results, key=lambda r: r.index), sorted(long_results, key=lambda r: r.index), duration


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


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def markdown(results: list[dict[str, Any]], skipped: dict[str, str]) -> str:
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


def validate(args: argparse.Namespace) -> list[str]:
    """The configurations asked for; a BenchError naming the flag for any out of bounds."""
    bounds = (
        ("--streams", args.streams, 1, 256),
        ("--stream-prompt", args.stream_prompt, 1, 1_000_000),
        ("--stream-tokens", args.stream_tokens, 2, 4096),
        ("--long-len", args.long_len, 1, 1_000_000),
        ("--long-tokens", args.long_tokens, 1, 4096),
        ("--shared-prefix", args.shared_prefix, 0, args.long_len - 1),
        ("--rounds", args.rounds, 1, 100),
    )
    for flag, value, low, high in bounds:
        if not low <= value <= high:
            raise BenchError(f"{flag} must be in [{low}, {high}], got {value}")
    for flag, seconds in (
        ("--long-every", args.long_every),
        ("--duration", args.duration),
        ("--timeout", args.timeout),
        ("--ready-timeout", args.ready_timeout),
    ):
        if not 0 < seconds <= 86_400:
            raise BenchError(f"{flag} must be a number of seconds in (0, 86400], got {seconds:g}")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise BenchError(f"--configs: {', '.join(unknown) or 'none given'}; choose from {', '.join(CONFIGS)}")
    parse_cpus(args.prefill_cpus, "--prefill-cpus")
    parse_cpus(args.decode_cpus, "--decode-cpus")
    try:
        serve_args = shlex.split(args.serve_args)
    except ValueError as exc:
        raise BenchError(f"--serve-args: {exc}") from None
    for flag in ("--host", "--port", "--role", "--num-threads", "--kv-transfer-port", "--kv-peers"):
        if any(arg == flag or arg.startswith(f"{flag}=") for arg in serve_args):
            raise BenchError(f"--serve-args: the bench sets {flag} itself")
    return [c for c in CONFIGS if c in configs]


def stream_prompts(tok: ServedTokenizer, args: argparse.Namespace, variant: int) -> list[RequestSpec]:
    """The streams' prompts of one round; each `variant` draws new words."""
    prompt, answer = LengthDist("fixed", args.stream_prompt), LengthDist("fixed", args.stream_tokens)
    return synthetic(tok, args.streams * STREAM_POOL_PER_STREAM, prompt, answer, args.seed, variant=variant)


def long_prompts(tok: ServedTokenizer, args: argparse.Namespace, count: int, variant: int) -> list[RequestSpec]:
    """`count` long prompts, --shared-prefix tokens of each the same for every variant."""
    own = LengthDist("fixed", args.long_len - args.shared_prefix)
    answer = LengthDist("fixed", args.long_tokens)
    return synthetic(tok, count, own, answer, args.seed + 1, shared_prefix_len=args.shared_prefix, variant=variant)


def check_fits(tok: ServedTokenizer, args: argparse.Namespace) -> None:
    body = {"model": tok.model, "prompt": ""}
    limit = int(checked(tok.client.post("/tokenize", json=body)).json()["max_model_len"])
    for flag, tokens, answer in (
        ("--long-len", args.long_len, args.long_tokens),
        ("--stream-prompt", args.stream_prompt, args.stream_tokens),
    ):
        if tokens + answer + 1 > limit:
            raise BenchError(
                f"{flag} {tokens} + its answer {answer} does not fit the server's max_model_len {limit}: "
                "raise it (--serve-args '--max-model-len N') or shorten the prompts"
            )


def warm_up(deployment: Deployment, model: str, long_prompt: str, timeout: float) -> None:
    """The engines' one-off calibration waited out and one long prompt computed
    (unrecorded): the first measured request of a round finds everything started."""
    with httpx.Client(base_url=deployment.url, timeout=timeout) as client:
        settle(client, model)
        complete(client, model, long_prompt, 2)


def measure(args: argparse.Namespace, configs: list[str], work: Path) -> tuple[list[Round], dict[str, str]]:
    deployments, skipped = start_deployments(args, configs, work)
    try:
        rounds: list[Round] = []
        live = [c for c in configs if c in deployments]
        if not live:
            return rounds, skipped
        first = deployments[live[0]]
        with httpx.Client(base_url=first.server_url, timeout=args.timeout) as api:
            model = str(checked(api.get("/v1/models")).json()["data"][0]["id"])
            tok = ServedTokenizer(api, model)
            check_fits(tok, args)
            (warm_long,) = long_prompts(tok, args, 1, variant=-1)
            for config in live:
                if deployments[config].url not in {deployments[c].url for c in live[: live.index(config)]}:
                    warm_up(deployments[config], model, warm_long.prompt or "", args.timeout)
            per_round = int(args.duration / args.long_every)
            for index in range(args.rounds):
                for config in live:
                    # alone and colocated share a server: each round's prompts are new to it
                    variant = 2 * index + (config == "alone")
                    streams = stream_prompts(tok, args, variant)
                    longs = [] if config == "alone" else long_prompts(tok, args, per_round, variant)
                    load = Load(
                        args.streams, args.duration, None if config == "alone" else args.long_every, args.timeout
                    )
                    print(f"round {index + 1}/{args.rounds}: {config} ...", flush=True)
                    got_streams, got_longs, seconds = asyncio.run(
                        run_round(deployments[config].url, model, streams, longs, load)
                    )
                    rounds.append(Round(config, index, seconds, got_streams, got_longs))
        return rounds, skipped
    finally:
        stop_all(deployments)


def run(args: argparse.Namespace) -> int:
    try:
        configs = validate(args)
        work = Path(tempfile.mkdtemp(prefix="stoker-bench-pd-"))
        try:
            rounds, skipped = measure(args, configs, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    except BenchError as exc:
        print(f"stoker bench pd: {exc}", file=sys.stderr)
        return 2
    for config, why in skipped.items():
        print(f"{config}: skipped ({why})", file=sys.stderr)
    results = [
        figures(c, [rd for rd in rounds if rd.config == c]) for c in configs if any(rd.config == c for rd in rounds)
    ]
    print(markdown(results, skipped))
    if args.out:
        data = {
            "command": "stoker " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "config": {k: v for k, v in vars(args).items() if k != "func"},
            "results": results,
            "split_itl_p99_over_alone": itl_p99_ratio({r["config"]: r for r in results}, "split"),
            "skipped": skipped,
            "rounds": [asdict(rd) for rd in rounds],
        }
        Path(args.out).write_text(json.dumps(data, indent=2))
    if args.plot and rounds:
        plot(args.plot, rounds)
    return 0 if results and all(r["errors"] == 0 for r in results) else 1
