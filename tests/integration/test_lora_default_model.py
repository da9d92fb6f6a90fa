"""LoRA adapters on the default model (issue 38): three random-weight PEFT
adapters of different ranks and target modules, served in one batch mixed with
base requests, give exactly the greedy tokens of transformers + PEFT with each
adapter merged (merge_and_unload, float32) when the base is dequantized
(quantization none, float32); with the base in its own quantization, each
adapter's perplexity on a fixed text stays within 2% of that reference."""

from __future__ import annotations

import copy
import math
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from stoker import LLM, SamplingParams
from stoker.config import default_model_path
from stoker.engine.params import EngineCoreRequest

pytestmark = pytest.mark.integration

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NEW_TOKENS = 12
ADAPTERS = {
    "attn-r4": (4, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp-r8": (8, ["gate_proj", "up_proj", "down_proj"]),
    "all-r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
"""name -> (rank, target modules)."""
DELTA_STD = 0.004
"""Spread of each adapted weight's change, scale * (B A)[i, j]: about a tenth of the base's weights, which
changes the greedy text without wrecking the model (ten times that takes its perplexity into the thousands,
where a rounding difference moves it by percents)."""
PROMPTS = ["The capital of France is", "Once upon a time, in a quiet village,"]
TEXT = (
    "The river town woke slowly. Fishermen checked their nets, bakers pulled bread from clay ovens, "
    "and children ran along the quay shouting the names of boats. In the square, the clock had stopped "
    "at a quarter past nine years ago, and nobody had found the money to fix it."
)


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory, transformers_default_model: PreTrainedModel
) -> tuple[torch.nn.Module, dict[str, Path], object]:
    """transformers' base (the GGUF dequantized, float32), the adapters written by peft, and the tokenizer."""
    from peft import LoraConfig, get_peft_model

    from stoker.models.loader import load_tokenizer

    path = Path(default_model_path())
    # A copy of the session's model (loading it again takes ~10 s): peft wraps its layers in place.
    base = copy.deepcopy(transformers_default_model)
    root = tmp_path_factory.mktemp("default-loras")
    model = None
    for name, (rank, targets) in ADAPTERS.items():
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
        if model is None:
            model = get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    assert model is not None
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "lora_A" in key or "lora_B" in key:  # PEFT starts B at zero: a no-op adapter
                rank = ADAPTERS[key.split(".")[-2]][0]
                # (B A)[i, j] sums rank products of two entries, and the scale lora_alpha / r is 2.
                magnitude = math.sqrt(DELTA_STD / (2 * math.sqrt(rank)))
                param.copy_(magnitude * torch.randn(param.shape, generator=gen))
    model.save_pretrained(root)  # one folder per adapter: root/<name>
    base = model.unload()  # the base's own weights, never merged into
    return base, {name: root / name for name in ADAPTERS}, load_tokenizer(str(path))


def merged(base: torch.nn.Module, folder: Path) -> torch.nn.Module:
    from peft import PeftModel

    model: torch.nn.Module = PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload()
    return model.eval()


def greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def reference_perplexity(model: torch.nn.Module, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
    return perplexity(logprobs[:, 0].tolist())


def test_adapters_mixed_with_the_base_match_transformers_and_peft(setup) -> None:  # type: ignore[no-untyped-def]
    base, folders, tokenizer = setup
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    names: list[str | None] = [None, *ADAPTERS]
    references = {name: merged(base, folders[name]) for name in ADAPTERS}
    jobs = [(prompt, name) for prompt in prompts for name in names]
    expected = [greedy(references[name] if name else base, prompt) for prompt, name in jobs]
    by_name = {name: [e for (_, n), e in zip(jobs, expected) if n == name] for name in names}
    for name in ADAPTERS:
        assert by_name[name] != by_name[None], f"{name} changes the text"

    llm = LLM(quantization="none", dtype="float32", kv_cache_tokens=4096, max_loras=3)
    for name in ADAPTERS:
        llm.add_lora(name, str(folders[name]))
    engine = llm.engine
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {}
    for i, (prompt, name) in enumerate(jobs):  # all at once: one batch of base and adapter rows
        engine.add_request(EngineCoreRequest(f"job-{i}", prompt, params, time.time(), lora_name=name))
        got[f"job-{i}"] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            got[delta.request_id] += delta.new_token_ids
    assert list(got.values()) == expected
    del llm

    # The base in its own quantization (Q4_1 weights, int8 activations): perplexity within 2%.
    text = tokenizer.encode(TEXT)
    quantized = LLM(kv_cache_tokens=4096)
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    for name in ADAPTERS:
        quantized.add_lora(name, str(folders[name]))
        (out,) = quantized.generate([text], scoring, lora_name=name)
        assert out.prompt_logprobs is not None
        served = perplexity([lp.logprob for lp in out.prompt_logprobs[1:] if lp is not None])
        exact = reference_perplexity(references[name], text)
        assert abs(served / exact - 1) < 0.02, (name, served, exact)
