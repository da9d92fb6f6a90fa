"""`stoker bench`: serve (load test any OpenAI-compatible server), offline (the
engine without HTTP vs Hugging Face transformers), kernels, quality,
self-draft, hostile, rerank, prefix-restart, pd and ladder (docs/bench.md)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import shlex
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stoker.bench.workload import LengthDist, RequestSpec, ServedTokenizer, Tokenizer
from stoker.cli_keys import add_key_options, api_key_of

if TYPE_CHECKING:
    from rich.console import Console

    from stoker.bench.serve import BenchConfig, Stage, Target


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = subparsers.add_parser("bench", help="load testing and throughput benchmarks", description=__doc__)
    sub = bench.add_subparsers(
        dest="bench_command",
        metavar="{serve,offline,kernels,quality,self-draft,hostile,rerank,prefix-restart,pd,ladder}",
    )
    from stoker.bench import hostile, kernels, ladder, offline, pd, prefix_restart, quality, rerank, self_draft

    commands: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[..., Any]]] = [
        ("serve", "load test an OpenAI-compatible server (streaming)", add_serve_arguments, run_serve),
        ("offline", "engine throughput without HTTP, vs transformers", offline.add_arguments, offline.run),
        (
            "kernels",
            "the quantized (GGUF block) matmul kernels vs torch, on the default model's shapes",
            kernels.add_arguments,
            kernels.run,
        ),
        (
            "quality",
            "perplexity over a text through servers' echo+logprobs, side by side",
            quality.add_arguments,
            quality.run_cli,
        ),
        (
            "self-draft",
            "would a layer subset of the model pay as its own speculative draft? (agreement, cost, speedup)",
            self_draft.add_arguments,
            self_draft.run,
        ),
        (
            "hostile",
            "one stream's inter-token latency alone and beside hostile requests (long stop lists, "
            "big logit_bias, U+FFFD, big grammars)",
            hostile.add_arguments,
            hostile.run,
        ),
        ("rerank", "c=16 /v1/rerank throughput of servers (req/s, docs/s, p50/p99)", rerank.add_arguments, rerank.run),
        (
            "prefix-restart",
            "TTFT of long prompts new, in RAM and on disk after a restart (starts stoker serve --kv-cache-disk)",
            prefix_restart.add_arguments,
            prefix_restart.run,
        ),
        (
            "pd",
            "decode streams' ITL alone, beside long prompts, and with prefill split off behind sglang-router "
            "(starts the servers)",
            pd.add_arguments,
            pd.run,
        ),
        (
            "ladder",
            "stoker beside llama-server and vLLM CPU on synthetic GGUFs of real model sizes, 0.5B to 8B "
            "(starts the servers)",
            ladder.add_arguments,
            ladder.run,
        ),
    ]
    for name, help_text, add_arguments, run in commands:
        p = sub.add_parser(name, help=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_arguments(p)
        p.set_defaults(func=needs_bench_extra(run))

    def print_bench_help(_args: argparse.Namespace) -> int:
        bench.print_help()
        return 2

    bench.set_defaults(func=print_bench_help)


# `pip install stoker[bench]`: what `stoker bench` needs and `stoker serve` does not.
BENCH_EXTRA = ("matplotlib", "accelerate")


def needs_bench_extra(run: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], Any]:
    """`run`, refused in one line (exit 2) where the bench extra is not installed."""

    @functools.wraps(run)
    def checked(args: argparse.Namespace) -> Any:
        missing = [name for name in BENCH_EXTRA if importlib.util.find_spec(name) is None]
        if missing:
            print(
                f"stoker bench needs its extra dependencies ({', '.join(missing)} missing):"
                " pip install 'stoker[bench]'",
                file=sys.stderr,
            )
            return 2
        return run(args)

    return checked


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("servers")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the server (with or without /v1)")
    g.add_argument(
        "--compare",
        default=None,
        metavar="URL2[,URL3]",
        help="other servers to run the same workload against, alternating A,B,A,B per repetition",
    )
    g.add_argument("--model", default=None, help="model name to send; default: the first one each server lists")
    g.add_argument(
        "--models",
        action="append",
        default=None,
        metavar="A,B,C",
        help="model names the requests take in turn (round robin: LoRA adapters of one base, several models); "
        "repeat once per server, --url first then each --compare, to give each its own (the same URL twice "
        "compares two mixes on one server)",
    )
    add_key_options(g, ("STOKER_API_KEY", "OPENAI_API_KEY"))
    g.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="completions sends exact-length text; chat wraps it in the server's chat template",
    )
    g = p.add_argument_group("load shape (closed loop unless --rate or --burst)")
    g.add_argument(
        "--concurrency", default=None, help="concurrent clients; a list sweeps: 1,4,16,32 (default 1; 16 with --soak)"
    )
    g.add_argument("--rate", default=None, help="open loop: Poisson arrivals at R req/s (a list sweeps)")
    g.add_argument("--burst", action="store_true", help="send all requests at once")
    g.add_argument("--num-requests", type=int, default=100, help="requests per stage and repetition")
    g.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds per stage after which no request starts (default: none; 600 with --soak)",
    )
    g.add_argument("--repeats", type=int, default=None, help="repetitions per stage (default 1; 2 with --compare)")
    g.add_argument("--warmup", type=int, default=1, help="unrecorded requests per server before measuring")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", default="100:1000", help="prompt tokens: N, A:B (uniform) or normal:MEAN:STD")
    g.add_argument("--output-len", default="128", help="max_tokens: N, A:B or normal:MEAN:STD")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every answer is max_tokens long")
    g.add_argument("--temperature", type=float, default=None, help="sent only when given")
    g.add_argument(
        "--workload",
        choices=["random", "grounded"],
        default="random",
        help="random: random words; grounded: a passage then 'copy it' (answers repeat their prompt: "
        "the workload where speculative decoding pays)",
    )
    g.add_argument("--dataset", default=None, help='JSONL of {"prompt": ...} or {"messages": [...]}')
    g.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of common prefix (prefix-cache workload)")
    g.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes, used round robin")
    g.add_argument(
        "--prefix-fill",
        action="store_true",
        help="before measuring, send each shared prefix alone to each server once (unrecorded): "
        "every prefix is computed, and a disk tier holds it, before a run starts",
    )
    g.add_argument(
        "--between-runs",
        default=None,
        metavar="CMD",
        help="shell command run before each measured run, e.g. one that restarts the server "
        "($STOKER_BENCH_URL, _TARGET, _STAGE, _REPETITION say which run); then /ready must answer 200",
    )
    g.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for /ready after --between-runs")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="GGUF file or HF folder whose tokenizer counts the prompts' tokens here, instead of the served "
        "model's through --url's /tokenize (vLLM's or llama-server's schema; where the server answers neither, "
        "stoker's default model's, with a line saying so)",
    )
    g.add_argument("--seed", type=int, default=0)
    add_soak_arguments(p)
    g = p.add_argument_group("output")
    g.add_argument(
        "--cost-per-hour",
        type=float,
        default=None,
        metavar="DOLLARS",
        help="machine price: report $ per 1M output (and total) tokens at the measured throughput",
    )
    g.add_argument("--slo", default=None, help="goodput SLO, e.g. ttft=500ms,tpot=100ms (e2e too)")
    g.add_argument("--out", default=None, metavar="DIR", help="write results.json, report.md and PNG plots here")
    g.add_argument("--no-progress", action="store_true", help="no live progress bar")


def add_soak_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "soak (--soak: a long mixed load while the server's memory is sampled; "
        "uses --url, --model, --api-key, --endpoint, --concurrency, --duration, --timeout, --seed, --out)"
    )
    g.add_argument("--soak", action="store_true", help="run the soak instead of the benchmark")
    g.add_argument("--pid", type=int, default=None, help="the server's pid: its processes' RSS is sampled")
    g.add_argument("--prompt-words", default="3:300", help="prompt length in words, A:B uniform")
    g.add_argument("--max-tokens", default="1:128", help="max_tokens, A:B uniform")
    g.add_argument("--stream-share", type=float, default=0.5, help="share of requests streamed")
    g.add_argument("--cancel-share", type=float, default=0.25, help="share of streamed requests the client cuts off")
    g.add_argument("--bad-share", type=float, default=0.05, help="share of malformed requests (a 4xx expected)")
    g.add_argument("--rss-interval", type=float, default=5.0, help="seconds between RSS samples")
    g.add_argument("--soak-warmup", type=float, default=60.0, help="seconds after which 'after warm-up' RSS is read")
    g.add_argument("--growth-window", type=float, default=5.0, help="minutes at the end over which growth is measured")


def _range(spec: str, name: str) -> tuple[int, int]:
    dist = LengthDist.parse(spec)
    if dist.kind == "normal":
        raise ValueError(f"--{name}: use N or A:B")
    return (int(dist.a), int(dist.a)) if dist.kind == "fixed" else (int(dist.a), int(dist.b))


def _share(x: float, name: str) -> float:
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"--{name} must be between 0 and 1, got {x}")
    return x


async def soak_main(args: argparse.Namespace) -> int:
    """`stoker bench serve --soak`: exits 1 on any error or if /health fails after the load."""
    from rich.console import Console

    from stoker.bench import report, soak
    from stoker.bench.workload import parse_int_list

    console = Console(stderr=False)
    (concurrency,) = parse_int_list(args.concurrency or "16")
    url = args.url.rstrip("/").removesuffix("/v1")
    cfg = soak.SoakConfig(
        url=url,
        model=args.model,
        endpoint=args.endpoint,
        duration=args.duration if args.duration is not None else 600.0,
        concurrency=concurrency,
        prompt_words=_range(args.prompt_words, "prompt-words"),
        max_tokens=_range(args.max_tokens, "max-tokens"),
        stream_share=_share(args.stream_share, "stream-share"),
        cancel_share=_share(args.cancel_share, "cancel-share"),
        bad_share=_share(args.bad_share, "bad-share"),
        pid=args.pid,
        rss_interval=args.rss_interval,
        warmup=args.soak_warmup,
        growth_window=args.growth_window,
        api_key=api_key_of(args),
        timeout=args.timeout,
        seed=args.seed,
    )
    if args.pid is not None and not soak.process_tree(args.pid):
        console.print(f"[red]no process {args.pid}[/red]")
        return 2
    console.print(
        f"soak: {cfg.concurrency} clients for {cfg.duration:g}s against {url}"
        + (
            f", sampling pid {cfg.pid} and its children every {cfg.rss_interval:g}s"
            if cfg.pid
            else ", no --pid: no RSS"
        )
    )
    last = {"t": -1e9}

    def on_sample(sample: dict[str, Any], result: soak.SoakResult) -> None:
        if args.no_progress or sample["t"] - last["t"] < 30:
            return
        last["t"] = sample["t"]
        errors = sum(not o.ok for o in result.outcomes)
        rss = ", ".join(f"{p['role']} {p['rss'] / 2**20:.0f} MiB" for p in sample["procs"])
        console.print(f"{sample['t']:6.0f}s  {sample['done']} requests, {errors} errors  {rss}")

    result = await soak.run_soak(cfg, on_sample)
    data = result.to_dict()
    data["command"] = _command()
    report.print_soak(console, data)
    if args.out:
        for path in report.write_soak_outputs(args.out, data):
            console.print(f"wrote {path}")
    summary = data["summary"]
    return 0 if summary["errors"] == 0 and summary["health_after"] == 200 else 1


def choose_tokenizer(args: argparse.Namespace, target: Target, headers: dict[str, str]) -> tuple[Tokenizer, str | None]:
    """What counts the prompts' tokens, and a line to print when it is not what the user
    would expect: --tokenizer's file; else the served model's, through the first server's
    /tokenize; else (the server does not answer it) stoker's default model's."""
    from stoker.bench import workload

    if args.tokenizer:
        return workload.load_tokenizer(args.tokenizer), None
    try:
        return workload.served_tokenizer(target.url, target.model_for(0), headers, min(args.timeout, 60.0)), None
    except workload.BenchError as exc:
        why = str(exc)
        if exc.status == 401 and "authorization" not in {k.lower() for k in headers}:
            why += " (--api-key-file or $STOKER_API_KEY)"
    tok = workload.load_tokenizer()
    return tok, (
        f"tokens: {target.label} gives no tokenizer through /tokenize ({why}); counting with {tok.name} instead, "
        "so --input-len and the prompt lengths are in the default model's tokens, not the served model's: "
        "pass --tokenizer FILE (the served model's GGUF or HF folder) to count with its tokenizer"
    )


def build_workload(args: argparse.Namespace, tok: Tokenizer | None = None) -> Callable[[int], list[RequestSpec]]:
    """Prompts for the k-th (stage, repetition): new ones each time (see run_bench)."""
    from stoker.bench import workload

    out_len = LengthDist.parse(args.output_len) if args.output_len else None
    if tok is None:
        tok = workload.load_tokenizer(args.tokenizer)
    if args.dataset:
        rows = workload.load_dataset(args.dataset, out_len, args.seed, tok)
        # Rotate through the file so that, if it is long enough, no run repeats another's prompts.
        return lambda k: [
            rows[(k * args.num_requests + i) % len(rows)] for i in range(min(len(rows), args.num_requests))
        ]
    if getattr(args, "workload", "random") == "grounded":
        return lambda k: workload.grounded(
            tok, args.num_requests, LengthDist.parse(args.input_len), out_len, args.seed, variant=k
        )
    overhead = tok.chat_overhead() if args.endpoint == "chat" and hasattr(tok, "chat_overhead") else 0
    return lambda k: workload.synthetic(
        tok,
        args.num_requests,
        LengthDist.parse(args.input_len),
        out_len,
        args.seed,
        args.shared_prefix_len,
        args.num_prefixes,
        overhead,
        variant=k,
    )


def build_stages(args: argparse.Namespace) -> list[Stage]:
    from stoker.bench.serve import Stage

    if args.burst:
        return [Stage("burst")]
    if args.rate:
        return [Stage("poisson", float(r)) for r in args.rate.split(",")]
    from stoker.bench.workload import parse_int_list

    return [Stage("closed", c) for c in parse_int_list(args.concurrency or "1")]


async def serve_main(args: argparse.Namespace, tok: Tokenizer | None = None) -> int:
    """The whole of `stoker bench serve`; `tok` lets tests skip choosing a tokenizer (choose_tokenizer)."""
    from rich.console import Console

    from stoker.bench import serve, stats

    console = Console(stderr=False)
    slo = stats.parse_slo(args.slo)
    urls = [args.url] + ([u for u in args.compare.split(",") if u] if args.compare else [])
    try:
        targets = serve.make_targets(urls, args.model, args.models)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    cfg = serve.BenchConfig(
        targets=targets,
        stages=build_stages(args),
        endpoint=args.endpoint,
        num_requests=args.num_requests,
        duration=args.duration,
        repeats=args.repeats or (2 if len(urls) > 1 else 1),
        api_key=api_key_of(args),
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        timeout=args.timeout,
        warmup=args.warmup,
        seed=args.seed,
        between_runs=args.between_runs,
        ready_timeout=args.ready_timeout,
    )
    if args.prefix_fill and (args.shared_prefix_len <= 0 or args.dataset or args.workload != "random"):
        console.print("[red]--prefix-fill needs --shared-prefix-len (and the random workload)[/red]")
        return 2
    t = time.perf_counter()
    if tok is not None:
        return await measure(console, args, cfg, slo, tok, t)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # In a thread: a server in this process (the tests' fake one) answers the probes meanwhile.
    chosen, note = await asyncio.to_thread(choose_tokenizer, args, targets[0], headers)
    if note:
        console.print(note, style="yellow", markup=False, highlight=False, soft_wrap=True)
    try:
        return await measure(console, args, cfg, slo, chosen, t)
    finally:
        if isinstance(chosen, ServedTokenizer):
            chosen.close()


async def measure(
    console: Console, args: argparse.Namespace, cfg: BenchConfig, slo: dict[str, float], tok: Tokenizer, t: float
) -> int:
    """serve_main's runs once its tokenizer is chosen (`t`: when the workload's building began)."""
    from stoker.bench import report, serve, stats

    if args.prefix_fill:
        from stoker.bench.workload import prefix_fill

        cfg.prefix_fill = await asyncio.to_thread(
            prefix_fill, tok, args.shared_prefix_len, args.num_prefixes, args.seed
        )
    workload = functools.lru_cache(maxsize=2)(build_workload(args, tok))  # k=0 is printed, then run
    specs = await asyncio.to_thread(workload, 0)
    lens = [s.input_len for s in specs if s.input_len is not None]
    counted = getattr(tok, "name", None)
    console.print(
        f"workload: {len(specs)} prompts"
        + (f", {min(lens)}–{max(lens)} tokens" if lens else "")
        + f" (built in {time.perf_counter() - t:.1f}s)"
        + (f", counted with {counted}" if counted else ""),
        markup=False,
        soft_wrap=True,
    )
    if args.shared_prefix_len > 0:
        await serve.print_prefix_working_set(console, cfg, args.shared_prefix_len, args.num_prefixes)

    progress = report.make_progress(console)
    state: dict[str, Any] = {"task": None, "failed": 0}

    def on_run(target: serve.Target, stage: serve.Stage, rep: int, total: int) -> None:
        state["failed"] = 0
        state["task"] = progress.add_task(f"{target.label} {stage.label} #{rep}", total=total, failed=0)

    def on_done(r: stats.RequestResult) -> None:
        state["failed"] += not r.ok
        progress.update(state["task"], advance=1, failed=state["failed"])

    if args.no_progress:
        runs = await serve.run_bench(cfg, workload, slo=slo)
    else:
        with progress:
            runs = await serve.run_bench(cfg, workload, on_done, on_run, slo=slo)
    merged = stats.merge_repetitions(runs, slo)
    from stoker.observe.cost import cost_per_million

    if args.cost_per_hour is not None:
        for m in merged:
            s = m["summary"]
            s["cost_per_million_output"] = cost_per_million(args.cost_per_hour, s["output_tok_s"] or 0.0)
            s["cost_per_million_total"] = cost_per_million(args.cost_per_hour, s["total_tok_s"] or 0.0)
    comparisons = stats.compare_runs(runs, cfg.targets[0].label) if len(cfg.targets) > 1 else []
    report.print_report(console, merged, comparisons)
    if args.out:
        result = {
            "command": _command(),
            "config": {k: v for k, v in vars(args).items() if k not in ("func", "api_key", "api_key_file", "key_env")},
            "tokenizer": counted,
            "targets": [vars(t) for t in cfg.targets],
            "merged": merged,
            "comparisons": comparisons,
            "runs": runs,
        }
        for path in report.write_outputs(args.out, result, _command()):
            console.print(f"wrote {path}")
    # Nonzero only when nothing worked at all, so scripts notice a dead server.
    return 0 if any(m["summary"]["completed"] for m in merged) else 1


def _command() -> str:
    return "stoker " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else "stoker bench serve"


def run_serve(args: argparse.Namespace) -> int:
    return asyncio.run(soak_main(args) if args.soak else serve_main(args))
