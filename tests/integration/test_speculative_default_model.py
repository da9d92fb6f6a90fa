"""Speculative decoding on the default model (SmolLM2-135M Q4_1, fused
quantized decoder) with its real tokenizer: 20 grounded prompts (a passage,
then "copy it"), greedy, all in one batch and then one at a time, give exactly
the tokens that decoding without speculation gives, and most drafts are accepted."""

from __future__ import annotations

import pytest

from stoker import LLM, SamplingParams
from stoker.bench.workload import HFTokenizer, LengthDist, grounded

pytestmark = pytest.mark.integration

NUM_PROMPTS = 20
NEW_TOKENS = 32


def _prompts(llm: LLM) -> list[list[int]]:
    specs = grounded(HFTokenizer(llm.tokenizer.hf), NUM_PROMPTS, LengthDist.parse("40:120"), None, seed=3)
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": s.prompt}], tokenize=True) for s in specs]


def test_greedy_identical_with_ngram_speculation_batched_and_alone() -> None:
    plain = LLM(speculative_method="none", kv_cache_tokens=32768)
    prompts = _prompts(plain)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    del plain
    spec = LLM(speculative_method="ngram", kv_cache_tokens=32768)
    together = [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)]
    differ = [i for i, (a, b) in enumerate(zip(expected, together)) if a != b]
    assert not differ, f"prompts {differ} changed with speculation (batched)"
    alone = [spec.generate([p], greedy)[0].outputs[0].token_ids for p in prompts[:6]]
    assert alone == expected[:6]
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > stats.spec_draft_tokens / 3, stats
