"""`stoker serve` given a model it cannot serve: a missing, corrupt or truncated
GGUF, a tensor type it cannot load, a --quantization this machine or value
cannot do. Each exits non-zero with one line naming the file, tensor or flag
(and the choices), and no Python traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TESTS_DIR, cache_sharing_kernels
from gguf import GGMLQuantizationType, GGUFReader

from stoker.bench.synthetic_gguf import LlamaShape, write_llama_gguf

T = GGMLQuantizationType
TINY = LlamaShape(hidden=256, intermediate=512, layers=1, heads=4, kv_heads=2, vocab=300, context=256)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", TINY)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One for the module (GGUF headers), with the usual compiled C kernels that the type checks load."""
    return Path(cache_sharing_kernels(tmp_path_factory.mktemp("cache")))


def serve(
    tmp_path: Path, cache: Path, *args: str, embedding: tuple[str, ...] = ("--no-embedding-model",)
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "serve", *args, *embedding, "--port", "0"]
        + ["--db", str(tmp_path / "ledger.db")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        check=False,
        env={
            **os.environ,
            "PYTHONPATH": f"{TESTS_DIR}:{REPO}",
            "STOKER_CACHE_DIR": str(cache),
        },
    )
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    return result


def failure_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line that says why (every other line is uvicorn's or the key warning's)."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("stoker serve:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_missing_file(tmp_path: Path, cache_dir: Path) -> None:
    line = failure_line(serve(tmp_path, cache_dir, str(tmp_path / "nowhere.gguf")))
    assert "nowhere.gguf" in line and "no model at" in line


def test_corrupt_file(tmp_path: Path, cache_dir: Path) -> None:
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    line = failure_line(serve(tmp_path, cache_dir, str(bad)))
    assert str(bad) in line and "not a readable GGUF file" in line


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_file(tmp_path: Path, cache_dir: Path, tiny_gguf: Path, keep: float) -> None:
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    line = failure_line(serve(tmp_path, cache_dir, str(cut)))
    assert str(cut) in line and "truncated" in line


def test_unsupported_tensor_type(tmp_path: Path, cache_dir: Path, tiny_gguf: Path) -> None:
    # Q8_1 (llama.cpp's activation format) is neither multiplied nor dequantized by stoker.
    reader = GGUFReader(str(tiny_gguf))
    target = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    type_offset = target.field.offset + sum(p.nbytes for p in target.field.parts[:-2])
    raw = bytearray(tiny_gguf.read_bytes())
    assert int.from_bytes(raw[type_offset : type_offset + 4], "little") == T.Q4_K
    raw[type_offset : type_offset + 4] = int(T.Q8_1).to_bytes(4, "little")
    bad = tmp_path / "q8_1.gguf"
    bad.write_bytes(bytes(raw))
    line = failure_line(serve(tmp_path, cache_dir, str(bad)))
    assert "blk.0.ffn_up.weight" in line and "Q8_1" in line and "supported: " in line and "Q4_K" in line


def test_quantization_not_a_choice(tmp_path: Path, cache_dir: Path, tiny_gguf: Path) -> None:
    result = serve(tmp_path, cache_dir, str(tiny_gguf), "--quantization", "q3_k")
    assert result.returncode == 2
    assert "--quantization" in result.stderr and "'q3_k'" in result.stderr and "q4_0" in result.stderr


def test_quantization_this_machine_cannot_do(tmp_path: Path, cache_dir: Path, tiny_gguf: Path) -> None:
    # Quantizing at load needs the CPU int8 kernels; refused before any device is touched.
    line = failure_line(serve(tmp_path, cache_dir, str(tiny_gguf), "--quantization", "q8_0", "--device", "cuda"))
    assert "quantization='q8_0'" in line and "not on cuda" in line and "choices: auto, none, q8_0" in line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--num-speculative-tokens", "99"],
            "--num-speculative-tokens: Input should be less than or equal to 16, got 99",
        ),
        (["--num-speculative-tokens", "-1"], "--num-speculative-tokens: Input should be greater than or equal to 0"),
        (["--speculative-ngram-min", "5", "--speculative-ngram-max", "2"], "must not exceed speculative_ngram_max"),
        (["--kv-cache-tokens", "0"], "--kv-cache-tokens: Input should be greater than or equal to 1, got 0"),
        (["--kv-events-endpoint", "tcp://no-port"], "--kv-events-endpoint: must be a ZeroMQ address to bind"),
    ],
)
def test_setting_out_of_range_names_the_flag(
    tmp_path: Path, cache_dir: Path, tiny_gguf: Path, args: list[str], expected: str
) -> None:
    result = serve(tmp_path, cache_dir, str(tiny_gguf), *args)
    assert result.returncode == 2
    assert expected in failure_line(result)


def test_embedding_model_that_is_no_folder(tmp_path: Path, cache_dir: Path, tiny_gguf: Path) -> None:
    """Refused before the engine loads, naming the flag and the choices."""
    result = serve(tmp_path, cache_dir, str(tiny_gguf), embedding=("--embedding-model", str(tmp_path / "nope")))
    assert result.returncode == 2
    line = failure_line(result)
    assert line.startswith("stoker serve: --embedding-model: no such folder") and "none" in line, line


def test_embedding_model_none_disables_it() -> None:
    from stoker.server.config import ServerConfig

    assert ServerConfig(embedding_model="none").embedding_model is None
    assert ServerConfig(embedding_model="None").embedding_model is None
    assert ServerConfig().embedding_model == "all-MiniLM-L6-v2"


@pytest.mark.parametrize("method", ["medusa", "self"])  # self: measured not to pay (docs/perf/speculative.md)
def test_speculative_method_not_a_choice(tmp_path: Path, cache_dir: Path, tiny_gguf: Path, method: str) -> None:
    result = serve(tmp_path, cache_dir, str(tiny_gguf), "--speculative-method", method)
    assert result.returncode == 2
    assert (
        f"--speculative-method: invalid choice: '{method}' (choose from 'auto', 'ngram', 'draft', 'none')"
        in result.stderr
    )


def test_draft_method_without_a_draft_model(tmp_path: Path, cache_dir: Path, tiny_gguf: Path) -> None:
    result = serve(tmp_path, cache_dir, str(tiny_gguf), "--speculative-method", "draft")
    assert result.returncode == 2
    assert "set speculative_model (--speculative-model)" in failure_line(result)
