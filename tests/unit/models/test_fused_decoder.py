"""The fused C decoder stack (csrc/decoder_layer.c) on tiny random GGUF models,
on every ISA path this CPU can run: against the per-op torch path on the same
file, and for batch invariance on its own."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from conftest import cache_sharing_kernels
from quant_models import HEAD_DIM, Q4_K_M, TOKENS, T, last_logits, random_prompts, write_quant_gguf

from stoker import LLM, SamplingParams
from stoker.engine.params import RequestOutput
from stoker.models import llama
from stoker.models.fused_decoder import LINEARS, FusedDecoder
from stoker.models.quant import kernels
from stoker.models.quant.kernels import available_isas
from stoker.models.quant.repack import BackgroundRepack
from stoker.models.quant.weights import packs

pytestmark = pytest.mark.skipif(kernels._library("portable") is None, reason="no C compiler")

CASES = [("llama", {}, T.Q4_1), ("qwen2", {}, T.Q8_0), ("qwen3", Q4_K_M, T.Q4_K)]
IDS = ["llama-Q4_1", "qwen2-bias-Q8_0", "qwen3-qknorm-Q4_K_M"]


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_CACHE_DIR", cache_sharing_kernels(tmp_path / "cache"))
    monkeypatch.delenv("STOKER_DISABLE_C_KERNELS", raising=False)
    monkeypatch.delenv("STOKER_FUSED_DECODER", raising=False)


@pytest.fixture(params=available_isas())
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("STOKER_QUANT_ISA", request.param)
    return str(request.param)


def _llm(path: Path, fused: bool, monkeypatch: pytest.MonkeyPatch, **args: Any) -> LLM:
    monkeypatch.setenv("STOKER_FUSED_DECODER", "1" if fused else "0")
    llm = LLM(str(path), dtype="float32", quantization="auto", num_kv_blocks=96, **args)
    assert (llm.engine.runner.model.fused is not None) == fused
    return llm


@pytest.mark.parametrize(
    ("arch", "mix", "default", "head_dim", "engine_args"),
    [
        *((*case, HEAD_DIM, {}) for case in CASES),
        ("llama", {}, T.Q8_0, 80, {"block_size": 12}),
        # an int8 cache: q.k in integers here, over q rounded through int8 there
        ("llama", {}, T.Q8_0, 80, {"block_size": 12, "kv_cache_dtype": "int8"}),
        ("qwen3", Q4_K_M, T.Q4_K, HEAD_DIM, {"kv_cache_dtype": "int8"}),
    ],
    ids=[*IDS, "llama-head80-block12", "llama-head80-block12-int8kv", "qwen3-Q4_K_M-int8kv"],
)
def test_fused_matches_torch_path(
    arch: str,
    mix: dict[T, T],
    default: T,
    head_dim: int,
    engine_args: dict[str, Any],
    isa: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both paths run the same int8 matmul tiles on the same blocks; only fp32
    summation order differs (norm sums, attention dots and softmax sums in 8
    lanes here, torch's or the C kernels' own order there): ~1e-7 relative.
    That can move an activation across an int8 rounding boundary (one step of
    d = amax / 127 in one element of one block), after which that prompt's
    logits differ by ~0.8% on these random models: measured on 1-3 of the 6
    prompts, the longer ones, and the same happens between two ISA builds of
    the torch path itself. Hence: every prompt within 3%, and at least one
    (the short ones never cross a boundary here) within 1e-5. A wrong rotary,
    slot, cache read, norm or bias moves every prompt by tens of percent.
    The cache is the default bf16 one (or int8, where q is rounded through
    int8 too: exact integer sums here, floats of the same values there): both
    paths attend over the rows they rounded and wrote, never the fresh k/v."""
    path = write_quant_gguf(tmp_path / f"tiny-{arch}.gguf", arch, mix, default, head_dim=head_dim)
    prompts = random_prompts(len(TOKENS))
    fused = last_logits(_llm(path, True, monkeypatch, **engine_args), prompts)
    torch_path = last_logits(_llm(path, False, monkeypatch, **engine_args), prompts)
    errors = sorted(float((a - b).norm() / b.norm()) for a, b in zip(fused, torch_path))
    assert errors[0] < 1e-5 and errors[-1] < 0.03, errors


