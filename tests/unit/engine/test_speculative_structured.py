"""Speculative decoding for grammar-constrained requests: guesses are cut at
the first token the grammar refuses, every verified position is sampled with
the grammar's mask at that point, and the matcher is rolled back so that only
the tokens kept advance it (stoker/engine/structured.py check_drafts,
Scheduler._drafts, runner.verification_rows).

On a tiny random-weight model, whose constrained outputs fall into loops (and
whose prompts here contain the text to copy), so n-gram guesses are both kept
and refused: outputs must equal decoding without speculation token for token,
and still validate."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jsonschema_rs
import pytest
import torch
from tiny_models import make_tiny_hf_model

from stoker import LLM, SamplingParams
from stoker.engine.grammar_compiler import GrammarCompiler
from stoker.engine.grammars import choice_grammar, json_schema_grammar, regex_grammar
from stoker.engine.outputs import ScheduledRequest
from stoker.engine.params import EngineCoreRequest, FinishReason
from stoker.engine.runner import verification_rows
from stoker.engine.sampler import SampleRow
from stoker.engine.structured import SequenceGrammar, banned_tokens, bitmask_words

ANIMALS = {
    "type": "array",
    "items": {"enum": ["cat", "dog", "bird"]},
    "minItems": 4,
    "maxItems": 10,
}
PAIRS = r"(x[0-9]y[0-9]){2,8}"
CHOICES = ["red green blue red green blue", "blue green red", "green"]

# (grammar, text the prompt repeats, check of the output text)
CASES: list[tuple[str, str, Callable[[str], bool]]] = [
    (
        json_schema_grammar(ANIMALS),
        '["cat", "dog", "cat", "dog", "cat", "dog"]',
        lambda t: jsonschema_rs.is_valid(ANIMALS, json.loads(t)),
    ),
    (regex_grammar(PAIRS), "x7y8x7y8x7y8x7y8", lambda t: re.fullmatch(PAIRS, t) is not None),
    (choice_grammar(CHOICES), "red green blue red green blue", lambda t: t in CHOICES),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("spec-structured"))


def _llm(path: Path, method: str, **args: object) -> LLM:
    settings: dict[str, object] = {"dtype": "float32", "num_kv_blocks": 128, "block_size": 8}
    settings.update(args)
    return LLM(str(path), speculative_method=method, num_speculative_tokens=4, **settings)


@pytest.fixture(scope="module")
def base(tiny: Path) -> LLM:
    return _llm(tiny, "none")


@pytest.fixture(scope="module")
def ngram(tiny: Path) -> LLM:
    return _llm(tiny, "ngram")


def _batch(llm: LLM, count: int, temperature: float = 0.0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Constrained requests (each case in turn, prompts that repeat its text
    after some noise) and, every fourth, an unconstrained one beside them."""
    g = torch.Generator().manual_seed(3)
    prompts, params = [], []
    for i in range(count):
        noise = torch.randint(10, 49000, (i % 5,), generator=g).tolist()
        if i % 4 == 3:
            prompts.append(noise + torch.randint(10, 49000, (6,), generator=g).tolist() * 3)
            params.append(SamplingParams(max_tokens=30, temperature=temperature, seed=i, ignore_eos=True))
            continue
        grammar, text, _ = CASES[i % len(CASES)]
        prompts.append(noise + llm.tokenizer.encode(text))
        params.append(SamplingParams(max_tokens=60, temperature=temperature, seed=i, grammar=grammar))
    return prompts, params


def _check_valid(params: list[SamplingParams], outs: list) -> None:
    for p, out in zip(params, outs):
        if p.grammar is None:
            continue
        o = out.outputs[0]
        check = next(c for g, _, c in CASES if g == p.grammar)
        assert o.finish_reason == FinishReason.STOP and check(o.text), (o.text, o.finish_reason)


# ------------------------------------------------------------- the grammar walk


