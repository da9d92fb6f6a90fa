"""Thinking kept apart from the answer in the engine (SamplingParams.reasoning,
stoker/engine/reasoning.py), on a tiny random-weight model. The thinking is
produced deterministically, never mocked: a token greedy decoding emits at
position k is named the end marker, so the thinking ends there by itself; a
marker greedy never emits with a budget, so the engine must force it at
exactly that token. Texts are checked against the tokenizer's own decode of
the phases' tokens; speculation against decoding without it."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema_rs
import msgspec
import pytest
import torch
from tiny_models import make_tiny_hf_model

from stoker import LLM, SamplingParams
from stoker.engine.grammars import json_schema_grammar
from stoker.engine.params import CompletionOutput, EngineCoreRequest, FinishReason, ReasoningParams
from stoker.engine.reasoning import Phase, ReasoningState
from stoker.engine.structured import allows

SCHEMA: dict = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
VOCAB = 49152


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("reasoning"))


def _llm(path: Path, method: str, **args: object) -> LLM:
    settings: dict[str, object] = {"dtype": "float32", "num_kv_blocks": 128, "block_size": 8}
    settings.update(args)
    return LLM(str(path), speculative_method=method, num_speculative_tokens=4, **settings)


@pytest.fixture(scope="module")
def base(tiny: Path) -> LLM:
    return _llm(tiny, "none")


@pytest.fixture(scope="module")
def ngram(tiny: Path) -> LLM:
    """Speculating, and with too few KV blocks for the batch, so it also preempts."""
    return _llm(tiny, "ngram", num_kv_blocks=24)


def _prompts(count: int) -> list[list[int]]:
    """Prompts that repeat a phrase (the n-gram proposer then guesses well) and plain ones."""
    g = torch.Generator().manual_seed(7)
    prompts = []
    for i in range(count):
        phrase = torch.randint(10, 49000, (3 + i % 4,), generator=g).tolist()
        noise = torch.randint(10, 49000, (i % 5,), generator=g).tolist()
        prompts.append(noise + phrase * (1 + i % 3))
    return prompts


def _greedy(llm: LLM, prompt: list[int], max_tokens: int = 24, **args: object) -> CompletionOutput:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **args)  # type: ignore[arg-type]
    return llm.generate([prompt], params)[0].outputs[0]


def _fresh_position(tokens: list[int], lowest: int = 3) -> int:
    """A position k >= lowest whose token did not come before: named the end
    marker, it ends the thinking exactly at k."""
    return next(k for k in range(lowest, len(tokens)) if tokens[k] not in tokens[:k])


def _unused_token(llm: LLM, tokens: list[int]) -> int:
    """An ordinary word the output never holds: a marker only the engine can write."""
    return next(t for t in llm.tokenizer.encode(" marker zebra quartz") if t not in tokens)


def _decode(llm: LLM, ids: list[int]) -> str:
    return llm.tokenizer.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- the phases


def test_thinking_ends_where_the_end_marker_comes_and_the_tokens_are_greedys(base: LLM) -> None:
    prompt = _prompts(1)[0]
    plain = _greedy(base, prompt)
    k = _fresh_position(plain.token_ids)
    out = _greedy(base, prompt, reasoning=ReasoningParams((plain.token_ids[k],), thinking_open=True))
    assert out.token_ids == plain.token_ids  # no mask while thinking, none after it without a grammar
    assert out.num_reasoning_tokens == k + 1  # the end marker counts
    assert out.reasoning_text == _decode(base, plain.token_ids[:k])
    assert out.text == _decode(base, plain.token_ids[k + 1 :])


def test_start_marker_opens_thinking_only_as_the_first_token(base: LLM) -> None:
    prompt = _prompts(2)[1]
    plain = _greedy(base, prompt)
    k = _fresh_position(plain.token_ids)
    first, end = plain.token_ids[0], plain.token_ids[k]
    out = _greedy(base, prompt, reasoning=ReasoningParams((end,), start_token_ids=(first,)))
    assert out.token_ids == plain.token_ids
    assert out.num_reasoning_tokens == k + 1  # start marker, thinking, end marker
    assert out.reasoning_text == _decode(base, plain.token_ids[1:k])
    assert out.text == _decode(base, plain.token_ids[k + 1 :])
    # Another first token: no thinking at all, every token is the answer's.
    other = _unused_token(base, plain.token_ids)
    out = _greedy(base, prompt, reasoning=ReasoningParams((end,), start_token_ids=(other,)))
    assert (out.token_ids, out.text, out.reasoning_text, out.num_reasoning_tokens) == (
        plain.token_ids,
        plain.text,
        "",
        0,
    )


@pytest.mark.parametrize("budget", [0, 1, 6])
def test_budget_forces_the_end_marker_at_exactly_the_budget(base: LLM, budget: int) -> None:
    prompt = _prompts(3)[2]
    plain = _greedy(base, prompt)
    end = _unused_token(base, plain.token_ids)
    out = _greedy(base, prompt, 30, logprobs=0, reasoning=ReasoningParams((end,), thinking_open=True, budget=budget))
    assert out.token_ids[:budget] == plain.token_ids[:budget]
    assert out.token_ids[budget] == end
    assert out.logprobs is not None and out.logprobs[budget].logprob == 0.0  # the only token the mask allows
    assert out.num_reasoning_tokens == budget + 1
    assert out.reasoning_text == _decode(base, plain.token_ids[:budget])
    # The answer goes on as the model continues after the marker; max_tokens bounds both.
    assert len(out.token_ids) == 30
    after = _greedy(base, prompt + out.token_ids[: budget + 1], 30 - budget - 1)
    assert out.token_ids[budget + 1 :] == after.token_ids
    assert out.text == _decode(base, after.token_ids)


def test_budget_forces_the_rest_of_a_multi_token_end_marker(base: LLM) -> None:
    prompt = _prompts(4)[3]
    plain = _greedy(base, prompt)
    end = tuple(t for t in base.tokenizer.encode(" marker zebra quartz") if t not in plain.token_ids)[:2]
    out = _greedy(base, prompt, 20, reasoning=ReasoningParams(end, thinking_open=True, budget=4))
    assert out.token_ids[:4] == plain.token_ids[:4] and tuple(out.token_ids[4:6]) == end
    assert out.num_reasoning_tokens == 6
    assert out.reasoning_text == _decode(base, plain.token_ids[:4])
    assert out.text == _decode(base, out.token_ids[6:])


def test_forced_start_marker_then_budget(base: LLM) -> None:
    """A first token equal to the start marker's first commits to the marker:
    its rest is forced; then the budget counts from after it."""
    prompt = _prompts(5)[4]
    plain = _greedy(base, prompt)
    start = (plain.token_ids[0], _unused_token(base, plain.token_ids))
    end = tuple(t for t in base.tokenizer.encode(" quartz zebra marker") if t not in plain.token_ids + [start[1]])[:1]
    out = _greedy(base, prompt, 16, reasoning=ReasoningParams(end, start_token_ids=start, budget=3))
    assert out.token_ids[:2] == list(start)
    assert out.token_ids[5] == end[0]
    assert out.num_reasoning_tokens == 2 + 3 + 1
    assert out.reasoning_text == _decode(base, out.token_ids[2:5])
    assert out.text == _decode(base, out.token_ids[6:])


# ----------------------------------------------------- answer-only controls


def test_grammar_constrains_the_answer_and_not_the_thinking(base: LLM) -> None:
    grammar = json_schema_grammar(SCHEMA)
    prompts = _prompts(4)
    budgets = [2, 6, 3, 5]
    ends = [
        _unused_token(base, o.outputs[0].token_ids)
        for o in base.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    ]
    params = [
        SamplingParams(
            max_tokens=60,
            temperature=0.0 if i % 2 else 1.0,
            seed=i,
            grammar=grammar,
            reasoning=ReasoningParams((end,), thinking_open=True, budget=budget),
        )
        for i, (end, budget) in enumerate(zip(ends, budgets))
    ]
    free = base.generate(
        prompts, [SamplingParams(**{**p.__dict__, "grammar": None, "reasoning": None}) for p in params]
    )
    for out, plain, budget in zip(base.generate(prompts, params), free, budgets):
        o = out.outputs[0]
        # The thinking is what the model says unconstrained; the answer validates.
        assert o.token_ids[:budget] == plain.outputs[0].token_ids[:budget]
        assert o.finish_reason == FinishReason.STOP, o.text
        assert jsonschema_rs.is_valid(SCHEMA, json.loads(o.text)), o.text
        assert o.reasoning_text == _decode(base, o.token_ids[:budget])


def test_grammar_after_a_thinking_that_ends_by_itself(base: LLM) -> None:
    prompt = _prompts(6)[5]
    plain = _greedy(base, prompt)
    k = _fresh_position(plain.token_ids)
    out = _greedy(
        base,
        prompt,
        60,
        grammar=json_schema_grammar(SCHEMA),
        reasoning=ReasoningParams((plain.token_ids[k],), thinking_open=True),
    )
    assert out.token_ids[: k + 1] == plain.token_ids[: k + 1]
    assert jsonschema_rs.is_valid(SCHEMA, json.loads(out.text)), out.text


def test_awaiting_with_a_grammar_allows_the_start_marker_or_the_answer(base: LLM) -> None:
    prompt = _prompts(7)[6]
    grammar = json_schema_grammar(SCHEMA)
    start = _unused_token(base, [])
    end = next(t for t in base.tokenizer.encode(" quartz zebra") if t != start)
    # Pushed towards the start marker, the reply thinks and the answer still validates.
    out = _greedy(
        base,
        prompt,
        60,
        grammar=grammar,
        logit_bias={start: 100.0},
        reasoning=ReasoningParams((end,), start_token_ids=(start,), budget=3),
    )
    assert out.token_ids[0] == start and out.token_ids[4] == end
    assert jsonschema_rs.is_valid(SCHEMA, json.loads(out.text)), out.text
    # Pushed away from it, the first token is the grammar's and there is no thinking.
    out = _greedy(
        base,
        prompt,
        60,
        grammar=grammar,
        logit_bias={start: -100.0},
        reasoning=ReasoningParams((end,), start_token_ids=(start,), budget=3),
    )
    assert out.num_reasoning_tokens == 0 and out.reasoning_text == ""
    assert jsonschema_rs.is_valid(SCHEMA, json.loads(out.text)), out.text


def test_stop_strings_apply_to_the_answer_only(base: LLM) -> None:
    prompt = _prompts(1)[0]
    plain = _greedy(base, prompt)
    k = _fresh_position(plain.token_ids, 8)
    reasoning = ReasoningParams((plain.token_ids[k],), thinking_open=True)
    both = _greedy(base, prompt, reasoning=reasoning)
    in_thinking = next(w for w in both.reasoning_text.split() if w not in both.text)
    out = _greedy(base, prompt, stop=[in_thinking], reasoning=reasoning)
    assert (out.token_ids, out.text, out.reasoning_text) == (both.token_ids, both.text, both.reasoning_text)
    assert out.finish_reason == FinishReason.LENGTH
    in_answer = both.text.split()[2]
    out = _greedy(base, prompt, stop=[in_answer], reasoning=reasoning)
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == in_answer
    assert out.text == both.text[: both.text.index(in_answer)]
    assert out.reasoning_text == both.reasoning_text


def test_stop_token_ends_the_sequence_while_thinking(base: LLM) -> None:
    prompt = _prompts(2)[1]
    plain = _greedy(base, prompt)
    k = _fresh_position(plain.token_ids, 6)
    j = _fresh_position(plain.token_ids, 2)
    assert j < k
    out = _greedy(
        base,
        prompt,
        stop_token_ids=[plain.token_ids[j]],
        reasoning=ReasoningParams((plain.token_ids[k],), thinking_open=True),
    )
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == plain.token_ids[j]
    assert out.token_ids == plain.token_ids[: j + 1] and out.text == ""
    assert out.reasoning_text == _decode(base, plain.token_ids[: j + 1])


def test_a_partial_end_marker_is_thinking_when_the_sequence_ends_on_it(base: LLM) -> None:
    prompt = _prompts(3)[2]
    plain = _greedy(base, prompt, 12)
    end = (plain.token_ids[-1], _unused_token(base, plain.token_ids))  # only its first token comes
    out = _greedy(base, prompt, 12, reasoning=ReasoningParams(end, thinking_open=True))
    assert out.reasoning_text == plain.text and out.num_reasoning_tokens == 12 and out.text == ""


# -------------------------------------------- samples, speculation, preemption


def test_n_samples_each_think_apart_as_their_own_seed(base: LLM) -> None:
    prompt = _prompts(4)[3]
    end = _unused_token(base, [])
    reasoning = ReasoningParams((end,), thinking_open=True, budget=5)
    args = {"max_tokens": 20, "temperature": 1.0, "reasoning": reasoning}
    many = base.generate([prompt], SamplingParams(n=2, seed=40, **args))[0].outputs  # type: ignore[arg-type]
    for i, o in enumerate(many):
        one = base.generate([prompt], SamplingParams(seed=40 + i, **args))[0].outputs[0]  # type: ignore[arg-type]
        assert (o.token_ids, o.text, o.reasoning_text) == (one.token_ids, one.text, one.reasoning_text)
        assert o.token_ids[5] == end and o.num_reasoning_tokens == 6
        assert o.reasoning_text == _decode(base, o.token_ids[:5]) and o.text == _decode(base, o.token_ids[6:])


@pytest.fixture(scope="module")
def mixed(base: LLM) -> tuple[list[list[int]], list[SamplingParams], list[CompletionOutput]]:
    """Reasoning requests that end by themselves, by budget, with a grammar
    after the thinking, sampled and greedy, beside plain ones; and what the
    engine without speculation gives them."""
    prompts = _prompts(12)
    grammar = json_schema_grammar(SCHEMA)
    params = []
    greedy = base.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for i, plain_out in enumerate(greedy):
        plain = plain_out.outputs[0].token_ids
        end = plain[_fresh_position(plain)] if i % 2 else _unused_token(base, plain)
        reasoning = ReasoningParams((end,), thinking_open=True, budget=None if i % 2 else 3 + i % 7)
        params.append(
            SamplingParams(
                max_tokens=32,
                temperature=0.0 if i % 3 else 0.8,
                seed=i,
                ignore_eos=True,
                grammar=grammar if i % 4 == 1 else None,
                reasoning=None if i % 5 == 4 else reasoning,
            )
        )
    return prompts, params, [o.outputs[0] for o in base.generate(prompts, params)]


def test_speculation_and_preemption_give_the_same_tokens_across_markers_and_budgets(
    ngram: LLM, mixed: tuple[list[list[int]], list[SamplingParams], list[CompletionOutput]]
) -> None:
    prompts, params, want = mixed
    got = ngram.generate(prompts, params)
    for x, b in zip(want, got):
        y = b.outputs[0]
        assert (x.token_ids, x.text, x.reasoning_text, x.num_reasoning_tokens) == (
            y.token_ids,
            y.text,
            y.reasoning_text,
            y.num_reasoning_tokens,
        )
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in got) > 0
    assert ngram.engine.scheduler.num_preemptions > 0  # recomputed sequences kept their phase


# --------------------------------------------------------- the state machine


def test_end_marker_matching_holds_overlapping_prefixes() -> None:
    state = ReasoningState(ReasoningParams((5, 5, 6), thinking_open=True), VOCAB)
    routed = [state.accept(t) for t in (1, 5, 5, 5, 6, 7)]
    assert [r.thinking for r in routed[:5]] == [[1], [], [], [5], []]
    assert routed[4].thinking_ended and state.phase is Phase.ANSWER and routed[5].answer == [7]
    assert state.num_tokens == 5


def test_drafts_stop_before_a_forced_token_or_a_constrained_answer() -> None:
    state = ReasoningState(ReasoningParams((9,), thinking_open=True, budget=4), VOCAB)
    state.accept(1)
    assert state.drafts_within_phase([2, 3, 4, 5], constrained=False) == 2  # the 4th thinking token is the last free
    assert state.drafts_within_phase([2, 9, 4], constrained=False) == 3  # unconstrained answer: nothing to mask
    assert state.drafts_within_phase([2, 9, 4], constrained=True) == 1  # the marker is sampled, not guessed
    assert state.num_budgeted == 1  # the walk changed nothing
    for t in (2, 3, 4):
        state.accept(t)
    mask = state.step_bitmask(None)
    assert mask is not None and allows(mask, 9) and int(mask.bool().sum()) == 1
    assert not state.may_draft


def test_bad_reasoning_params_are_refused(base: LLM) -> None:
    for bad in ({"end_token_ids": ()}, {"end_token_ids": (1,), "budget": -1}, {"end_token_ids": (-3,)}):
        with pytest.raises(ValueError, match="reasoning"):
            ReasoningParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reasoning marker"):
        _greedy(base, [5, 6], reasoning=ReasoningParams((VOCAB,)))


def test_reasoning_params_cross_the_process_boundary() -> None:
    params = SamplingParams(reasoning=ReasoningParams((7, 8), start_token_ids=(6,), budget=3))
    request = EngineCoreRequest("r", [1, 2], params, 0.0)
    decoded = msgspec.msgpack.Decoder(EngineCoreRequest).decode(msgspec.msgpack.Encoder().encode(request))
    assert decoded.sampling_params.reasoning == params.reasoning
    bad = msgspec.msgpack.Encoder().encode(
        {**msgspec.to_builtins(request), "sampling_params": {"reasoning": {"end_token_ids": []}}}
    )
    with pytest.raises(msgspec.ValidationError, match="end_token_ids"):
        msgspec.msgpack.Decoder(EngineCoreRequest).decode(bad)