@pytest.mark.parametrize(
    ("arch", "mix", "default", "head_dim", "engine_args"),
    [
        *((*case, HEAD_DIM, {}) for case in CASES[1:]),
        # attention's other shapes: a head of 64 + 16 floats, blocks of 12 keys
        # (a chunk of 8 keys then spans two blocks), the cache in int8
        ("llama", {}, T.Q8_0, 80, {"block_size": 12, "kv_cache_dtype": "int8"}),
        ("llama", {}, T.Q4_0, HEAD_DIM, {"kv_cache_dtype": "bfloat16"}),
        ("llama", {}, T.Q4_0, 80, {"kv_cache_dtype": "fp8_e4m3"}),
    ],
    ids=[*IDS[1:], "llama-head80-block12-int8kv", "llama-bf16kv", "llama-head80-fp8kv"],
)
def test_batch_invariant_greedy(
    arch: str,
    mix: dict[T, T],
    default: T,
    head_dim: int,
    engine_args: dict[str, Any],
    isa: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each prompt alone, then all together with a small token budget (prompts
    chunked, prefill chunks mixed with decodes in one step, a shared prefix
    served from the cache): the same greedy tokens and the same logprob of
    every token, bit for bit (float equality: a 1e-5 change in one attention
    score of batched steps moves no argmax here but does move the logprobs).
    The torch path must never run: every step of a fused model goes through
    the fused call. Two threads, so a step of up to 4 rows (each prompt's
    decodes alone) runs with per-thread copies of the rows and a wider one
    (the batch) with shared ones: decoder_layer.c's two ways, the same bits."""
    path = write_quant_gguf(tmp_path / f"tiny-{arch}.gguf", arch, mix, default, head_dim=head_dim)

    def no_torch_path(*args: object, **kwargs: object) -> None:
        raise AssertionError("a step of a fused model took the torch path")

    monkeypatch.setattr(llama, "paged_attention", no_torch_path)
    prompts = random_prompts(len(TOKENS))
    prompts.append(prompts[-1][:40] + prompts[0])  # shares 2 full blocks with the 64-token prompt
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0, logprobs=0)

    def tokens(out: RequestOutput) -> list[tuple[int, float]]:
        logprobs = out.outputs[0].logprobs
        assert logprobs is not None
        return [(t.token_id, t.logprob) for t in logprobs]

    llm = _llm(path, True, monkeypatch, num_threads=2, **engine_args)
    alone = [tokens(llm.generate([p], params)[0]) for p in prompts]
    batched_llm = _llm(path, True, monkeypatch, num_threads=2, max_num_batched_tokens=24, max_num_seqs=8, **engine_args)
    batched = [tokens(o) for o in batched_llm.generate(prompts, params)]
    assert batched == alone


