"""`stoker bench serve` against `stoker serve` itself: over the fake engine core
(fast, exact token counts) and, marked e2e, over the real default model."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import pytest

from stoker.bench.cli import add_serve_arguments, serve_main


class ByteTokenizer:
    """The fake core's tokenizer: one token per UTF-8 byte."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode(errors="replace")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_bench_against_stoker_over_the_fake_core(fake_server, tmp_path, endpoint: str) -> None:
    out = tmp_path / endpoint
    args = parse(
        [
            "--url",
            fake_server.url,
            "--endpoint",
            endpoint,
            "--concurrency",
            "1,4",
            "--num-requests",
            "8",
            "--input-len",
            "20:60",
            "--output-len",
            "8",
            "--ignore-eos",
            "--slo",
            "ttft=5s",
            "--out",
            str(out),
            "--no-progress",
            "--timeout",
            "60",
        ]
    )
    assert await serve_main(args, ByteTokenizer()) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["targets"][0]["model"] == "fake-model"
    for run in result["runs"]:
        assert run["summary"]["failed"] == 0, run["summary"]["failures"]
        for r in run["requests"]:
            assert r["output_tokens"] == 8 and r["ttft"] > 0 and len(r["itls"]) >= 1
            if endpoint == "completions":  # exact lengths: server usage agrees with our count
                assert 20 <= r["prompt_tokens"] <= 61
    assert (out / "sweep.png").exists()


@pytest.mark.e2e
async def test_bounded_bench_against_a_real_stoker_server(real_server, tmp_path) -> None:
    from stoker.bench.workload import load_tokenizer

    args = parse(
        [
            "--url",
            real_server.url,
            "--concurrency",
            "2",
            "--num-requests",
            "4",
            "--duration",
            "120",
            "--input-len",
            "50:100",
            "--output-len",
            "16",
            "--ignore-eos",
            "--out",
            str(tmp_path),
            "--no-progress",
            "--timeout",
            "300",
        ]
    )
    assert await serve_main(args, load_tokenizer()) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    (run,) = result["runs"]
    assert run["summary"]["failed"] == 0, run["summary"]["failures"]
    assert all(r["output_tokens"] == 16 for r in run["requests"])
    # The prompts were built to exact lengths with the same tokenizer the server uses.
    assert all(50 <= r["prompt_tokens"] <= 101 for r in run["requests"])
