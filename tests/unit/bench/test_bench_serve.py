"""The load generator against a scripted fake OpenAI-compatible server: timings
of a normal run, every kind of failure reported instead of raised, load
shapes, alternation between servers, and the whole `stoker bench serve`."""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import Sequence

import pytest

from stoker.bench.cli import add_serve_arguments, serve_main
from stoker.bench.fakeserver import FakeServer
from stoker.bench.serve import BenchConfig, Stage, make_targets, run_bench
from stoker.bench.workload import RequestSpec

SPECS = [RequestSpec(prompt=f"prompt number {i}", input_len=3, output_len=5) for i in range(4)]


class WordTokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join("x" * i for i in ids)


def config(*urls: str, **kw: object) -> BenchConfig:
    defaults: dict = {"stages": [Stage("closed", 2)], "num_requests": 6, "warmup": 0, "timeout": 10.0}
    defaults.update(kw)
    return BenchConfig(targets=make_targets(list(urls)), **defaults)


async def test_normal_run_records_timings_and_sends_standard_requests() -> None:
    async with FakeServer(ttft=0.03, itl=0.005) as server:
        cfg = config(server.url + "/v1/", endpoint="completions", ignore_eos=True, api_key="sk-test", temperature=0.0)
        (run,) = await run_bench(cfg, SPECS)
    s = run["summary"]
    assert (s["completed"], s["failed"]) == (6, 0)
    assert run["model"] == "fake-model"  # discovered from /v1/models
    for r in run["requests"]:
        assert r["ok"] and r["output_tokens"] == 5 and len(r["itls"]) == 4
        assert r["ttft"] >= 0.03 and r["e2e"] >= r["ttft"] + 4 * 0.005
        assert r["prompt_tokens"] == 3  # the fake's usage counts words
    assert s["output_tok_s"] == pytest.approx(30 / s["duration_s"])
    post = next(q for q in server.requests if q["method"] == "POST")
    assert post["path"] == "/v1/completions"
    assert post["headers"]["authorization"] == "Bearer sk-test"
    body = post["body"]
    assert body["stream"] is True and body["max_tokens"] == 5 and body["ignore_eos"] is True
    assert body["temperature"] == 0.0 and body["model"] == "fake-model" and body["prompt"].startswith("prompt number")


async def test_chat_role_chunk_is_not_a_token() -> None:
    async with FakeServer(ttft=0.03, itl=0.0) as server:
        (run,) = await run_bench(config(server.url, endpoint="chat", num_requests=2), SPECS)
    assert [r["output_tokens"] for r in run["requests"]] == [5, 5]
    assert all(r["ttft"] >= 0.03 for r in run["requests"])  # the role delta came at once; it does not count
    assert server.requests[-1]["body"]["messages"] == [{"role": "user", "content": "prompt number 1"}]


@pytest.mark.parametrize(
    "fail, failures",
    [
        ("500", {"500": 6}),
        ("429", {"429": 6}),
        ("midstream", {"stream error": 6}),
        ("drop", {"incomplete stream": 6}),
        ("alternate", {"503": 3}),
    ],
)
async def test_server_errors_are_reported_not_raised(fail: str, failures: dict) -> None:
    async with FakeServer(fail=fail, itl=0.0) as server:
        (run,) = await run_bench(config(server.url), SPECS, slo={"ttft": 1.0})
    s = run["summary"]
    assert s["failures"] == failures
    assert s["completed"] == 6 - sum(failures.values())
    assert s["goodput"] == pytest.approx(s["completed"] / 6)
    bad = [r for r in run["requests"] if not r["ok"]]
    assert all(r["error"] for r in bad)


async def test_unreachable_server_is_reported() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before use: nothing listens
    (run,) = await run_bench(config(f"http://127.0.0.1:{port}", num_requests=2, warmup=1), SPECS)
    assert run["summary"]["failed"] == 2
    assert list(run["summary"]["failures"]) == ["ConnectError"]


async def test_open_loop_and_burst_shapes() -> None:
    async with FakeServer(ttft=0.05, itl=0.0) as server:
        poisson, burst = await run_bench(
            config(server.url, stages=[Stage("poisson", 40.0), Stage("burst")], num_requests=8), SPECS
        )
    assert poisson["stage"] == "rate=40/s" and burst["stage"] == "burst"
    assert poisson["summary"]["completed"] == burst["summary"]["completed"] == 8
    # all sent before the first answer came back (measured against it, not a fixed 50 ms a loaded machine can miss)
    starts = [r["start"] for r in burst["requests"]]
    assert max(starts) < min(r["start"] + r["ttft"] for r in burst["requests"])
    assert max(r["start"] for r in poisson["requests"]) > 0.05  # spread over time (mean gap 25 ms)


async def test_duration_stops_the_run() -> None:
    async with FakeServer(ttft=0.02, itl=0.0) as server:
        t = time.perf_counter()
        (run,) = await run_bench(config(server.url, num_requests=10_000, duration=0.3), SPECS)
    assert time.perf_counter() - t < 2.0
    assert 2 <= run["summary"]["requests"] < 100