def test_packed_weights_change_no_bit(isa: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused stack over Q4_K weights repacked at load (csrc/packed_panels.h)
    against the same file's blocks: the same greedy tokens and logprobs, bit for
    bit, through prompts of up to 64 rows a step and decode steps of 1 to 4 rows."""
    path = write_quant_gguf(tmp_path / "tiny-llama.gguf", "llama", Q4_K_M, T.Q4_K)
    prompts = random_prompts(len(TOKENS))
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0, logprobs=0)

    def run() -> tuple[list[list[tuple[int, float]]], bool]:
        llm = _llm(path, True, monkeypatch, num_threads=2, max_num_seqs=4)
        llm.engine.runner.model.repack.finish()
        packed = any(part.packed is not None for part in llm.engine.runner.model.layers[0].gate_up.parts)
        outs = llm.generate(prompts, params)
        return [[(t.token_id, t.logprob) for t in o.outputs[0].logprobs or []] for o in outs], packed

    packed, was_packed = run()
    monkeypatch.setenv("STOKER_DISABLE_PACKED_GGML", "1")
    blocks, blocks_packed = run()
    assert (was_packed, blocks_packed) == (isa != "portable", False)
    assert all(len(tokens) == 8 for tokens in packed)
    assert packed == blocks


def test_weights_repacked_while_serving_change_no_bit(
    isa: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine serves the blocks from its first step while a thread repacks them
    (quant/repack.py), one linear layer at a time between steps: from the blocks,
    with half the layers repacked, and with all of them, the same greedy tokens and
    logprobs bit for bit, and the fused stack's tables follow each layer."""
    if isa == "portable":
        pytest.skip("nothing is packed on the portable path")
    path = write_quant_gguf(tmp_path / "tiny-llama.gguf", "llama", Q4_K_M, T.Q4_K)
    prompts = random_prompts(len(TOKENS))
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0, logprobs=0)
    start = BackgroundRepack.start
    monkeypatch.setattr(BackgroundRepack, "start", lambda self: None)  # held back until asked below
    llm = _llm(path, True, monkeypatch, num_threads=2, max_num_seqs=4)
    model = llm.engine.runner.model

    def run() -> list[list[tuple[int, float]]]:
        outs = llm.generate(prompts, params)
        return [[(t.token_id, t.logprob) for t in o.outputs[0].logprobs or []] for o in outs]

    linears = [getattr(layer, name) for layer in model.layers for name in LINEARS]

    def packed_tables() -> list[bool]:
        """Each part's flag in the C tables, which must say what the part serves."""
        assert model.fused is not None
        tables = [getattr(layer, name) for layer in model.fused._layers for name in LINEARS]
        flags = [bool(t.packed[i]) for t in tables for i in range(t.num_parts)]
        assert flags == [part.packed is not None for linear in linears for part in linear.parts]
        return flags

    assert model.repack.pending and not any(packed_tables())
    blocks = run()
    half = len(linears) // 2
    for linear in linears[:half]:
        with model.weights_lock:
            linear.install_packed(linear.packed_copies())
            model._repacked(linear)
    assert any(packed_tables()) and not any(p.packed is not None for lin in linears[half:] for p in lin.parts)
    halfway = run()
    monkeypatch.setattr(BackgroundRepack, "start", start)
    model.repack.finish()
    assert not model.repack.pending
    assert packed_tables() == [packs(part.qtype) for linear in linears for part in linear.parts]
    assert [p.packed is not None for p in model.lm_head.parts] == [packs(p.qtype) for p in model.lm_head.parts]
    assert blocks == halfway == run()
    assert all(len(tokens) == 8 for tokens in blocks)


def test_switch_and_what_it_does_not_serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_quant_gguf(tmp_path / "tiny-llama.gguf", "llama", {}, T.Q4_0)
    assert _llm(path, False, monkeypatch).engine.runner.model.fused is None  # STOKER_FUSED_DECODER=0
    monkeypatch.setenv("STOKER_FUSED_DECODER", "1")
    dense = LLM(str(path), dtype="float32", quantization="none", num_kv_blocks=16).engine.runner.model
    assert dense.fused is None
    why = FusedDecoder.build(dense)
    assert isinstance(why, str) and "not a GGML-quantized linear" in why
    bf16 = LLM(str(path), dtype="bfloat16", quantization="auto", num_kv_blocks=16).engine.runner.model
    assert bf16.fused is None and "float32" in str(FusedDecoder.build(bf16))


def test_position_beyond_rotary_tables_is_a_value_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_quant_gguf(tmp_path / "tiny-llama.gguf", "llama", {}, T.Q4_0)
    runner = _llm(path, True, monkeypatch).engine.runner
    model = runner.model
    fused = model.fused
    assert fused is not None
    from stoker.models.attention import AttentionMetadata

    far = model.rotary.cos.shape[0]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([0]),
        num_decodes=1,
        decode_block_tables=torch.tensor([[1]]),
        decode_context_lens=torch.tensor([far + 1]),
        decode_mask=None,
        prefills=[],
    )
    hidden = torch.zeros(1, model.config.hidden_size)
    with pytest.raises(ValueError, match="rotary"):
        fused(hidden, torch.tensor([far]), runner.kv_caches, meta)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch-path"])
def test_the_callers_subnormals_survive_the_c_kernels(
    fused: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C attention and the fused stack run with subnormals flushed
    (csrc/subnormals.h), each thread putting its own floating-point mode back:
    the calling thread still computes subnormals afterwards."""
    import numpy as np

    path = write_quant_gguf(tmp_path / "tiny-llama.gguf", "llama", {}, T.Q4_0)
    llm = _llm(path, fused, monkeypatch)
    llm.generate([random_prompts(len(TOKENS))[-1]], SamplingParams(max_tokens=3, temperature=0))
    assert np.float32(1e-39) * np.float32(3) == np.float32(3e-39) != 0
