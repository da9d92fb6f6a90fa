"""`stoker bench ladder` and its synthetic models: the real models' shapes
(parameter counts exact, file sizes within a few percent of llama.cpp's own
quantizations), a tiny rung end to end through the CLI with stoker only, a
missing engine and a shape stoker refuses each skipped with one line, and the
fused decoder's greedy tokens against the torch path on scaled-down shapes
with the real ones' features (Qwen2 bias + tied embeddings, Llama 3 GQA + tied)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import cache_sharing_kernels
from gguf import GGUFReader

from stoker import cli
from stoker.bench import greedy_check, ladder_report, synthetic_gguf
from stoker.bench.synthetic_gguf import FAMILIES, LlamaShape, T, rung_shape, write_llama_gguf
from stoker.bench.workload import LengthDist

pytestmark = pytest.mark.timeout(300, func_only=True)

# config.json's parameter counts (embeddings counted once when tied), and the
# sizes of the published Q8_0 / Q4_K_M files (bartowski's llama.cpp quantizations),
# whose few MB more are the header's vocabulary.
REAL = {
    "qwen2.5-0.5b": 494_032_768,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
}
PUBLISHED_BYTES = {
    "qwen2.5-0.5b-q8_0": 531e6,
    "qwen2.5-0.5b-q4_k_m": 398e6,
    "llama-3.2-1b-q4_k_m": 808e6,
    "llama-3.2-3b-q4_k_m": 2.02e9,
    "llama-3.1-8b-q4_k_m": 4.92e9,
}

# Scaled down, same features: 8 layers so llama.cpp's "more bits" layers (0, 3, 6, 7)
# differ from the rest; Qwen2's hidden of 384 is no whole number of K-quant blocks
# (896 is not either), so its Q4_K_M takes llama.cpp's Q5_0 / Q8_0 fallback.
TINY_QWEN2 = dataclasses.replace(
    FAMILIES["qwen2.5-0.5b"], hidden=384, intermediate=1024, layers=8, heads=6, kv_heads=2, vocab=512, context=1024
)
TINY_LLAMA3 = dataclasses.replace(
    FAMILIES["llama-3.2-1b"], hidden=512, intermediate=1024, layers=8, heads=8, kv_heads=2, vocab=512, context=1024
)


def test_shapes_are_the_real_models() -> None:
    for family, parameters in REAL.items():
        assert FAMILIES[family].parameters() == parameters, family
    for rung, published in PUBLISHED_BYTES.items():
        assert abs(rung_shape(rung).tensor_bytes() / published - 1) < 0.03, rung
    assert FAMILIES["qwen2.5-0.5b"].head_dim == 64 and FAMILIES["llama-3.2-3b"].head_dim == 128
    with pytest.raises(ValueError, match=r"unknown rung 'llama-3\.2-1b-q2_k'"):
        rung_shape("llama-3.2-1b-q2_k")


@pytest.mark.parametrize("mix", ["q8_0", "q4_k_m"])
@pytest.mark.parametrize("shape", [TINY_QWEN2, TINY_LLAMA3], ids=["qwen2", "llama3"])
def test_written_file_is_the_plan(shape: LlamaShape, mix: str, tmp_path: Path) -> None:
    types, more_bits = synthetic_gguf.MIXES[mix]
    shape = dataclasses.replace(shape, types=dict(types), more_bits=dict(more_bits))
    path = write_llama_gguf(tmp_path / "tiny.gguf", shape)
    reader = GGUFReader(str(path))
    written = {t.name: t.tensor_type for t in reader.tensors}
    assert "output.weight" not in written  # tied, as the real ones
    assert {name: qtype for name, _, qtype, _, _ in shape.tensors()}.items() <= written.items()
    facts = ladder_report.facts_of("tiny", path)
    assert facts.tensor_bytes == shape.tensor_bytes() and facts.parameters == shape.parameters()
    assert facts.decode_bytes_per_token == shape.decode_bytes_per_token()
    if mix == "q4_k_m":
        more = {i for i in range(8) if written[f"blk.{i}.ffn_down.weight"] == T.Q6_K}
        assert more == {0, 3, 6, 7}  # llama.cpp's use_more_bits for 8 layers
        # the tied embedding is typed as the output (Q6_K), or its fallback where rows are not 256-long
        assert written["token_embd.weight"] == (T.Q8_0 if shape.arch == "qwen2" else T.Q6_K)
        assert written["blk.1.attn_q.weight"] == (T.Q5_0 if shape.arch == "qwen2" else T.Q4_K)
    if shape.arch == "qwen2":
        assert "blk.0.attn_k.bias" in written


def test_rung_file_is_written_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FAMILIES, "tiny-llama3", TINY_LLAMA3)
    path = synthetic_gguf.rung_file("tiny-llama3-q8_0", tmp_path)
    stamp = path.stat().st_mtime_ns
    assert synthetic_gguf.rung_file("tiny-llama3-q8_0", tmp_path).stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama3-q8_0.gguf"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of the test's own (GGUF headers, tokenizers) sharing the compiled
    C kernels of the usual one: compiling them anew takes a minute."""
    monkeypatch.setenv("STOKER_CACHE_DIR", cache_sharing_kernels(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize(
    "shape",
    # Norms of 0.15 for the 8-layer llama: at 0.3 its random layers amplify a 1% difference
    # (the two paths' summation orders, or two ISA builds of one path) into unrelated logits
    # on some prompts. The real shapes at 0.3 do not: qwen2.5-0.5b, 4/4 prompts identical.
    [TINY_QWEN2, dataclasses.replace(TINY_LLAMA3, norm_weight=0.15)],
    ids=["qwen2-bias-tied", "llama3-gqa-tied"],
)
def test_greedy_fused_matches_torch_path(
    shape: LlamaShape, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STOKER_FUSED_DECODER", "1")  # greedy_steps sets it; restored after the test
    path = write_llama_gguf(tmp_path / "tiny.gguf", shape)
    prompts = greedy_check.prompts_for(shape.vocab, 4)
    fused = greedy_check.greedy_steps(str(path), prompts, 12, fused=True)
    reference = greedy_check.greedy_steps(str(path), prompts, 12, fused=False)
    got = greedy_check.compare(fused, reference, tie_nats=0.05)
    assert got.ok, got
    assert got.identical >= 2, got.summary()


def test_a_real_divergence_fails_and_a_near_tie_does_not() -> None:
    reference = [[(5, [(5, -1.0), (9, -1.01)]), (6, [(6, -0.5)])]]
    near_tie = [[(9, [(9, -1.0)]), (7, [(7, -0.1)])]]
    assert greedy_check.compare(near_tie, reference, 0.05).ok
    wrong = [[(5, [(5, -1.0)]), (8, [(8, -0.1)])]]  # 8 is not among the reference's alternatives
    report = greedy_check.compare(wrong, reference, 0.05)
    assert not report.ok and report.divergences[0].position == 1 and "1 real divergence" in report.summary()
    assert greedy_check.compare(reference, reference, 0.05).identical == 1


def test_ladder_end_to_end_with_skips(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen2-shaped rung through `stoker bench ladder`, stoker alone; llama-server
    and vLLM missing and a falcon-arch file stoker refuses, each skipped with its line."""
    monkeypatch.setitem(FAMILIES, "tiny-qwen2", TINY_QWEN2)
    monkeypatch.setattr(ladder_report, "STREAM_BYTES", 16 << 20)
    falcon = write_llama_gguf(tmp_path / "tiny-falcon.gguf", dataclasses.replace(TINY_LLAMA3, arch="falcon"))
    out = tmp_path / "report"
    argv = ["bench", "ladder", "--models", "tiny-qwen2-q4_k_m", "--gguf", str(falcon), "--cache", str(tmp_path)]
    argv += ["--llama-server", str(tmp_path / "no-llama-server"), "--vllm", str(tmp_path / "no-python")]
    argv += ["--streams", "2", "--prefill", "64", "--requests", "2", "--repeats", "1", "--input-len", "16:32"]
    argv += ["--output-len", "8", "--threads", "1", "--ready-timeout", "120", "--check-greedy", "--out", str(out)]
    assert cli.main(argv) == 0
    result = json.loads((out / "ladder.json").read_text())
    skipped = result["skipped"]
    assert skipped[0] == f"llama-server: --llama-server {tmp_path / 'no-llama-server'}: not an executable"
    assert skipped[1].startswith(f"vllm: {tmp_path / 'no-python'}:")
    assert skipped[2].startswith("tiny-falcon: stoker exited with 1: stoker serve: startup failed: ")
    assert "unsupported GGUF architecture 'falcon'" in skipped[2]
    (rung,) = result["rungs"]
    assert rung["name"] == "tiny-qwen2-q4_k_m" and rung["greedy"]["ok"]
    figures = rung["engines"]["stoker"]
    for key in ("one_stream_tok_s", "decode_tok_s", "streams_2_tok_s", "prefill_64_tok_s", "rss_mb", "ready_s"):
        assert figures[key] > 0, key
    assert rung["notes"] == [] and rung["roofline_tok_s"] > 0
    # A random model's greedy output loops: speculation would measure that, not the engine.
    argv = figures["argv"]
    assert argv[argv.index("--speculative-method") + 1] == "none"
    table = (out / "ladder.md").read_text()
    assert "## tiny-qwen2-q4_k_m" in table and "| 2 streams, out tok/s |" in table
    assert "- skipped: tiny-falcon: stoker exited with 1" in table
    assert (out / "ladder.png").stat().st_size > 0
    assert "stoker: serving tiny-qwen2" in (out / "logs" / "tiny-qwen2-q4_k_m-stoker.log").read_text()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--models", "llama-3.2-1b-q3_k"], "unknown rung 'llama-3.2-1b-q3_k'"),
        (["--streams", "0"], "--streams '0': each between 1 and 256"),
        (["--prefill", "x"], "--prefill 'x': a comma-separated list of integers"),
        (["--repeats", "0"], "--requests must be 1-1000 and --repeats 1-20"),
        (["--timeout", "0"], "--timeout and --ready-timeout must be above 0"),
        (["--models", "", "--gguf", ""], "no rungs"),
    ],
)
def test_bad_flags_are_refused(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "ladder", *flags]) == 2
    assert message in capsys.readouterr().err


def test_bf16_folder_for_vllm_is_the_same_model(tmp_path: Path, cache: Path) -> None:
    """The folder vLLM is given: transformers reads it as the same model (Qwen2 bias and tied
    head included) as stoker's dense path on the GGUF, to bf16's rounding."""
    import torch
    from quant_models import last_logits
    from transformers import AutoModelForCausalLM

    from stoker import LLM
    from stoker.bench.ladder_engines import write_hf_folder

    gguf = write_llama_gguf(tmp_path / "tiny.gguf", TINY_QWEN2)
    folder = write_hf_folder(gguf, tmp_path / "tiny-bf16")
    assert write_hf_folder(gguf, folder) == folder  # written once
    ids = greedy_check.prompts_for(TINY_QWEN2.vocab, 2)[1]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        got = hf(torch.tensor([ids])).logits[0, -1]
    llm = LLM(str(gguf), dtype="float32", quantization="none", max_model_len=64, kv_cache_tokens=256)
    (want,) = last_logits(llm, [ids])
    assert float((got - want).norm() / want.norm()) < 0.02


@pytest.mark.parametrize(
    ("available_of_two", "runs", "note"),
    [
        (2.5, [["stoker", "llama-server"]], None),  # both fit: up together, phases alternating
        (1.5, [["stoker"], ["llama-server"]], "llama-server: ~{gb} GB would not fit beside the others: run alone"),
        (0.5, [["stoker"]], "llama-server: ~{gb} GB would not fit in memory"),  # stoker alone takes all there is
    ],
)
def test_an_engine_that_fits_only_alone_runs_after_the_others(
    available_of_two: float, runs: list[list[str]], note: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ladder's grouping by memory, servers and phases stood in for: which engines are up
    together while the phases run, and the line for one that runs alone or not at all."""
    from stoker.bench import ladder, ladder_engines, ladder_phases

    monkeypatch.setitem(FAMILIES, "tiny-qwen2", TINY_QWEN2)
    events: list[tuple[str, object]] = []
    estimate = 10**9

    def engine(name: str) -> ladder_engines.Engine:
        return ladder_engines.Engine(name, [], "/health", estimate, {})

    class Started:
        def __init__(self, engine: ladder_engines.Engine, work: Path, timeout: float) -> None:
            self.engine, self.url, self.error, self.ready_s, self.rss_after_load = engine, "", None, 1.0, 1
            self.child = SimpleNamespace(log_path=work / f"{engine.name}.log")
            self.child.log_path.write_text("")
            events.append(("start", engine.name))

        def rss(self) -> int:
            return 1

        def stop(self) -> None:
            events.append(("stop", self.engine.name))

    monkeypatch.setattr(ladder_engines, "stoker_engine", lambda *a: engine("stoker"))
    monkeypatch.setattr(ladder_engines, "llama_engine", lambda *a: engine("llama-server"))
    monkeypatch.setattr(ladder_engines, "Started", Started)
    monkeypatch.setattr(ladder_engines, "llama_bench", lambda *a: "llama-bench: not run here")
    monkeypatch.setattr(ladder, "memory_available", lambda: available_of_two * estimate / ladder.MEMORY_HEADROOM)
    monkeypatch.setattr(ladder_report, "cold_read_seconds", lambda path: 0.1)
    if available_of_two < 1:  # stoker must fit alone, or the rung is skipped: it gets exactly what there is
        estimate_of = {"stoker": int(available_of_two * estimate), "llama-server": estimate}
        monkeypatch.setattr(
            ladder_engines,
            "stoker_engine",
            lambda *a: dataclasses.replace(engine("stoker"), memory_estimate=estimate_of["stoker"]),
        )
    monkeypatch.setattr(
        ladder_phases, "measure", lambda started, *a: events.append(("measure", [s.engine.name for s in started]))
    )
    args = cli.build_parser().parse_args(
        ["bench", "ladder", "--cache", str(tmp_path), "--no-llama", "--out", str(tmp_path / "report")]
    )
    result = {"bandwidth": {"triad": 1e10}, "streams": [4], "prefill": [512]}
    limits = ladder_engines.Limits(4, 512, 2048, 1)
    rung = ladder._rung(
        "tiny-qwen2-q4_k_m",
        None,
        args,
        limits,
        Path("llama-server"),
        None,
        tmp_path,
        result,
        *[LengthDist("fixed", 8)] * 2,
    )
    expected: list[tuple[str, object]] = []
    for group in runs:
        expected += [("start", name) for name in group] + [("measure", group)] + [("stop", name) for name in group]
    assert events == expected
    assert sorted(rung["engines"]) == sorted(name for group in runs for name in group)
    told = [line for line in rung["notes"] if line.startswith("llama-server: ~")]
    assert told == ([] if note is None else [told[0]]) and (note is None or told[0].startswith(note.format(gb="1.0")))
