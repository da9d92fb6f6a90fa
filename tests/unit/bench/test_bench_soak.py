"""`stoker bench serve --soak`: the mixed load against a real `stoker serve`
over the fake engine core (so the front end and its engine child are real
processes whose RSS is sampled), failures counted by status, the RSS figures
on hand-written samples, and the report files."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import FAKE_CORE, ServerProcess, start_server

from stoker.bench import report, soak
from stoker.bench.cli import add_serve_arguments, soak_main
from stoker.bench.fakeserver import FakeServer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256"],
        str(tmp_path_factory.mktemp("soak-server")),
        env={"STOKER_FAKE_STEP_S": "0.005"},
    )
    try:
        yield s
    finally:
        s.stop()


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(argv)


async def test_soak_against_a_server_over_the_fake_core(server: ServerProcess, tmp_path) -> None:
    cfg = soak.SoakConfig(
        url=server.url,
        duration=3.0,
        concurrency=6,
        prompt_words=(3, 20),  # the fake tokenizer counts bytes; its context is 256
        max_tokens=(1, 12),
        stream_share=0.6,
        cancel_share=0.5,
        bad_share=0.2,
        pid=server.proc.pid,
        rss_interval=0.5,
        warmup=1.0,
        growth_window=0.02,
    )
    seen: list[dict] = []
    result = await soak.run_soak(cfg, lambda sample, _: seen.append(sample))
    s = result.summary()
    assert s["errors"] == 0, s["error_examples"]
    assert s["health_after"] == 200
    assert set(s["by_kind"]) == {"json", "stream", "cancel", "bad"}
    assert s["ok_by_kind"] == s["by_kind"]
    bad_statuses = {o.status for o in result.outcomes if o.kind == "bad"}
    assert bad_statuses and all(400 <= (x or 0) < 500 for x in bad_statuses)
    assert result.seconds >= 3.0 and len(result.samples) >= 5 and seen
    roles = {p["role"]: p for p in result.samples[-1]["procs"]}
    assert roles["front end"]["pid"] == server.proc.pid
    # A --pid of whatever started the server (here this test process) finds a `stoker serve` front end in its
    # tree: this one, or in a whole-suite run another module's server still alive under the same pytest.
    front = {p["role"]: p["pid"] for p in soak.sample_processes(os.getpid())}["front end"]
    assert front in soak.process_tree(os.getpid()) and "serve" in soak.cmdline_of(front)
    assert roles["engine"]["rss"] > 10 * 2**20 and roles["front end"]["rss"] > 10 * 2**20
    engine = s["rss"]["engine"]
    assert engine["start"] > 0 and engine["end"] > 0 and engine["max"] >= engine["end"]
    assert 0 < engine["window_minutes"] <= 0.03

    paths = report.write_soak_outputs(str(tmp_path), {**result.to_dict(), "command": "test"})
    assert [os.path.basename(p) for p in paths] == ["results.json", "report.md", "rss.png"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["summary"]["requests"] == len(data["requests"]) == len(result.outcomes)
    md = (tmp_path / "report.md").read_text()
    assert "| engine |" in md and "![rss.png](rss.png)" in md


async def test_soak_cli_exits_zero_and_writes_the_report(server: ServerProcess, tmp_path) -> None:
    args = parse(
        [
            "--soak",
            "--url",
            server.url + "/v1",
            "--pid",
            str(server.proc.pid),
            "--duration",
            "1.5",
            "--concurrency",
            "3",
            "--max-tokens",
            "1:4",
            "--prompt-words",
            "3:10",
            "--rss-interval",
            "0.5",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert await soak_main(args) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["config"]["concurrency"] == 3 and data["config"]["max_tokens"] == [1, 4]
    assert data["summary"]["rss"]["engine"]["end"] > 0


async def test_server_errors_are_counted_by_status_and_fail_the_run(tmp_path) -> None:
    async with FakeServer(fail="500", itl=0.0) as fake:
        args = parse(["--soak", "--url", fake.url, "--duration", "0.5", "--concurrency", "2", "--no-progress"])
        assert await soak_main(args) == 1
        result = await soak.run_soak(soak.SoakConfig(url=fake.url, duration=0.3, concurrency=2, bad_share=0.5))
    s = result.summary()
    assert s["errors"] == s["requests"] > 0
    assert s["errors_by_status"] == {"500": s["requests"]}  # bad requests too: a 500 is never the 4xx expected
    assert s["rss"] == {}  # no pid given, no samples


def test_bad_requests_and_cancels_follow_the_shares() -> None:
    cfg = soak.SoakConfig(url="http://x", bad_share=0.05, stream_share=0.5, cancel_share=0.25)
    rng = random.Random(1)
    plans = [soak.plan_request(cfg, rng, "m") for _ in range(4000)]
    share = {k: sum(p.kind == k for p in plans) / len(plans) for k in ("bad", "json", "stream", "cancel")}
    assert share["bad"] == pytest.approx(0.05, abs=0.015)
    assert share["json"] == pytest.approx(0.95 * 0.5, abs=0.03)
    assert share["cancel"] == pytest.approx(0.95 * 0.5 * 0.25, abs=0.02)
    for p in plans:
        if p.kind != "bad":
            assert isinstance(p.body, dict) and 1 <= p.body["max_tokens"] <= 128
            assert 3 <= len(p.body["prompt"].split()) <= 300
        if p.kind == "cancel":
            assert 0 <= p.cancel_after < p.body["max_tokens"]  # type: ignore[index]


def _samples(values: list[float], dt: float = 30.0) -> list[dict]:
    return [{"t": i * dt, "procs": [{"pid": 1, "role": "engine", "rss": int(v * 2**20)}]} for i, v in enumerate(values)]


def test_rss_growth_is_judged_over_the_last_minutes_only() -> None:
    # Warm-up climbs 1000 -> 1400 MiB, then 10 minutes flat: no growth in the window.
    flat = soak.rss_summary(_samples([1000, 1200, 1400] + [1400] * 20), warmup=60, window_min=5)["engine"]
    assert flat["start"] == 1000 * 2**20 and flat["after_warmup"] == 1400 * 2**20
    assert flat["growth"] == 0 and flat["growth_pct"] == 0 and flat["slope_bytes_per_min"] == 0
    assert flat["window_minutes"] == 5
    # A steady leak of 1 MiB per 30 s sample shows as +10 MiB over 5 minutes, 2 MiB/min.
    leak = soak.rss_summary(_samples([1000 + i for i in range(30)]), warmup=60, window_min=5)["engine"]
    assert leak["growth"] == 10 * 2**20
    assert leak["slope_bytes_per_min"] == pytest.approx(2 * 2**20)
    assert leak["growth_pct"] == pytest.approx(100 * 10 / 1019)


def test_process_tree_finds_children_and_their_memory() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = soak.process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
        procs = {p["pid"]: p for p in soak.sample_processes(os.getpid())}
        assert procs[os.getpid()]["rss"] > 0 and procs[child.pid]["rss"] > 0
        assert soak.role_of(os.getpid(), front=os.getpid()) == "front end"
        assert soak.role_of(child.pid, front=os.getpid()).startswith("python")
    finally:
        child.kill()
        child.wait()
    assert soak.process_tree(child.pid) == []