def _compiler(llm: LLM) -> GrammarCompiler:
    return llm.engine.grammars


def _fresh_masks(llm: LLM, grammar: str, prefix: list[int], upto: int) -> list[torch.Tensor]:
    """The masks a matcher gives after prefix + each of the next tokens, one at a time."""
    g = SequenceGrammar(_compiler(llm).matcher(grammar), llm.engine.model_config.vocab_size, llm.tokenizer.eos_token_id)
    masks = [g.next_bitmask()]
    for token in prefix[:upto]:
        g.accept(token)
        masks.append(g.next_bitmask())
    return masks


def _sequence_grammar(llm: LLM, grammar: str) -> SequenceGrammar:
    vocab = llm.engine.model_config.vocab_size
    return SequenceGrammar(_compiler(llm).matcher(grammar), vocab, llm.tokenizer.eos_token_id)


def test_check_drafts_cuts_at_the_first_refused_guess_and_rolls_back(base: LLM) -> None:
    tok = base.tokenizer
    grammar = regex_grammar(PAIRS)
    seq = _sequence_grammar(base, grammar)
    seq.accept(tok.encode("x")[0])
    good = tok.encode("1y2x3")
    bad = tok.encode("zz")
    checked = seq.check_drafts(good + bad + good, frozenset())
    assert checked.token_ids == good
    # One mask per sampled position, each the grammar's mask at that point.
    expected = _fresh_masks(base, grammar, tok.encode("x") + good, 1 + len(good))[1:]
    assert len(checked.bitmasks) == len(good) + 1
    for got, want in zip(checked.bitmasks, expected):
        assert torch.equal(got, want)
    assert not torch.equal(checked.bitmasks[0], checked.bitmasks[1])  # the masks really differ by position
    # Rolled back: the matcher is where it was, and takes the same tokens again.
    assert torch.equal(seq.next_bitmask(), expected[0])
    for token in good:
        seq.accept(token)
    assert seq.error is None


def test_check_drafts_never_guesses_past_the_grammars_end_or_an_eos(base: LLM) -> None:
    tok = base.tokenizer
    eos = tok.eos_token_id
    assert eos is not None
    choice = _sequence_grammar(base, choice_grammar(["green"]))
    green = tok.encode("green")
    checked = choice.check_drafts(green + green + [eos], frozenset({eos}))
    assert checked.token_ids == green  # the grammar is complete after it: nothing may follow
    ends = ~banned_tokens(checked.bitmasks[-1].unsqueeze(0), base.engine.model_config.vocab_size)[0]
    assert ends.nonzero().flatten().tolist() == [eos]
    assert not choice.done  # rolled back
    # An accepting grammar that could go on: an eos guess is still cut (the target samples it itself).
    letters = _sequence_grammar(base, regex_grammar("a+"))
    a = tok.encode("a")
    assert letters.check_drafts(a * 2 + [eos] + a, frozenset({eos})).token_ids == a * 2
    assert letters.check_drafts([eos], frozenset({eos})).token_ids == []
    for token in a * 3 + [eos]:
        letters.accept(token)
    assert letters.done and letters.error is None


def test_verification_rows_mask_each_position_with_its_own_bitmask() -> None:
    words = bitmask_words(64)
    masks = [torch.full((words,), 1 << i, dtype=torch.int32) for i in range(3)]
    first = SampleRow(SamplingParams(temperature=0.0), [1], [], None, [2], masks[0])
    scheduled = ScheduledRequest(("r", 0), [5, 6, 7], 4, [0], first, num_draft_tokens=2, draft_bitmasks=masks[1:])
    rows = verification_rows(scheduled)
    assert [r.token_bitmask for r in rows] == masks
    assert [r.output_token_ids for r in rows] == [[], [6], [6, 7]]
    with pytest.raises(ValueError, match="bitmasks"):
        verification_rows(ScheduledRequest(("r", 0), [5, 6, 7], 4, [0], first, num_draft_tokens=2))


