"""`stoker bench prefix-restart` end to end on a tiny random-weight llama: it
starts `stoker serve --kv-cache-disk` twice itself, and after the restart the
prompts are disk hits whose greedy text equals the computed one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from tiny_models import make_tiny_hf_model

from stoker.bench import prefix_restart

pytestmark = pytest.mark.timeout(180, func_only=True)
SERVE_ARGS = "--no-embedding-model --num-kv-blocks 64 --max-model-len 512 --num-threads 1 --max-num-seqs 2"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    prefix_restart.add_arguments(p)
    return p.parse_args(argv)


def test_new_ram_and_disk_after_a_restart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_hf_model("llama", tmp_path)
    out = tmp_path / "result.json"
    argv = ["--model", str(model), "--serve-args", SERVE_ARGS, "--prefixes", "2", "--prefix-len", "100"]
    assert prefix_restart.run(parse([*argv, "--max-tokens", "3", "--out", str(out)])) == 0
    result = json.loads(out.read_text())
    samples = result["samples"]
    assert [(s["prefix"], s["phase"]) for s in samples] == [
        (1, "new"),
        (1, "ram"),
        (2, "new"),
        (2, "ram"),
        (1, "disk"),
        (2, "disk"),
    ]
    for s in samples:
        # ~100 tokens of words (plus the BOS the server adds); full 16-token blocks are what a cache holds
        assert 99 <= s["prompt_tokens"] <= 102
        assert s["cached_tokens"] == (0 if s["phase"] == "new" else 96)
    assert result["mismatches"] == [] and result["warnings"] == []
    assert len({s["text"] for s in samples if s["prefix"] == 1}) == 1
    assert result["disk_metrics"]["stoker:kv_disk_hits_total"] == 12  # 2 prompts x 6 blocks, the warm-ups none
    assert "(c) is" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefixes", "0"], "--prefixes must be in [1, 1000], got 0"),
        (["--prefix-len", "0"], "--prefix-len must be in"),
        (["--serve-args", "--port 9000"], "the bench sets --port itself"),
        (["--serve-args=--kv-cache-disk=/tmp/x"], "the bench sets --kv-cache-disk itself"),
        (["--dir", "/nonexistent/folder"], "--dir /nonexistent/folder: not a folder"),
        (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
        (["--serve-args", "--model 'unclosed"], "--serve-args: No closing quotation"),
    ],
)
def test_bad_flags_are_refused_in_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert prefix_restart.run(parse(argv)) == 2
    assert message in capsys.readouterr().err


def test_a_prompt_longer_than_the_server_takes_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_hf_model("llama", tmp_path)
    args = parse(["--model", str(model), "--serve-args", SERVE_ARGS, "--prefix-len", "600"])
    assert prefix_restart.run(args) == 2
    assert "--prefix-len 600 + --max-tokens 4 does not fit the server's max_model_len 512" in capsys.readouterr().err


def test_the_warm_up_gap_follows_the_engine_idle_poll() -> None:
    from stoker.engine.process import IDLE_POLL_MS

    assert prefix_restart.ENGINE_IDLE_POLL_S * 1000 == IDLE_POLL_MS
