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

import httpx

from stoker.bench.pd_report import (
    Round,
    figures,
    itl_p99_ratio,
    markdown,
    plot,
    transfer_counters,
    transfer_delta,
)
from stoker.bench.pd_workers import CONFIGS, Deployment, parse_cpus, start_deployments, stop_all
from stoker.bench.prefix_restart import BenchError, ServedTokenizer, checked, complete, settle
from stoker.bench.serve import BenchConfig, build_payload, send_request
from stoker.bench.stats import RequestResult
from stoker.bench.workload import LengthDist, RequestSpec, synthetic

STREAM_POOL_PER_STREAM = 8
"""Distinct prompts drawn per stream and round; a stream that finishes more answers cycles through them."""


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

        async def send(index: int, spec: RequestSpec) -> RequestResult:
            """One request, cut off after load.timeout seconds in all (httpx bounds each read only)."""
            sent = send_request(client, endpoint, build_payload(spec, cfg, model), {}, index, t_run, spec.input_len)
            started = time.perf_counter() - t_run
            try:
                return await asyncio.wait_for(sent, load.timeout)
            except TimeoutError:
                return RequestResult(index, started, error=f"no full answer in {load.timeout:g} s (--timeout)")

        async def stream() -> None:
            while time.perf_counter() < deadline:
                i = next(counter)
                stream_results.append(await send(i, streams[i % len(streams)]))

        async def long_prompt(k: int, spec: RequestSpec) -> None:
            long_results.append(await send(k, spec))

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
    for flag in ("--host", "--port", "--role", "--kv-role", "--num-threads", "--kv-transfer-port", "--kv-peers"):
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


@dataclass
class Measured:
    rounds: list[Round]
    skipped: dict[str, str]
    """Configurations that could not start, each with why."""
    moved: dict[str, dict[str, float]]
    """The split workers' KV transfer counters over the measured rounds, by role; empty without a split."""


def measure(args: argparse.Namespace, configs: list[str], work: Path) -> Measured:
    deployments, skipped = start_deployments(args, configs, work)
    measured = Measured([], skipped, {})
    try:
        live = [c for c in configs if c in deployments]
        if not live:
            return measured
        with httpx.Client(base_url=deployments[live[0]].server_url, timeout=args.timeout) as api:
            model = str(checked(api.get("/v1/models")).json()["data"][0]["id"])
            tok = ServedTokenizer(api, model)
            check_fits(tok, args)
            (warm_long,) = long_prompts(tok, args, 1, variant=-1)
            for config in live:
                if config == "colocated" and "alone" in live:
                    continue  # one server: warmed up once
                try:
                    warm_up(deployments[config], model, warm_long.prompt or "", args.timeout)
                except (BenchError, httpx.HTTPError) as exc:
                    shared = [c for c in live if deployments[c] is deployments[config]]
                    skipped.update(dict.fromkeys(shared, f"its warm-up request failed: {exc}"))
            live = [c for c in live if c not in skipped]
            workers = deployments["split"].workers if "split" in live else {}
            before = transfer_counters(workers)
            per_round = int(args.duration / args.long_every)
            for index in range(args.rounds):
                for config in live:
                    # alone and colocated share a server: each round's prompts are new to it
                    variant = 2 * index + (config == "alone")
                    streams = stream_prompts(tok, args, variant)
                    longs = [] if config == "alone" else long_prompts(tok, args, per_round, variant)
                    every = None if config == "alone" else args.long_every
                    load = Load(args.streams, args.duration, every, args.timeout)
                    print(f"round {index + 1}/{args.rounds}: {config} ...", flush=True)
                    got_streams, got_longs, seconds = asyncio.run(
                        run_round(deployments[config].url, model, streams, longs, load)
                    )
                    measured.rounds.append(Round(config, index, seconds, got_streams, got_longs))
            measured.moved = transfer_delta(before, transfer_counters(workers))
        return measured
    finally:
        stop_all(deployments)


def run(args: argparse.Namespace) -> int:
    try:
        configs = validate(args)
        work = Path(tempfile.mkdtemp(prefix="stoker-bench-pd-"))
        try:
            measured = measure(args, configs, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    except BenchError as exc:
        print(f"stoker bench pd: {exc}", file=sys.stderr)
        return 2
    rounds = measured.rounds
    for config, why in measured.skipped.items():
        print(f"{config}: skipped ({why})", file=sys.stderr)
    ran = [c for c in configs if any(rd.config == c for rd in rounds)]
    results = [figures(c, [rd for rd in rounds if rd.config == c]) for c in ran]
    print(markdown(results, measured.skipped, measured.moved))
    if args.out:
        data = {
            "command": "stoker " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "config": {k: v for k, v in vars(args).items() if k != "func"},
            "results": results,
            "split_itl_p99_over_alone": itl_p99_ratio({r["config"]: r for r in results}, "split"),
            "skipped": measured.skipped,
            "kv_transfer": measured.moved,
            "rounds": [asdict(rd) for rd in rounds],
        }
        Path(args.out).write_text(json.dumps(data, indent=2))
    if args.plot and rounds:
        plot(args.plot, rounds)
    return 0 if results and all(r["errors"] == 0 for r in results) else 1
