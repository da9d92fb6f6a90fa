"""The engine on CUDA: skipped where torch sees no GPU (CI has none), run on
a GPU machine to check what a CUDA user gets. GGUF weights are dequantized
at load there (the int8 kernels are CPU code), a CPU-only quantization is a
clear error, and the torch path on the GPU must agree with the same path on
the CPU and with transformers' own forward."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from conftest import cache_sharing_kernels
from gguf import GGMLQuantizationType as T
from quant_models import Q4_K_M, TOKENS, write_quant_gguf

from stoker import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_CACHE_DIR", cache_sharing_kernels(tmp_path / "cache"))


def random_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (2, 7, 19, 40, 77)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("mix", ["Q8_0", "Q4_K_M"])
def test_gguf_on_cuda_is_dequantized_and_matches_the_cpu_torch_path(mix: str, tmp_path: Path) -> None:
    types, default = ({}, T.Q8_0) if mix == "Q8_0" else (Q4_K_M, T.Q4_K)
    path = str(write_quant_gguf(tmp_path / "tiny.gguf", "llama", types, default))
    cuda = LLM(path, device="cuda", dtype="float32", quantization="auto", num_kv_blocks=64)
    model = cuda.engine.runner.model
    assert model.embed.quantized is None and model.embed.dense is not None
    assert model.embed.dense.device.type == "cuda"
    cpu = LLM(path, device="cpu", dtype="float32", quantization="none", num_kv_blocks=64)
    prompts = random_prompts(len(TOKENS))
    assert _greedy(cuda, prompts) == _greedy(cpu, prompts)
    # Each prompt alone gives what it gave in the batch.
    assert [_greedy(cuda, [p])[0] for p in prompts] == _greedy(cuda, prompts)


def test_cpu_only_quantization_on_cuda_is_a_clear_error(tmp_path: Path) -> None:
    path = str(write_quant_gguf(tmp_path / "tiny.gguf", "llama", {}, T.Q8_0))
    with pytest.raises(ValueError, match="CPU int8 kernels only"):
        LLM(path, device="cuda", quantization="q8_0")


def test_hf_model_on_cuda_matches_transformers(tmp_path: Path) -> None:
    import transformers
    from tiny_models import make_tiny_hf_model

    folder = make_tiny_hf_model("llama", tmp_path, tie=True)
    llm = LLM(str(folder), device="cuda", dtype="float32", num_kv_blocks=64)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    prompts = random_prompts(49152)
    for prompt, got in zip(prompts, _greedy(llm, prompts)):
        ids = torch.tensor([prompt], device="cuda")
        want = reference.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(prompt) :]
        assert got == want.tolist()


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "int8", "fp8_e4m3"])
def test_kv_cache_dtypes_serve_on_cuda(kv_cache_dtype: str, tmp_path: Path) -> None:
    path = str(write_quant_gguf(tmp_path / "tiny.gguf", "llama", {}, T.Q8_0))
    llm = LLM(path, device="cuda", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64)
    want = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv_cache_dtype]
    assert llm.engine.runner.kv_caches[0][0].dtype == want
    assert all(len(tokens) == 12 for tokens in _greedy(llm, random_prompts(len(TOKENS))))
