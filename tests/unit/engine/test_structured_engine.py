"""Grammar-constrained decoding in the engine, on a tiny random-weight model:
random weights give near-arbitrary logits, so every valid output here is the
grammar's doing. Checked with continuous batching, chunked prefill, prefix
caching, preemption, n > 1, seeds, and the sampler's bitmask on its own."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import numpy as np
import pytest
import torch
from tiny_models import make_tiny_hf_model

from stoker import LLM, SamplingParams
from stoker.engine.grammars import choice_grammar, json_schema_grammar, regex_grammar, text_grammar
from stoker.engine.params import FinishReason
from stoker.engine.sampler import Sampler, SampleRow
from stoker.engine.structured import banned_tokens, bitmask_words

# Bounded schemas: a random model never chooses to close a free string, so
# free-length strings and numbers would run to max_tokens.
SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog", "bird"]},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["kind", "tags", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"const": 1}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"type": ["string", "null"], "maxLength": 4},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
]
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = make_tiny_hf_model("llama", tmp_path_factory.mktemp("structured"))
    return LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=32)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(10, 49000, (int(k),), generator=g).tolist() for k in torch.randint(3, 60, (n,), generator=g)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_validates_against_its_schema(llm: LLM, temperature: float) -> None:
    prompts = _prompts(2 * len(SCHEMAS))
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=temperature,
            seed=i,
            grammar=json_schema_grammar(SCHEMAS[i % len(SCHEMAS)]),
        )
        for i in range(len(prompts))
    ]
    # Unconstrained rows share the batch: the mask must touch constrained rows only.
    prompts += _prompts(2)
    params += [SamplingParams(max_tokens=6, temperature=temperature, ignore_eos=True)] * 2
    outs = llm.generate(prompts, params)
    for i, out in enumerate(outs[: len(SCHEMAS) * 2]):
        o = out.outputs[0]
        assert o.finish_reason == FinishReason.STOP, (o.text, o.finish_reason)
        jsonschema_rs.validate(SCHEMAS[i % len(SCHEMAS)], json.loads(o.text))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs[-2:])


def test_regex_choice_and_grammar_constraints(llm: LLM) -> None:
    cases = [
        (
            regex_grammar(r"[a-z]{2,5}@[a-z]{3}\.(com|org)"),
            lambda t: re.fullmatch(r"[a-z]{2,5}@[a-z]{3}\.(com|org)", t),
        ),
        (choice_grammar(["positive", "negative", "neutral"]), lambda t: t in ("positive", "negative", "neutral")),
        (text_grammar('start: "(" num ("+" num)* ")"\nnum: /[0-9]/\n'), lambda t: re.fullmatch(r"\(\d(\+\d)*\)", t)),
        (text_grammar('root ::= "x" [0-9] [0-9]'), lambda t: re.fullmatch(r"x\d\d", t)),
    ]
    outs = llm.generate(
        _prompts(len(cases) * 2),
        [SamplingParams(max_tokens=40, temperature=t, seed=3, grammar=g) for g, _ in cases for t in (0.0, 1.0)],
    )
    for k, out in enumerate(outs):
        o = out.outputs[0]
        assert cases[k // 2][1](o.text), o.text
        assert o.finish_reason == FinishReason.STOP


def test_n_samples_prefix_cache_and_preemption_keep_outputs_valid(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A cache too small for the batch forces preemptions mid-output; the matcher
    keeps its state (the tokens are kept) and every sample still validates."""
    folder = make_tiny_hf_model("llama", tmp_path_factory.mktemp("structured-preempt"))
    small = LLM(str(folder), dtype="float32", num_kv_blocks=24, block_size=8, max_num_batched_tokens=24)
    schema = SCHEMAS[1]
    prompt = _prompts(1)[0][:20]
    outs = small.generate(
        [prompt] * 4,
        [
            SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=1.0, seed=i, grammar=json_schema_grammar(schema))
            for i in range(4)
        ],
    )
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.kv.prefix_hits > 0
    for out in outs:
        for o in out.outputs:
            jsonschema_rs.validate(schema, json.loads(o.text))
    # The same seeded request alone gives the same text: preemption did not change its course.
    (alone,) = small.generate(
        [prompt],
        SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=1.0, seed=3, grammar=json_schema_grammar(schema)),
    )
    assert [o.text for o in alone.outputs] == [o.text for o in outs[3].outputs]


def test_compiles_are_cached_and_bad_grammars_are_rejected(llm: LLM) -> None:
    grammar = json_schema_grammar(
        {"type": "object", "properties": {"cached": {"type": "boolean"}}, "required": ["cached"]}
    )
    before = llm.engine.grammars.num_compiled
    llm.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=20, grammar=grammar))
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, grammar=grammar))
    assert llm.engine.grammars.num_compiled == before + 1
    stats = llm.engine.stats()  # what the metrics read
    assert stats.constrained_requests >= 3 and stats.grammar_compiles == llm.engine.grammars.num_compiled
    assert stats.grammar_mask_steps > 0 and 0 < len(stats.grammar_mask_seconds) <= stats.grammar_mask_steps
    with pytest.raises(ValueError, match=r"(?s)grammar: .*unclosed character class"):
        llm.generate([[5, 6]], SamplingParams(grammar=regex_grammar("[ab")))


def test_sampler_masks_only_constrained_rows() -> None:
    vocab = 100
    logits = torch.randn(3, vocab)
    logits[:, 7] = 50.0  # everyone's favourite, but row 1 may only say 3 or 64
    mask = torch.zeros(bitmask_words(vocab), dtype=torch.int32)
    mask[0] |= 1 << 3
    mask[2] |= 1 << 0
    assert (~banned_tokens(mask.unsqueeze(0), vocab))[0].nonzero().flatten().tolist() == [3, 64]
    rows = [
        SampleRow(SamplingParams(temperature=t), [1], [], None, [2], mask if i == 1 else None)
        for i, t in enumerate((0.0, 0.0, 1.0))
    ]
    for _ in range(20):
        picked = [s.token_id for s in Sampler()(logits, rows)]
        assert picked[0] == 7 and picked[1] in (3, 64) and picked[2] == 7
    rows[1] = SampleRow(SamplingParams(temperature=1.0, logprobs=2), [1], [], None, [2], mask)
    out = Sampler()(logits, rows)[1]
    assert out.token_id in (3, 64) and out.logprob is not None
    assert {t for t, _ in out.logprob.top} == {3, 64}
    # Every row constrained (the in-place path), with logits wider than the mask's vocabulary.
    wide = torch.randn(2, vocab + 40)
    wide[:, vocab + 5] = 99.0  # past the grammar's vocabulary: never allowed
    both = [SampleRow(SamplingParams(temperature=0.0), [1], [], None, [2], mask) for _ in range(2)]
    assert [s.token_id for s in Sampler()(wide, both)] == [int(wide[i, [3, 64]].argmax()) * 61 + 3 for i in range(2)]


@pytest.mark.parametrize("vocab", [33, 100, 49150, 49152])
def test_banned_tokens_are_exactly_the_unset_bits(vocab: int) -> None:
    masks = torch.randint(-(2**31), 2**31 - 1, (5, bitmask_words(vocab)), dtype=torch.int32)
    token = np.arange(vocab)
    unset = (masks.numpy()[:, token // 32] >> (token % 32)) & 1 == 0  # bit i of word w is token 32w + i
    assert np.array_equal(banned_tokens(masks, vocab).numpy(), unset)
