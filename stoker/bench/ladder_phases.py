"""The phases `stoker bench ladder` sends to a rung's running engines, through
the serve bench's client (stoker.bench.serve.run_bench), engines alternating
within every round, and the figures it keeps of each: medians over rounds."""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from stoker.bench.serve import BenchConfig, Stage, Target, run_bench
from stoker.bench.workload import LengthDist, RequestSpec, Tokenizer, load_tokenizer, synthetic

if TYPE_CHECKING:
    from stoker.bench.ladder_engines import Started


def measure(
    started: list[Started],
    rung: dict[str, Any],
    args: argparse.Namespace,
    input_len: LengthDist,
    output_len: LengthDist,
    streams: list[int],
    prefill: list[int],
    path: Path,
) -> None:
    """Every phase against every started engine; figures into rung["engines"][name]."""
    if not started:
        return
    tok = load_tokenizer(str(path))
    targets = [Target(server.url, server.engine.name) for server in started]
    # (key, clients, prompt tokens, tokens out, requests per round)
    phases: list[tuple[str, int, LengthDist, LengthDist, int]] = [("stream", 1, input_len, output_len, args.requests)]
    phases += [(f"streams_{c}", c, input_len, output_len, max(args.requests, c * args.requests // 2)) for c in streams]
    one = LengthDist("fixed", 1)
    phases += [(f"prefill_{n}", 1, LengthDist("fixed", n), one, max(1, args.requests // 2)) for n in prefill]
    for index, (key, clients, prompt, out, requests) in enumerate(phases):
        print(f"{rung['name']}: {key} ({requests} requests x {args.repeats} rounds, {clients} at a time)")
        cfg = BenchConfig(
            targets=targets,
            stages=[Stage("closed", clients)],
            endpoint="completions",
            num_requests=requests,
            repeats=args.repeats,
            ignore_eos=True,
            temperature=0.0,
            timeout=args.timeout,
            warmup=1 if index == 0 else 0,
            seed=args.seed + index,
        )
        workload = functools.partial(_prompts, tok, requests, prompt, out, cfg.seed)
        runs = asyncio.run(run_bench(cfg, workload))
        for target in targets:
            summaries: list[dict[str, Any]] = [
                cast("dict[str, Any]", run["summary"]) for run in runs if run["target"] == target.label
            ]
            figures = rung["engines"][target.label]
            failed = sum(int(s["failed"]) for s in summaries)
            if failed:
                rung["notes"].append(f"{target.label}: {failed} failed request(s) in {key}")
            _keep(figures, key, summaries, prompt, rung["roofline_tok_s"])


def _prompts(tok: Tokenizer, n: int, prompt: LengthDist, out: LengthDist, seed: int, k: int) -> list[RequestSpec]:
    """The k-th round's prompts: new ones each round, so no prefix cache answers from an earlier one."""
    return synthetic(tok, n, prompt, out, seed, variant=k)


def _median(summaries: list[dict[str, Any]], *path: str) -> float | None:
    values = []
    for summary in summaries:
        value: Any = summary
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, (int, float)) and value > 0:
            values.append(float(value))
    return statistics.median(values) if values else None


def _keep(figures: dict[str, Any], key: str, summaries: list[dict[str, Any]], prompt: LengthDist, roof: float) -> None:
    if key == "stream":
        figures["one_stream_tok_s"] = _median(summaries, "output_tok_s")
        tpot = _median(summaries, "tpot", "p50")
        figures["decode_tok_s"] = 1 / tpot if tpot else None
        figures["decode_of_roofline"] = 1 / tpot / roof if tpot else None
    elif key.startswith("streams_"):
        figures[f"{key}_tok_s"] = _median(summaries, "output_tok_s")
    else:
        ttft = _median(summaries, "ttft", "p50")
        figures[f"{key}_ttft_s"] = ttft
        figures[f"{key}_tok_s"] = prompt.a / ttft if ttft else None
