"""`stoker bench offline` end to end on a tiny random model: both engines run
the same prompts, the figures add up, the ratio and the profile come out."""

from __future__ import annotations

import json

import pytest
from tiny_models import make_tiny_hf_model

from stoker.bench import offline


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("bench-offline")))


def test_offline_bench_runs_both_engines_and_reports_the_ratio(tiny: str, tmp_path, capsys) -> None:
    if offline.stoker_available():
        pytest.skip(f"engine unavailable: {offline.stoker_available()}")
    rc = offline.main(
        [
            "--model",
            tiny,
            "--num-prompts",
            "3",
            "--input-len",
            "8:24",
            "--output-len",
            "4",
            "--batch-sizes",
            "1,3",
            "--stoker-batch-sizes",
            "2",
            "--dtype",
            "float32",
            "--profile",
            "--profile-steps",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "offline.json").read_text())
    runs = {(r["engine"], r["batch_size"]): r for r in data["runs"]}
    assert set(runs) == {("stoker", 2), ("transformers", 1), ("transformers", 3)}
    for r in runs.values():
        assert r["input_tokens"] == 8 + 16 + 24  # lengths evenly spread over 8..24
        assert r["output_tokens"] == 3 * 4  # ignore_eos: every prompt runs to max_tokens
        assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["time_s"])
    (summary,) = data["summary"]
    best_hf = max(runs[("transformers", 1)]["output_tok_s"], runs[("transformers", 3)]["output_tok_s"])
    assert summary["output_ratio"] == pytest.approx(runs[("stoker", 2)]["output_tok_s"] / best_hf)
    out = capsys.readouterr().out
    assert "ms/step" in out and "Self CPU" in out and "tottime" in out
    assert (tmp_path / "offline.md").read_text().count("| stoker |") == 1


def test_hf_dtype_sets_the_baseline_for_every_stoker_dtype(tiny: str, tmp_path) -> None:
    """--hf-dtype: transformers runs once, in that dtype, and each stoker dtype's
    ratio is against it (stoker's quantized float32 path vs transformers' bf16)."""
    if offline.stoker_available():
        pytest.skip(f"engine unavailable: {offline.stoker_available()}")
    args = ["--model", tiny, "--num-prompts", "2", "--input-len", "8:16", "--output-len", "3"]
    args += ["--batch-sizes", "2", "--dtype", "float32,bfloat16", "--hf-dtype", "bfloat16", "--out", str(tmp_path)]
    assert offline.main(args) == 0
    data = json.loads((tmp_path / "offline.json").read_text())
    hf_runs = [r for r in data["runs"] if r["engine"] == "transformers"]
    assert [r["dtype"] for r in hf_runs] == ["bfloat16"]
    for summary in data["summary"]:
        stoker = next(r for r in data["runs"] if r["engine"] == "stoker" and r["dtype"] == summary["dtype"])
        assert summary["hf_dtype"] == "bfloat16"
        assert summary["output_ratio"] == pytest.approx(stoker["output_tok_s"] / hf_runs[0]["output_tok_s"])


def test_greedy_tokens_agree_with_transformers_unpadded(tiny: str) -> None:
    """A fast-but-wrong engine must not look good: at batch 1 (no padding) in
    fp32 both sides produce the same greedy tokens."""
    if offline.stoker_available():
        pytest.skip(f"engine unavailable: {offline.stoker_available()}")
    from stoker.bench.workload import load_tokenizer, synthetic_token_ids

    tok = load_tokenizer(tiny)
    prompts = synthetic_token_ids(tok, [5, 30], seed=1)
    hf = offline.run_hf(offline.load_hf(tiny, "float32"), prompts, 1, 6, pad_id=0)
    ours = offline.run_stoker(tiny, "float32", 4, prompts, 6)
    assert ours["outputs"] == hf["outputs"]


def test_baseline_alone_when_the_engine_is_skipped(tiny: str, tmp_path) -> None:
    assert (
        offline.main(
            [
                "--model",
                tiny,
                "--num-prompts",
                "2",
                "--input-len",
                "6:9",
                "--output-len",
                "2",
                "--batch-sizes",
                "2",
                "--dtype",
                "float32",
                "--skip-stoker",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    data = json.loads((tmp_path / "offline.json").read_text())
    assert [r["engine"] for r in data["runs"]] == ["transformers"]
    assert data["summary"][0]["output_ratio"] is None
