"""`stoker bench prefix-restart`: what the prefix cache's disk tier buys a long prompt.

Starts `stoker serve --kv-cache-disk DIR` itself (the real CLI, on 127.0.0.1,
a free port, --serve-args passed through), sends --prefixes distinct prompts of
about --prefix-len tokens each twice: (a) new, computed; (b) from the RAM prefix
cache. Then it stops the server (SIGTERM: the disk tier writes what it has
queued), starts it again on the same DIR and sends each once more: (c) from
disk. Streamed greedy completions of --max-tokens tokens; per request the time
to the first token, usage's cached_tokens and the text, which must be the same
in a, b and c (a mismatch is reported and the command exits 1).

Before measuring, each server gets two short warm-up requests a little more
than the engine's idle poll apart: the engine measures its speculative
decoding step costs once, at its first idle poll after it started, and a
request arriving meanwhile waits for that. The second warm-up either finds
the measurement done or waits for it, so no measured request does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from stoker.bench.server_ready import wait_until_ready

# These three live with the workloads (bench serve counts with the served tokenizer too); pd imports them from here.
from stoker.bench.workload import BenchError as BenchError
from stoker.bench.workload import ServedTokenizer as ServedTokenizer
from stoker.bench.workload import checked as checked
from stoker.bench.workload import fit_text

PHASES = ("new", "ram", "disk")
ENGINE_IDLE_POLL_S = 0.5
"""stoker.engine.process.IDLE_POLL_MS (not imported: it would pull zmq and the engine into the bench)."""
WARMUP_PROMPT = "Hello."
"""Shorter than a KV block (16 tokens by default): it leaves nothing in either tier to count as a hit."""
MAX_PREFIX_LEN = 1_000_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server (started and stopped by the bench)")
    s.add_argument("--model", default=None, help="model to serve (`stoker serve --model`; default: its default)")
    s.add_argument(
        "--serve-args",
        default="",
        help='more `stoker serve` flags, one string, e.g. "--num-threads 2 --kv-cache-disk-size 4GB"',
    )
    s.add_argument(
        "--dir",
        default=None,
        help="the --kv-cache-disk folder (default: a new temporary one, removed after); "
        "one that already holds these prefixes makes (a) a disk hit, which the bench reports",
    )
    s.add_argument("--ready-timeout", type=float, default=600, help="seconds each start may take until /ready")
    w = p.add_argument_group("workload")
    w.add_argument("--prefixes", type=int, default=3, help="distinct prompts, each sent new, from RAM, from disk")
    w.add_argument("--prefix-len", type=int, default=4000, help="tokens per prompt (the served tokenizer's)")
    w.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (ignore_eos)")
    w.add_argument("--seed", type=int, default=0, help="seed of the prompts' random words")
    w.add_argument("--timeout", type=float, default=1800, help="seconds one request may take")
    p.add_argument("--out", default=None, metavar="FILE", help="write every measurement as JSON here")


@dataclass
class Sample:
    prefix: int
    phase: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    text: str


@dataclass
class Report:
    samples: list[Sample] = field(default_factory=list)
    disk_metrics: dict[str, float] = field(default_factory=dict)
    mismatches: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def of(self, phase: str) -> list[Sample]:
        return [s for s in self.samples if s.phase == phase]

    def medians(self) -> dict[str, float]:
        return {phase: statistics.median(s.ttft_s for s in self.of(phase)) for phase in PHASES if self.of(phase)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One `stoker serve` child on 127.0.0.1, its output in a log file."""

    def __init__(self, serve_args: list[str], work: Path, ready_timeout: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work / f"server-{self.port}.log"
        # Its own key database: the user's keys would close the server to the bench.
        env = {**os.environ, "STOKER_DB": str(work / "stoker.db")}
        argv = [sys.executable, "-m", "stoker.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*argv, *serve_args], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def _wait_ready(self, timeout: float) -> None:
        why = wait_until_ready(self.url, self.proc, timeout, interval=0.2)
        if why is not None:
            bound = "" if self.proc.poll() is not None else " (--ready-timeout)"
            raise BenchError(f"stoker serve {why}{bound}:\n{self.log_tail()}")

    def stop(self, timeout: float = 120) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def complete(client: httpx.Client, model: str, prompt: str, max_tokens: int) -> tuple[float, int, int, str]:
    """(seconds to the first text, prompt_tokens, cached_tokens, text) of one streamed greedy completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    text = ""
    usage: dict[str, object] = {}
    with client.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            reply.read()
            checked(reply)
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise BenchError(f"the stream failed: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                if choice.get("text") and first is None:
                    first = time.perf_counter() - started
                text += choice.get("text") or ""
            usage = chunk.get("usage") or usage
    if first is None:
        raise BenchError("a completion streamed no text")
    details = usage.get("prompt_tokens_details")
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    prompt_tokens = usage.get("prompt_tokens")
    return first, int(prompt_tokens) if isinstance(prompt_tokens, int) else -1, cached, text


def settle(client: httpx.Client, model: str) -> None:
    """Wait out the engine's one-off calibration (see the module's docstring)."""
    complete(client, model, WARMUP_PROMPT, 1)
    time.sleep(2 * ENGINE_IDLE_POLL_S)
    complete(client, model, WARMUP_PROMPT, 1)


def disk_metrics(client: httpx.Client) -> dict[str, float]:
    reply = client.get("/metrics")
    if reply.status_code != 200:
        return {}
    metrics = {}
    for line in reply.text.splitlines():
        if line.startswith("stoker:kv_disk") and "_created" not in line:
            name, _, value = line.rpartition(" ")
            metrics[name.partition("{")[0]] = float(value)  # one model served: its label says nothing
    return metrics


def measure(args: argparse.Namespace, work: Path, disk: Path) -> Report:
    serve_args = ["--kv-cache-disk", str(disk), *shlex.split(args.serve_args)]
    if args.model:
        serve_args += ["--model", args.model]
    report = Report()
    prompts: list[str] = []
    for phase_pair in (("new", "ram"), ("disk",)):
        server = Server(serve_args, work, args.ready_timeout)
        try:
            with httpx.Client(base_url=server.url, timeout=args.timeout) as client:
                model = str(checked(client.get("/v1/models")).json()["data"][0]["id"])
                settle(client, model)
                if not prompts:
                    prompts = make_prompts(ServedTokenizer(client, model), args)
                for i, prompt in enumerate(prompts):
                    for phase in phase_pair:
                        seconds, tokens, cached, text = complete(client, model, prompt, args.max_tokens)
                        report.samples.append(Sample(i + 1, phase, seconds, tokens, cached, text))
                        print(f"prefix {i + 1} {phase:4s}: {seconds * 1000:9.1f} ms, cached_tokens {cached}")
                if phase_pair == ("disk",):
                    time.sleep(2)  # the front end's stats arrive each second: the last request's included
                    report.disk_metrics = disk_metrics(client)
        finally:
            server.stop()
    check(report)
    return report


def make_prompts(tok: ServedTokenizer, args: argparse.Namespace) -> list[str]:
    limit = int(checked(tok.client.post("/tokenize", json={"model": tok.model, "prompt": ""})).json()["max_model_len"])
    if args.prefix_len + args.max_tokens + 1 > limit:
        raise BenchError(
            f"--prefix-len {args.prefix_len} + --max-tokens {args.max_tokens} does not fit the server's "
            f"max_model_len {limit}: raise it (--serve-args '--max-model-len N') or shorten the prompts"
        )
    return [fit_text(tok, random.Random(f"{args.seed}/{i}"), args.prefix_len) for i in range(args.prefixes)]


def check(report: Report) -> None:
    for i in sorted({s.prefix for s in report.samples}):
        texts = {s.text for s in report.samples if s.prefix == i}
        if len(texts) > 1:
            report.mismatches.append(i)
    if any(s.cached_tokens for s in report.of("new")):
        report.warnings.append("(a) found cached tokens: the folder already held these prompts, (a) is not new")
    if any(not s.cached_tokens for s in report.of("disk")):
        report.warnings.append("(c) found nothing cached: the disk tier served nothing after the restart")


def duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


def print_report(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="TTFT of a long prompt: (a) new, (b) in RAM, (c) on disk after a restart")
    for column in ("prefix", "tokens", "(a) new", "(b) RAM", "(c) disk", "cached (b, c)", "text a = b = c"):
        table.add_column(column, justify="right")
    by = {(s.prefix, s.phase): s for s in report.samples}
    for i in sorted({s.prefix for s in report.samples}):
        a, b, c = by[(i, "new")], by[(i, "ram")], by[(i, "disk")]
        same = "[red]NO[/red]" if i in report.mismatches else "yes"
        row = [str(i), str(a.prompt_tokens), *(duration(s.ttft_s) for s in (a, b, c))]
        table.add_row(*row, f"{b.cached_tokens}, {c.cached_tokens}", same)
    medians = report.medians()
    table.add_row("median", "", *(duration(medians[p]) for p in PHASES), "", "")
    console.print(table)
    console.print(
        f"(c) is {medians['new'] / medians['disk']:.1f}x faster than (a); (b) {medians['new'] / medians['ram']:.1f}x"
    )
    for name, value in report.disk_metrics.items():
        console.print(f"  {name} {value:g}")
    for warning in report.warnings:
        console.print(f"[yellow]warning: {warning}[/yellow]")
    if report.mismatches:
        console.print(
            f"[bold red]MISMATCH: the text differs between new, RAM and disk for prefix(es) {report.mismatches}"
            "[/bold red]"
        )
        for s in report.samples:
            if s.prefix in report.mismatches:
                console.print(f"  prefix {s.prefix} {s.phase}: {s.text!r}")


def validate(args: argparse.Namespace) -> None:
    bounds = (("--prefixes", args.prefixes, 1, 1000), ("--prefix-len", args.prefix_len, 1, MAX_PREFIX_LEN))
    for flag, value, low, high in (*bounds, ("--max-tokens", args.max_tokens, 1, 4096)):
        if not low <= value <= high:
            raise BenchError(f"{flag} must be in [{low}, {high}], got {value}")
    for flag, seconds in (("--ready-timeout", args.ready_timeout), ("--timeout", args.timeout)):
        if not seconds > 0:
            raise BenchError(f"{flag} must be a positive number of seconds, got {seconds:g}")
    if args.dir is not None and not Path(args.dir).is_dir():
        raise BenchError(f"--dir {args.dir}: not a folder")
    try:
        serve_args = shlex.split(args.serve_args)
    except ValueError as exc:
        raise BenchError(f"--serve-args: {exc}") from None
    for flag in ("--kv-cache-disk", "--host", "--port"):
        if any(arg == flag or arg.startswith(f"{flag}=") for arg in serve_args):
            raise BenchError(f"--serve-args: the bench sets {flag} itself (the folder: --dir)")


def run(args: argparse.Namespace) -> int:
    try:
        validate(args)
        work = Path(tempfile.mkdtemp(prefix="stoker-prefix-restart-"))
        try:
            disk = Path(args.dir) if args.dir else work / "kv"
            disk.mkdir(exist_ok=True)
            report = measure(args, work, disk)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    except BenchError as exc:
        print(f"stoker bench prefix-restart: {exc}", file=sys.stderr)
        return 2
    print_report(report)
    if args.out:
        data = {
            "prefix_len": args.prefix_len,
            "max_tokens": args.max_tokens,
            "medians_s": report.medians(),
            **asdict(report),
        }
        Path(args.out).write_text(json.dumps(data, indent=2))
    return 1 if report.mismatches else 0
