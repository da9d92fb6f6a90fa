"""`stoker bench pd`: its figures on hand-made timings, its refusals, and a short run
end to end on a tiny random-weight llama (the servers started by the bench itself)."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from pathlib import Path

import pytest
from tiny_models import make_tiny_hf_model

from stoker.bench import pd, pd_report, pd_workers
from stoker.bench.stats import RequestResult
from stoker.bench.workload import RequestSpec

pytestmark = pytest.mark.timeout(240, func_only=True)
SERVE_ARGS = "--no-embedding-model --num-kv-blocks 128 --max-model-len 512 --max-num-seqs 8"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    pd.add_arguments(p)
    return p.parse_args(argv)


def stream(index: int, ttft: float, itls: list[float], tokens: int) -> RequestResult:
    return RequestResult(
        index=index, ok=True, status=200, ttft=ttft, itls=itls, e2e=ttft + sum(itls), output_tokens=tokens
    )


def test_figures_pool_every_round_of_a_configuration() -> None:
    # 100 gaps: 98 of 10 ms, then 100 and 200 ms. p99 interpolates between the two
    # largest: index 0.99 * 99 = 98.01, so 100 + 0.01 * (200 - 100) = 101 ms.
    first = pd_report.Round("colocated", 0, 4.0, [stream(0, 0.1, [0.01] * 49, 50), stream(1, 0.3, [0.01] * 49, 50)], [])
    longs = [stream(0, 1.0, [], 1), stream(1, 3.0, [], 1), RequestResult(index=2, status=503, error="HTTP 503: busy")]
    second = pd_report.Round("colocated", 1, 6.0, [stream(0, 0.2, [0.1, 0.2], 3)], longs)
    result = pd_report.figures("colocated", [first, second])
    assert result["itl"]["p50"] == pytest.approx(0.01)
    assert result["itl"]["p99"] == pytest.approx(0.101)
    assert result["ttft"]["p50"] == pytest.approx(0.2)
    assert result["ttft"]["p99"] == pytest.approx(0.298)  # 0.2 + 0.98 * (0.3 - 0.2)
    assert result["long_ttft"]["p50"] == pytest.approx(2.0)
    assert result["long_ttft"]["p99"] == pytest.approx(2.98)
    assert result["output_tok_s"] == pytest.approx((50 + 50 + 3 + 1 + 1) / 10.0)
    assert (result["rounds"], result["stream_requests"], result["long_requests"]) == (2, 3, 3)
    assert (result["errors"], result["error_samples"]) == (1, ["HTTP 503: busy"])


def test_the_split_ratio_is_reported_against_the_target() -> None:
    alone = pd_report.figures("alone", [pd_report.Round("alone", 0, 1.0, [stream(0, 0.1, [0.02] * 100, 101)], [])])
    split = pd_report.figures("split", [pd_report.Round("split", 0, 1.0, [stream(0, 0.1, [0.04] * 100, 101)], [])])
    assert pd_report.itl_p99_ratio({"alone": alone, "split": split}, "split") == pytest.approx(2.0)
    assert pd_report.itl_p99_ratio({"split": split}, "split") is None
    moved = {"decode": {"blocks_received": 24.0, "received_bytes": 2.5e6, "pulls": 2.0, "pull_seconds": 0.1}}
    table = pd_report.markdown([alone, split], {"colocated": "both exited with 1"}, moved)
    assert "| split | 1 | 40.0 | 40.0 | 2.00x |" in table
    assert "split ITL p99 / alone ITL p99 = 2.00x (above the 1.5x target)" in table
    assert "colocated: skipped (both exited with 1)" in table
    assert "the decode worker received 24 blocks (2.5 MB) in 2 pulls, 50.0 ms per pull" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--streams", "0"], "--streams must be in [1, 256], got 0"),
        (["--long-len", "100", "--shared-prefix", "100"], "--shared-prefix must be in [0, 99], got 100"),
        (["--duration", "0"], "--duration must be a number of seconds in (0, 86400], got 0"),
        (["--long-every", "-1"], "--long-every must be a number of seconds"),
        (["--configs", "alone,both"], "--configs: both; choose from alone, colocated, split"),
        (["--prefill-cpus", "a-b"], "--prefill-cpus 'a-b': expected a CPU list"),
        (["--serve-args", "--port 9000"], "the bench sets --port itself"),
        (["--serve-args=--role=decode"], "the bench sets --role itself"),
    ],
)
def test_bad_flags_are_refused_in_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert pd.run(parse(argv)) == 2
    assert message in capsys.readouterr().err


def test_cpu_lists_and_why_a_split_cannot_run(tmp_path: Path) -> None:
    assert pd_workers.parse_cpus("0-2,5", "--decode-cpus") == [0, 1, 2, 5]
    args = parse(["--router", str(tmp_path / "sglang-router")])
    assert "no sglang-router executable" in (pd_workers.split_blocker(args) or "")
    args = parse(["--prefill-cpus", "0-1", "--decode-cpus", "1"])
    assert pd_workers.split_blocker(args) == "--prefill-cpus 0-1 and --decode-cpus 1 overlap"
    args = parse(["--prefill-cpus", "0", "--decode-cpus", "4095"])
    assert "CPU 4095 is not available here" in (pd_workers.split_blocker(args) or "")


def test_every_configuration_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The bench starts the servers, the taskset-pinned workers and sglang-router itself;
    every request succeeds in each configuration and the split moves the prompts' KV."""
    model = make_tiny_hf_model("llama", tmp_path)
    out, picture = tmp_path / "pd.json", tmp_path / "pd.png"
    load = ["--streams", "2", "--stream-prompt", "20", "--stream-tokens", "8", "--long-len", "200"]
    load += ["--long-every", "0.5", "--long-tokens", "3", "--duration", "1.5", "--rounds", "1"]
    argv = ["--model", str(model), "--serve-args", SERVE_ARGS, *load]
    assert pd.run(parse([*argv, "--out", str(out), "--plot", str(picture)])) == 0
    data = json.loads(out.read_text())
    by_config = {r["config"]: r for r in data["results"]}
    assert list(by_config) == ["alone", "colocated", "split"] and data["skipped"] == {}
    assert by_config["alone"]["long_requests"] == 0
    rounds = {rd["config"]: rd for rd in data["rounds"]}
    for config in ("alone", "colocated", "split"):
        assert by_config[config]["errors"] == 0 and by_config[config]["stream_requests"] >= 2
        assert all(r["output_tokens"] == 8 and len(r["itls"]) >= 1 for r in rounds[config]["streams"])
    for config in ("colocated", "split"):
        assert by_config[config]["long_requests"] == 2  # at 0.5 s and 1.0 s; 1.5 s is the round's end
        assert all(200 <= r["prompt_tokens"] <= 202 and r["ttft"] > 0 for r in rounds[config]["longs"])
    decode = data["kv_transfer"]["decode"]
    # each long prompt's 12 full blocks crossed (the streams' one block each too), none failed
    assert decode["blocks_received"] >= 24 and decode["pulls_failed"] == decode["pulls_timed_out"] == 0
    assert data["kv_transfer"]["prefill"]["blocks_sent"] == decode["blocks_received"]
    assert picture.stat().st_size > 0
    assert "split ITL p99 / alone ITL p99 = " in capsys.readouterr().out


def test_a_configuration_that_cannot_start_is_skipped_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "sglang-router"
    assert pd.run(parse(["--configs", "split", "--router", str(missing)])) == 1  # nothing ran
    out = capsys.readouterr()
    assert f"split: skipped (no sglang-router executable ({missing}): pip install sglang-router)" in out.err
    assert "| configuration |" in out.out and "| split |" not in out.out


def test_a_server_that_never_answers_ends_the_round_within_the_timeout() -> None:
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        specs = [RequestSpec(prompt="words", input_len=1, output_len=4)]
        load = pd.Load(streams=2, duration=0.3, long_every=0.1, timeout=0.5)
        started = time.perf_counter()
        streams, longs, _ = asyncio.run(pd.run_round(url, "m", specs, specs * 2, load))
    assert time.perf_counter() - started < 5
    assert len(streams) == 2 and len(longs) == 2  # one per stream; longs at 0.1 and 0.2 s
    assert all(not r.ok and r.error for r in (*streams, *longs))
