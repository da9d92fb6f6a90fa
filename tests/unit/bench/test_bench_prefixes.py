"""The shared-prefix workload's fill and restart step, against the scripted fake
server: --prefix-fill sends each prefix alone, unrecorded, before any run, and
those are the prefixes the measured prompts start with; --between-runs runs
before each measured run with the run named in its environment, then waits for
/ready; a failing command stops the bench; cached tokens reach the summary."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from rich.console import Console

from stoker.bench.cli import add_serve_arguments, serve_main
from stoker.bench.fakeserver import FakeServer
from stoker.bench.serve import BenchConfig, BetweenRunsError, Stage, make_targets, print_prefix_working_set, run_bench
from stoker.bench.workload import LengthDist, prefix_fill, synthetic


class WordTokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join("x" * i for i in ids)


def test_the_fill_holds_the_prefixes_the_prompts_start_with() -> None:
    tok = WordTokenizer()
    fill = prefix_fill(tok, 30, 3, seed=7)
    assert [len(tok.encode(spec.prompt or "")) for spec in fill] == [30, 30, 30]
    assert [spec.output_len for spec in fill] == [1, 1, 1]
    for variant in (0, 1):
        specs = synthetic(tok, 6, LengthDist("fixed", 10), None, 7, 30, 3, variant=variant)
        for i, spec in enumerate(specs):
            assert (spec.prompt or "").startswith((fill[i % 3].prompt or "") + " ")


async def test_fill_then_a_command_before_each_measured_run(tmp_path: Path) -> None:
    log = tmp_path / "runs.jsonl"
    command = (
        f"{shlex.quote(sys.executable)} -c 'import json, os; "
        f'print(json.dumps({{k: v for k, v in os.environ.items() if k.startswith("STOKER_BENCH_")}}))\' >> {log}'
    )
    tok = WordTokenizer()
    async with FakeServer(ttft=0.0, itl=0.0, prefix_cache=True) as a, FakeServer(ttft=0.0, itl=0.0) as b:
        cfg = BenchConfig(
            targets=make_targets([a.url, b.url]),
            stages=[Stage("closed", 2)],
            endpoint="completions",
            num_requests=4,
            repeats=2,
            warmup=0,
            prefix_fill=prefix_fill(tok, 12, 2),
            between_runs=command,
        )
        runs = await run_bench(cfg, lambda k: synthetic(tok, 4, LengthDist("fixed", 5), None, 0, 12, 2, variant=k))
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        assert [(c["STOKER_BENCH_URL"], c["STOKER_BENCH_REPETITION"]) for c in calls] == [
            (a.url, "0"),
            (b.url, "0"),
            (a.url, "1"),
            (b.url, "1"),
        ]
        assert {c["STOKER_BENCH_STAGE"] for c in calls} == {"c=2"}
        sent = [(q["method"], q["path"], q["body"].get("max_tokens")) for q in a.requests if q["path"] != "/v1/models"]
        assert sent[:3] == [("POST", "/v1/completions", 1), ("POST", "/v1/completions", 1), ("GET", "/ready", None)]
    assert [r["summary"]["completed"] for r in runs] == [4, 4, 4, 4]  # the fill is not among them
    # Every measured prompt on a starts with a prefix the fill had sent: at least 12 of its 17 words cached.
    assert all(r["summary"]["cached_share"] >= 12 / 17 for r in runs if r["url"] == a.url)
    assert [r["summary"]["cached_share"] for r in runs if r["url"] == b.url] == [None, None]


async def test_a_failing_command_stops_the_bench() -> None:
    async with FakeServer() as server:
        cfg = BenchConfig(
            targets=make_targets([server.url]), stages=[Stage("closed", 1)], warmup=0, between_runs="exit 3"
        )
        with pytest.raises(BetweenRunsError, match="exited with 3"):
            await run_bench(cfg, synthetic(WordTokenizer(), 2, LengthDist("fixed", 3), None))


async def test_the_working_set_is_printed_against_the_kv_cache(capsys: pytest.CaptureFixture[str]) -> None:
    async with FakeServer() as server:  # no /server_info: nothing claimed for it
        cfg = BenchConfig(targets=make_targets([server.url]), stages=[])
        await print_prefix_working_set(Console(), cfg, 2000, 40)
    assert capsys.readouterr().out.strip() == "shared prefixes: 40 x 2000 tokens = 80000 tokens"


async def test_prefix_fill_needs_shared_prefixes() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--prefix-fill", "--no-progress"])
    assert await serve_main(args, WordTokenizer()) == 2