# ------------------------------------------------------------- engine: exact


def test_greedy_constrained_identical_with_and_without_speculation(base: LLM, ngram: LLM) -> None:
    """Three grammars (JSON schema, regex, a choice that ends), batched with
    unconstrained requests. Sampling a draft position with another position's
    mask would give other tokens here (or tokens the grammar refuses)."""
    prompts, params = _batch(base, 12)
    expected = base.generate(prompts, params)
    drafted_before = ngram.engine.stats().spec_draft_tokens
    outs = ngram.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    _check_valid(params, outs)
    constrained = [o.outputs[0] for o, p in zip(outs, params) if p.grammar is not None]
    assert sum(o.num_draft_tokens for o in constrained) > 0, "no constrained request speculated"
    accepted = sum(o.num_accepted_draft_tokens for o in constrained)
    assert 0 < accepted < sum(o.num_draft_tokens for o in constrained)
    # Every grammar kind speculated and kept some guesses.
    for grammar, _, _ in CASES:
        assert any(o.num_accepted_draft_tokens for o, p in zip(constrained, params) if p.grammar == grammar), grammar
    assert ngram.engine.stats().spec_draft_tokens > drafted_before


def test_seeded_sampling_constrained_identical(base: LLM, ngram: LLM) -> None:
    """temperature > 0: each position samples the constrained target's
    distribution with the uniform it would draw without speculation."""
    prompts, params = _batch(base, 8, temperature=0.7)
    expected = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    outs = ngram.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    _check_valid(params, outs)
    assert sum(o.outputs[0].num_accepted_draft_tokens for o, p in zip(outs, params) if p.grammar) > 0


def test_matcher_state_after_rejections_and_preemption_is_the_kept_tokens(tiny: Path, base: LLM) -> None:
    """Step by step, through a cache small enough to preempt: every running
    constrained sequence's matcher gives the mask a fresh matcher fed its
    output tokens gives, so rolled-back guesses left nothing behind; and the
    outputs are those of decoding without speculation."""
    small = _llm(tiny, "ngram", num_kv_blocks=20, max_num_batched_tokens=64)
    core = small.engine
    prompts, params = _batch(small, 8)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(EngineCoreRequest(f"m{i}", p, sp, 0.0))
    outputs: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for delta in core.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        for r in core.scheduler.running:
            if r.grammar is not None:
                fresh = _sequence_grammar(small, r.params.grammar or "")
                for token in r.output_token_ids:
                    fresh.accept(token)
                assert torch.equal(r.grammar.next_bitmask(), fresh.next_bitmask()), r.output_token_ids
    stats = core.stats()
    assert stats.spec_accepted_tokens > 0 and core.scheduler.num_preemptions > 0
    assert core.kv.num_used_blocks == 0
    expected = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    assert [outputs[f"m{i}"] for i in range(len(prompts))] == expected


def test_draft_model_constrained_identical(tiny: Path, base: LLM) -> None:
    """A draft model guesses greedily without the grammar and the grammar cuts
    its guesses. The grammar here admits what the model says unconstrained
    (or another ending), so the draft (the same model) is mostly right up to
    the grammar's end, and must never guess past it."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, 49000, (8,), generator=g).tolist() for _ in range(4)]
    free = base.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    params = [
        SamplingParams(
            max_tokens=40, temperature=0, grammar=choice_grammar([o.outputs[0].text, o.outputs[0].text[:8] + "zz"])
        )
        for o in free
    ]
    expected = base.generate(prompts, params)
    spec = _llm(tiny, "draft", speculative_model=str(tiny))
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert all(o.outputs[0].finish_reason == FinishReason.STOP for o in outs)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in free]
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in outs) > 0
    proposer = spec.engine.speculator.proposer  # type: ignore[union-attr]
    assert proposer._sequences == {} and proposer.kv.num_used_blocks == 0  # type: ignore[attr-defined]
