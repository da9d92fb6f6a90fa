"""Quantized KV cache (kv_cache_dtype int8 / fp8_e4m3, stoker/models/kv_quant.py):
the row format's round trip, the C attention kernels against the torch path on
the same quantized cache, the fused decoder, whole-engine generation against
the unquantized cache and under batching, chunking, prefix hits and
preemption, capacity, and a bad value."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from pydantic import ValidationError
from quant_models import write_quant_gguf
from tiny_models import make_tiny_hf_model

from stoker import LLM, SamplingParams
from stoker.config import EngineConfig, ModelConfig
from stoker.engine.kv_sizing import size_kv_cache
from stoker.engine.params import EngineCoreRequest
from stoker.engine.runner import kv_bytes_per_block
from stoker.models import attention, cpu_kernels, fused_decoder
from stoker.models.attention import (
    AttentionInputs,
    CPUPagedAttention,
    PrefillChunk,
    TorchSDPAAttention,
    paged_attention,
    write_kv,
)
from stoker.models.kv_quant import dequantize_rows, quantize_queries, quantize_rows, row_width
from stoker.models.quant import kernels as quant_kernels

FP8 = torch.float8_e4m3fn
QDTYPES = [torch.int8, FP8]
QIDS = ["int8", "fp8"]
needs_c = pytest.mark.skipif(cpu_kernels.load_paged_attention() is None, reason="no C compiler")


# ------------------------------------------------------------------ row format


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
def test_round_trip_error_is_bounded_by_the_row_scale(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes, one all-zero row, one with a single outlier.
    x = torch.randn(64, 3, 64, generator=g) * torch.logspace(-3, 2, 64)[:, None, None]
    x[5, 1] = 0.0
    x[6, 2, 7] = 1000.0
    packed = quantize_rows(x, dtype)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 3, row_width(64, dtype)) == (64, 3, 68)
    back = dequantize_rows(packed.view(dtype), dtype, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:
        bound = amax / 127 / 2 * (1 + 1e-5)  # half a step of the row's scale
    else:
        # 3 mantissa bits: half an ulp is 2^-4 of the value; below 2^-6 (subnormals) a fixed step.
        bound = torch.maximum(x.abs() * 2**-4, amax / 448 * 2**-10) * (1 + 1e-5)
    assert torch.all((back - x).abs() <= bound)
    assert torch.all(back[5, 1] == 0) and torch.isfinite(back).all()
    assert back[6, 2, 7] == 1000.0  # the row's maximum is stored exactly


# ------------------------------------------------------------ attention kernels

BS, KVH, H = 4, 2, 6  # GQA: 3 query heads per kv head


def _cache(dtype: torch.dtype, lens: list[int], D: int, seed: int = 0):
    """A quantized cache holding random sequences of `lens` tokens on shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(-(-n // BS) for n in lens) + 3
    k_cache = torch.zeros(num_blocks, BS, KVH, row_width(D, dtype), dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // BS))]
        k, v = torch.randn(n, KVH, D, generator=g), torch.randn(n, KVH, D, generator=g)
        write_kv(k_cache, v_cache, k, v, torch.tensor([table[p // BS] * BS + p % BS for p in range(n)]))
        tables.append(table)
    return k_cache, v_cache, tables


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [rows, H, D], the last `rows` positions of k/v [n, KVH, D], causal."""
    rows, _, D = q.shape
    n = k.shape[0]
    k, v = (t.repeat_interleave(H // KVH, dim=1).transpose(0, 1) for t in (k, v))  # [H, n, D]
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * D**-0.5  # [H, rows, n]
    visible = torch.arange(n)[None, :] <= torch.arange(n - rows, n)[:, None]
    return (torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v).transpose(0, 1)


def _dequantized(cache: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
    rows = dequantize_rows(cache[torch.tensor(table)], cache.dtype, torch.float32)
    return rows.reshape(-1, KVH, rows.shape[-1])[:n]


def _backends(head_dim: int) -> list[TorchSDPAAttention]:
    return [TorchSDPAAttention()] + ([CPUPagedAttention(head_dim)] if cpu_kernels.load_paged_attention() else [])


@pytest.mark.parametrize("head_dim", [16, 64], ids=lambda d: f"d{d}")  # 64: the AVX-512 specialisations
@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=["q-f32", "q-bf16"])
def test_decode_reads_the_quantized_cache(head_dim: int, dtype: torch.dtype, qdtype: torch.dtype) -> None:
    """Context lengths below, at and across block (4) and 16-key tile boundaries."""
    lens = [1, 4, 5, 16, 17, 33]
    k_cache, v_cache, tables = _cache(dtype, lens, head_dim)
    q = torch.randn(len(lens), H, head_dim, generator=torch.Generator().manual_seed(1)).to(qdtype)
    empty = torch.empty(0, KVH, head_dim)
    tol = 1e-5 if qdtype == torch.float32 else 2e-2
    for backend in _backends(head_dim):
        meta = backend.build_metadata(AttentionInputs(torch.zeros(0, dtype=torch.long), tables, lens, [], BS, 0))
        out = paged_attention(q, empty, empty, k_cache, v_cache, meta, head_dim**-0.5).view(len(lens), H, head_dim)
        for i, n in enumerate(lens):
            # against an int8 cache q is rounded through int8 too (kv_quant.quantize_queries)
            want = _naive(
                quantize_queries(q[i : i + 1].float(), dtype),
                _dequantized(k_cache, tables[i], n),
                _dequantized(v_cache, tables[i], n),
            )
            torch.testing.assert_close(out[i].float(), want[0], atol=tol, rtol=tol, msg=backend.name)


@pytest.mark.parametrize("head_dim", [16, 64], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
def test_prefill_chunks_read_the_quantized_cache(head_dim: int, dtype: torch.dtype) -> None:
    """A whole prompt and later chunks (cached context before them), over block boundaries."""
    lens = [7, 21, 40]
    k_cache, v_cache, tables = _cache(dtype, lens, head_dim, seed=2)
    g = torch.Generator().manual_seed(3)
    for i, (n, chunk_len) in enumerate([(7, 7), (21, 9), (40, 17)]):
        q = torch.randn(chunk_len, H, head_dim, generator=g)
        k_all, v_all = _dequantized(k_cache, tables[i], n), _dequantized(v_cache, tables[i], n)
        want = _naive(quantize_queries(q, dtype), k_all, v_all)
        # This chunk's own k/v as the model would pass them (before quantization): a path
        # that used them instead of the cache would differ from `want` by the quantization error.
        k_new = torch.randn(chunk_len, KVH, head_dim, generator=g)
        for backend in _backends(head_dim):
            chunk = PrefillChunk(0, chunk_len, n, torch.tensor(tables[i]))
            meta = backend.build_metadata(AttentionInputs(torch.zeros(0, dtype=torch.long), [], [], [chunk], BS, 0))
            out = paged_attention(q, k_new, k_new, k_cache, v_cache, meta, head_dim**-0.5)
            torch.testing.assert_close(
                out.view(chunk_len, H, head_dim), want, atol=2e-5, rtol=2e-5, msg=f"{backend.name} n={n}"
            )


def test_a_whole_prompt_reads_a_bf16_cache_under_float32_activations() -> None:
    """bf16 rows under float32 queries (the default cache of a quantized GGUF):
    torch SDPA attends over the rounded rows it wrote, not the fresh k/v, so a
    prompt prefilled whole matches the same prompt's later chunk over cached
    context to float rounding."""
    n, head_dim = 13, 16
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, t, head_dim, generator=g) for t in (H, KVH, KVH))
    k_cache = torch.zeros(8, BS, KVH, head_dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    table = [5, 2, 7, 1]
    write_kv(k_cache, v_cache, k, v, torch.tensor([table[p // BS] * BS + p % BS for p in range(n)]))
    backend = TorchSDPAAttention()

    def attend(start: int) -> torch.Tensor:
        chunk = backend._with_mask(PrefillChunk(0, n - start, n, torch.tensor(table)))
        meta = backend.build_metadata(AttentionInputs(torch.zeros(0, dtype=torch.long), [], [], [chunk], BS, 0))
        out = paged_attention(q[start:], k[start:], v[start:], k_cache, v_cache, meta, head_dim**-0.5)
        return out.view(n - start, H, head_dim)

    whole, tail = attend(0), attend(6)
    torch.testing.assert_close(whole[6:], tail, atol=1e-6, rtol=1e-6)
    rounded = _naive(q, k.bfloat16().float(), v.bfloat16().float())
    torch.testing.assert_close(whole, rounded, atol=1e-5, rtol=1e-5)


def test_the_c_backend_is_chosen_for_a_quantized_cache() -> None:
    backend = attention.select_attention_backend(torch.device("cpu"), torch.int8, torch.float32, 64)
    expected = CPUPagedAttention if cpu_kernels.load_paged_attention() else TorchSDPAAttention
    assert type(backend) is expected


# --------------------------------------------------------------- whole engine

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("kvq"))


def random_prompts() -> list[list[int]]:
    """Random prompts, and one repeating a phrase (so prompt lookup has drafts to propose)."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(10, 49000, (n,), generator=g).tolist() for n in (3, 17, 40, 65)]
    return prompts + [torch.randint(10, 49000, (5,), generator=g).tolist() * 6]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def last_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(EngineCoreRequest(f"r{i}", p, SamplingParams(max_tokens=1), 0.0))
    step = engine.scheduler.schedule()
    got = engine.runner.execute(step)
    while engine.has_unfinished_requests():
        engine.step()
    order = [int(s.request_id[1:]) for s in step.scheduled]
    return [got[order.index(i)] for i in range(len(prompts))]


@pytest.fixture(params=["c", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Attention by the C kernels, or forced onto the torch SDPA path."""
    if request.param == "c":
        if cpu_kernels.load_paged_attention() is None:
            pytest.skip("no C compiler")
    else:
        monkeypatch.setattr(attention, "paged_attention_supported", lambda head_dim: False)
    return str(request.param)


def test_int8_cache_stays_close_to_the_float_cache(tiny: Path, path: str) -> None:
    """Last-token logits within 2% (relative L2) of the fp32 cache's, and along the
    fp32 cache's greedy continuations (teacher-forced, so one near-tie of these flat
    random logits does not derail the rest) the int8 cache's argmax is the same
    token at >= 90% of positions. A misread scale, row or block moves logits by tens
    of percent and the argmax almost everywhere."""
    prompts = random_prompts()
    llm = LLM(str(tiny), dtype="float32", kv_cache_dtype="int8", num_kv_blocks=64)
    expected = CPUPagedAttention if path == "c" else TorchSDPAAttention
    assert type(llm.engine.runner.attention) is expected
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.int8
    ref = LLM(str(tiny), dtype="float32", num_kv_blocks=64)
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(last_logits(llm, prompts), last_logits(ref, prompts))]
    assert max(errors) < 0.02, errors
    assert min(errors) > 0, "the int8 cache changed nothing: is it used?"
    continued = [p + out for p, out in zip(prompts, _greedy(ref, prompts))]
    scored = llm.generate(continued, SamplingParams(max_tokens=1, prompt_logprobs=0))
    ranks = [lp.rank for p, o in zip(prompts, scored) for lp in (o.prompt_logprobs or [])[len(p) :] if lp]
    assert len(ranks) == NEW_TOKENS * len(prompts)
    assert sum(r == 1 for r in ranks) >= 0.9 * len(ranks), ranks


CHUNKED = {"max_num_batched_tokens": 7}  # chunked prefill, chunks mixed with decodes
PREEMPTED = {"num_kv_blocks": 22, "block_size": 4, "enable_prefix_caching": False}
SPECULATIVE = {"speculative_method": "ngram", "num_speculative_tokens": 3}  # drafts written, then overwritten


_ALONE: dict[str, list[list[int]]] = {}


# The torch path once (its reads do not depend on the schedule at all): the suite's time goes to the C path.
@pytest.mark.parametrize(
    ("path", "engine_args"),
    [("c", CHUNKED), ("c", PREEMPTED), ("c", SPECULATIVE), ("torch", PREEMPTED)],
    ids=["c-chunked", "c-preempted", "c-speculative", "torch-preempted"],
    indirect=["path"],
)
def test_int8_greedy_tokens_do_not_depend_on_scheduling(tiny: Path, path: str, engine_args: dict) -> None:
    """Each prompt alone vs all together chunked / preempted / speculated, then
    again from the prefix cache: the same tokens (the cache is read back the same
    way whichever step wrote it)."""
    prompts = random_prompts()
    if path not in _ALONE:  # the reference depends on the path only, not on the schedule under test
        alone_llm = LLM(str(tiny), dtype="float32", kv_cache_dtype="int8", num_kv_blocks=64, speculative_method="none")
        _ALONE[path] = [_greedy(alone_llm, [p])[0] for p in prompts]
    alone = _ALONE[path]
    llm = LLM(str(tiny), dtype="float32", kv_cache_dtype="int8", **{"num_kv_blocks": 64, **engine_args})
    assert _greedy(llm, prompts) == alone
    if "block_size" in engine_args:
        assert llm.engine.stats().num_preemptions > 0
    if "num_speculative_tokens" in engine_args:
        assert llm.engine.stats().spec_drafts > 0
    if llm.engine.kv.enable_caching:
        assert _greedy(llm, prompts) == alone
        assert llm.engine.stats().prefix_cache_hits > 0


@pytest.mark.skipif(quant_kernels._library("portable") is None, reason="no C compiler")
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "bfloat16", "float16"])
def test_fused_decoder_with_a_narrow_cache_matches_the_per_layer_path(
    kv_cache_dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused C stack rounds k/v (int8 or fp8 with a scale, bf16, fp16) as it writes
    them and reads them back itself; the per-layer path does both in torch + the
    C attention kernels. Same cache format, so the logits agree to float
    rounding (int8 flips of a value on a rounding edge allowed: 3%, see
    test_fused_decoder)."""
    gguf = write_quant_gguf(tmp_path / "tiny.gguf", "llama", {}, GGMLQuantizationType.Q8_0)
    prompts = [list(range(3, 3 + n)) for n in (5, 19, 40)]
    logits = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("STOKER_FUSED_DECODER", fused)
        llm = LLM(str(gguf), dtype="float32", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=32)
        model = llm.engine.runner.model
        assert (model.fused is not None and model.fused.serves(llm.engine.runner.kv_caches)) == (fused == "1")
        logits[fused] = last_logits(llm, prompts)
        float_cache = LLM(str(gguf), dtype="float32", kv_cache_dtype="float32", num_kv_blocks=32)
        logits[fused + "f32"] = last_logits(float_cache, prompts)
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(logits["1"], logits["0"])]
    assert max(errors) < 0.03, errors
    # ...and the narrow cache really is in use on the fused path.
    assert any(not torch.equal(a, b) for a, b in zip(logits["1"], logits["1f32"]))


def test_auto_cache_is_bf16_for_quantized_weights_on_the_cpu(tmp_path: Path) -> None:
    """auto follows the model's dtype, except that quantized weights (float32
    activations) get a bf16 cache: half the bytes per decode step, no measured
    cost in perplexity (docs/perf/kv-cache-quant.md)."""
    gguf = str(write_quant_gguf(tmp_path / "tiny.gguf", "llama", {}, GGMLQuantizationType.Q8_0))
    cases = [("auto", "auto", torch.bfloat16), ("none", "float32", torch.float32), ("auto", "float32", torch.float32)]
    for quantization, kv_cache_dtype, want in cases:
        llm = LLM(gguf, dtype="float32", quantization=quantization, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=8)
        assert llm.engine.runner.kv_caches[0][0].dtype == want, (quantization, kv_cache_dtype)


# ------------------------------------------------------------------- capacity

SMOLLM2 = ModelConfig("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, 8192, 1e-5, 1e5)


def test_capacity_for_the_same_memory() -> None:
    """SmolLM2-135M's shape: 68 bytes per (token, head) row vs 128 in bf16 and 256 in fp32."""
    per = {dt: kv_bytes_per_block(SMOLLM2, 16, dt) for dt in (torch.float32, torch.bfloat16, torch.int8, FP8)}
    assert per[torch.int8] == per[FP8] == 2 * 30 * 16 * 3 * 68
    config = EngineConfig.model_validate({"kv_cache_memory_bytes": 512 * 2**20, "max_num_seqs": 1024})
    blocks = {dt: size_kv_cache(config, b, 8192, 2**40).num_blocks for dt, b in per.items()}
    assert blocks[torch.int8] / blocks[torch.bfloat16] > 1.85
    assert blocks[torch.int8] / blocks[torch.float32] > 3.7


def test_engine_allocates_and_reports_the_smaller_rows(tiny: Path) -> None:
    """The blocks the engine reports (start log, /metrics) are what the same bytes hold."""
    budget = 4 * 2**20
    llms = {
        dt: LLM(str(tiny), dtype="float32", kv_cache_dtype=dt, kv_cache_memory_bytes=budget) for dt in ("auto", "int8")
    }
    for llm in llms.values():
        caches = llm.engine.runner.kv_caches
        allocated = caches[0][0].shape[0]
        assert allocated == budget // (sum(k.nbytes + v.nbytes for k, v in caches) // allocated)
        assert llm.engine.stats().kv_blocks_total == allocated - 1  # less the reserved null block
    # head_dim 16: rows of 20 bytes against 64 in fp32.
    ratio = llms["int8"].engine.kv_capacity_tokens / llms["auto"].engine.kv_capacity_tokens
    assert 3.1 < ratio < 3.3


def test_a_bad_kv_cache_dtype_names_the_choices() -> None:
    with pytest.raises(ValidationError) as err:
        EngineConfig.model_validate({"kv_cache_dtype": "int4"})
    assert "kv_cache_dtype" in str(err.value) and "'int8'" in str(err.value) and "'fp8_e4m3'" in str(err.value)
    assert EngineConfig.model_validate({"kv_cache_dtype": "bf16"}).kv_cache_dtype == "bf16"


def _row_rounding_apart_under_a_reciprocal(width: int) -> torch.Tensor:
    """A row whose int8 value rounds one way with the scale's inverse 127 / amax
    divided and the other with it taken as 127 * (1 / amax), as torch computes
    a number over a tensor: the C kernels divide, and so must kv_quant."""
    for amax in np.linspace(1.0, 4.0, 4001, dtype=np.float32):
        divided = np.float32(127) / amax
        reciprocal = np.float32(127) * (np.float32(1) / amax)
        if divided == reciprocal:
            continue
        value = np.float32(100.5) / divided
        for _ in range(64):
            if np.rint(value * divided) != np.rint(value * reciprocal):
                row = torch.zeros(width)
                row[0], row[1] = float(amax), float(value)
                return row
            value = np.nextafter(value, np.float32(np.inf), dtype=np.float32)
    raise AssertionError("no amax in [1, 4] whose inverse differs under a reciprocal")


@pytest.mark.skipif(quant_kernels._library("portable") is None, reason="no C compiler")
@pytest.mark.parametrize("isa", quant_kernels.available_isas())
@pytest.mark.parametrize(
    "dtype",
    [torch.int8, FP8, torch.float16, torch.bfloat16, torch.float32],
    ids=["int8", "fp8", "float16", "bfloat16", "float32"],
)
def test_fused_decoder_stores_and_reads_rows_as_torch_does(dtype: torch.dtype, isa: str) -> None:
    """The fused stack writes k and v into the cache itself (kv_quant.py's
    rounding, torch's casts) and its attention reads them back in registers or
    through a widened buffer: both, bit for bit against torch, on every ISA
    build, over rows that reach each format's edges (fp8 and fp16 subnormals,
    e4m3 ties, fp16 overflow to infinity, an all-zero row, head_dim 80 for a
    16k + 8 tail)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 80, generator=g) * torch.logspace(-6, 3, 96)[:, None]
    x[3] = 0.0
    x[4, :8] = torch.tensor([448.0, -3.25e-3, 1e-9, -0.0, 7e4, 65520.0, 65519.0, 2.0**-20])
    x[5, :4] = torch.tensor([1.0, 1.0625 / 448, 1.1875 / 448, 2.0**-10 / 448])  # e4m3 ties to even
    x[6] = torch.randn(80, generator=g) * 2.0**-17  # fp16 subnormals
    x[7] = _row_rounding_apart_under_a_reciprocal(80)
    got = fused_decoder.kv_round_trip(x, dtype, isa)
    assert got is not None
    stored, values = got
    if dtype in (torch.int8, FP8):
        packed = quantize_rows(x, dtype)
        want = dequantize_rows(packed.view(dtype), dtype, torch.float32)
    else:
        packed = x.to(dtype).view(torch.uint8)
        want = x.to(dtype).float()
    assert torch.equal(stored, packed)
    assert torch.equal(values, want)
    with pytest.raises(ValueError, match="head_dim 12"):
        fused_decoder.kv_round_trip(x[:, :12], dtype, isa)
