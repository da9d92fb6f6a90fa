"""Greedy generation on the default model (fp32) gives exactly the tokens that
Hugging Face transformers gives for the same GGUF, however the engine batches,
chunks, preempts or hits its prefix cache."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from stoker import LLM, SamplingParams
from stoker.config import default_model_path

pytestmark = pytest.mark.integration

NEW_TOKENS = 32  # at 64 this file was the suite's slowest: ~4 minutes of one worker

_PASSAGE = (
    "The river town woke slowly. Fishermen checked their nets, bakers pulled bread from "
    "clay ovens, and children ran along the quay shouting the names of boats. "
    "In the square, the clock had stopped at a quarter past nine years ago, and nobody "
    "had found the money to fix it, so the town kept its own time by the bells of the "
    "ferry. Merchants argued about the price of salt; a teacher read poems aloud. "
)


def _prompts(tokenizer) -> list[list[int]]:
    """Eight prompts from 5 to ~600 tokens, chat-formatted and raw, so the
    shortest sits in one block and the longest spans many."""
    chats = [
        "Hi!",
        "Name three primary colours.",
        "Write a haiku about the sea and explain its imagery in detail.",
    ]
    raw = [
        "The capital of France is",
        _PASSAGE,
        _PASSAGE * 3 + "Summarise the passage:",
        _PASSAGE * 6 + "What time did the clock stop?",
        "def fibonacci(n):\n    " + _PASSAGE * 8,
    ]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=True) for c in chats]
    prompts += [tokenizer.encode(r) for r in raw]
    return prompts


@pytest.fixture(scope="module")
def reference(transformers_default_model: PreTrainedModel) -> tuple[list[list[int]], list[list[int]]]:
    """Transformers' greedy tokens for each prompt alone (batch 1, no padding)."""
    from stoker.models.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    prompts = _prompts(tokenizer)
    lengths = [len(p) for p in prompts]
    assert min(lengths) <= 8 and max(lengths) >= 500, lengths
    model = transformers_default_model
    outputs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(p) :].tolist())
    return prompts, outputs


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _assert_same(got: list[list[int]], want: list[list[int]]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, (
            f"prompt {i}: first difference at token {next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)}"
        )


def test_alone_and_together_and_cached(reference) -> None:
    prompts, want = reference
    llm = LLM(dtype="float32", quantization="none", num_kv_blocks=512)
    _assert_same([_generate(llm, [p])[0] for p in prompts], want)
    llm.engine.reset_prefix_cache()
    _assert_same(_generate(llm, prompts), want)
    hits_before = llm.engine.stats().prefix_cache_hits
    _assert_same(_generate(llm, prompts), want)
    assert llm.engine.stats().prefix_cache_hits > hits_before, "second run should hit the prefix cache"


def test_tiny_token_budget_chunks_prefill(reference) -> None:
    prompts, want = reference
    llm = LLM(
        dtype="float32", quantization="none", num_kv_blocks=512, max_num_batched_tokens=24, enable_prefix_caching=False
    )
    _assert_same(_generate(llm, prompts), want)
    assert llm.engine.stats().steps > len(prompts) * NEW_TOKENS // 8


def test_tiny_kv_cache_preempts(reference) -> None:
    prompts, want = reference
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    llm = LLM(dtype="float32", quantization="none", num_kv_blocks=-(-longest // 16) + 8, enable_prefix_caching=False)
    _assert_same(_generate(llm, prompts), want)
    assert llm.engine.stats().num_preemptions > 0