async def test_compare_alternates_servers_and_reports_ratios() -> None:
    # ~30x apart, so that a stall of a few hundred ms on a loaded machine cannot close the gap
    async with FakeServer(ttft=0.01, itl=0.001) as fast, FakeServer(ttft=0.25, itl=0.05) as slow:
        runs = await run_bench(config(fast.url, slow.url, num_requests=4, repeats=2), SPECS)
    labels = [(r["target"].split(":")[-1], r["repetition"]) for r in runs]
    fast_port, slow_port = fast.url.split(":")[-1], slow.url.split(":")[-1]
    assert labels == [(fast_port, 0), (slow_port, 0), (fast_port, 1), (slow_port, 1)]
    from stoker.bench.stats import compare_runs

    (row,) = compare_runs(runs, runs[0]["target"])
    assert row["ratios"]["output_tok_s"]["ratio"] > 1.5
    assert row["ratios"]["ttft.p50"]["ratio"] < 0.7
    assert row["ratios"]["output_tok_s"]["pairs"] == 2


async def test_models_spread_one_servers_requests_over_names_round_robin() -> None:
    """Two mixes on one server (the base alone, four adapters) compared as two targets."""
    async with FakeServer(ttft=0.0, itl=0.0) as server:
        targets = make_targets([server.url, server.url], models=["base", "a,b, c,d"])
        cfg = BenchConfig(targets=targets, stages=[Stage("closed", 1)], num_requests=6, warmup=1, timeout=10.0)
        runs = await run_bench(cfg, SPECS)
    sent = [q["body"]["model"] for q in server.requests if q["method"] == "POST"]
    assert sent == ["base", "a"] + ["base"] * 6 + ["a", "b", "c", "d", "a", "b"]  # warm-ups first
    assert [r["model"] for r in runs] == ["base", "a,b,c,d"] and runs[0]["target"] != runs[1]["target"]
    with pytest.raises(ValueError, match="--models was given 2 times for 3 servers"):
        make_targets(["http://x", "http://y", "http://z"], models=["a", "b"])


async def test_each_stage_and_repetition_gets_fresh_prompts_shared_by_all_targets() -> None:
    asked: list[int] = []

    def workload(k: int) -> list[RequestSpec]:
        asked.append(k)
        return [RequestSpec(prompt=f"run {k} request {i}", output_len=2) for i in range(2)]

    async with FakeServer(itl=0.0) as a, FakeServer(itl=0.0) as b:
        cfg = config(a.url, b.url, stages=[Stage("closed", 1), Stage("closed", 2)], num_requests=2, repeats=2)
        await run_bench(cfg, workload)
    assert asked == [0, 1, 2, 3]  # (stage, repetition) pairs, never per target
    sent = [sorted(q["body"]["messages"][0]["content"] for q in s.requests if q["method"] == "POST") for s in (a, b)]
    assert sent[0] == sent[1]  # A and B saw the same prompts
    assert sorted(sent[0]) == sorted(f"run {k} request {i}" for k in range(4) for i in range(2))


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(argv)


async def test_bench_serve_command_writes_report(tmp_path) -> None:
    async with FakeServer(ttft=0.01, itl=0.001) as a, FakeServer(ttft=0.01, itl=0.001, fail="alternate") as b:
        args = parse(
            [
                "--url",
                a.url,
                "--compare",
                b.url,
                "--concurrency",
                "1,2",
                "--num-requests",
                "4",
                "--input-len",
                "5:20",
                "--output-len",
                "4",
                "--ignore-eos",
                "--slo",
                "ttft=500ms",
                "--out",
                str(tmp_path),
                "--no-progress",
                "--warmup",
                "0",
                "--cost-per-hour",
                "3.6",
            ]
        )
        assert await serve_main(args, WordTokenizer()) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["latency_cdf.png", "report.md", "results.json", "sweep.png"]
    result = json.loads((tmp_path / "results.json").read_text())
    assert len(result["runs"]) == 2 * 2 * 2  # stages x repetitions x servers
    assert all(len(r["requests"]) == 4 for r in result["runs"])
    assert len(result["comparisons"]) == 2
    assert "api_key" not in result["config"]
    md = (tmp_path / "report.md").read_text()
    assert "Throughput" in md and "503" in md and "base ÷ other" in md
    assert "$/1M out" in md
    for merged in result["merged"]:
        s = merged["summary"]  # $3.60/h is $0.001/s: $/1M = 1000 / (tokens/s)
        assert s["cost_per_million_output"] == pytest.approx(1000.0 / s["output_tok_s"])


async def test_bench_serve_command_against_a_failing_server_exits_nonzero(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps to the terminal width
    async with FakeServer(fail="500") as server:
        args = parse(["--url", server.url, "--num-requests", "3", "--input-len", "5", "--no-progress"])
        assert await serve_main(args, WordTokenizer()) == 1
    out = capsys.readouterr().out
    assert "3 (500: 3)" in out
