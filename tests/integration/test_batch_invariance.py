"""Greedy tokens of a prompt must not depend on what else is in the batch: the
default model with its real tokenizer, prompts of mixed lengths generated
one at a time and then all together (prefills chunked beside decodes) give the
same tokens. Prefix caching is off, so the second run computes everything again
rather than reading the first run's blocks."""

from __future__ import annotations

import pytest

from stoker import LLM, SamplingParams

pytestmark = pytest.mark.integration

NEW_TOKENS = 16
# The GGUF path takes 32 prompts. The dense fp32 path takes 16 over the same span of lengths: its
# one-at-a-time pass is the suite's slowest call, and test_fidelity already checks it alone and
# together against transformers on 8 prompts of 5-600 tokens.
GGUF_PROMPTS = 32
DENSE_PROMPTS = 16

_TOPICS = ["the sea", "a clock tower", "bread", "rain in spring", "a chess game", "the moon", "salt", "a ferry"]
_SENTENCE = "The market opened at dawn and the traders argued about prices while the gulls circled the harbour. "


def _prompts(llm: LLM, count: int) -> list[list[int]]:
    """Chat-formatted questions and raw passages, from a few tokens to ~400."""
    tokenizer = llm.tokenizer
    prompts = []
    for i in range(count):
        topic = _TOPICS[i % len(_TOPICS)]
        if i % 2:
            messages = [{"role": "user", "content": f"Write {i % 5 + 1} sentences about {topic}."}]
            prompts.append(tokenizer.apply_chat_template(messages, tokenize=True))
        else:
            prompts.append(
                tokenizer.encode(
                    _SENTENCE * (i // 2 * (GGUF_PROMPTS - 2) // (count - 2)) + f"Now a story about {topic}:"
                )
            )
    lengths = [len(p) for p in prompts]
    assert min(lengths) < 16 and max(lengths) > 300, lengths
    return prompts


def _alone_vs_together(quantization: str, count: int) -> tuple[int, list[int]]:
    llm = LLM(dtype="float32", quantization=quantization, kv_cache_tokens=32768, enable_prefix_caching=False)
    prompts = _prompts(llm, count)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
    alone = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    differ = [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]
    return len(prompts) - len(differ), differ


def test_gguf_quantized_weights_are_batch_invariant() -> None:
    same, differ = _alone_vs_together("auto", GGUF_PROMPTS)
    assert not differ, f"{same}/{GGUF_PROMPTS} identical; prompts {differ} changed with the batch"


def test_dense_weights_are_batch_invariant() -> None:
    same, differ = _alone_vs_together("none", DENSE_PROMPTS)
    assert not differ, f"{same}/{DENSE_PROMPTS} identical; prompts {differ} changed with the batch"
