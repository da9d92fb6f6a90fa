"""Speculative decoding (stoker/engine/spec/): n-gram proposals verified in the
ordinary step. On tiny random-weight models, which fall into loops that the
n-gram proposer then predicts, so drafts are both accepted and rejected:
outputs must equal decoding without speculation token for token (greedy and
seeded sampling, logprobs, penalties, stops), batched, with preemption, on
the dense torch path and the fused quantized decoder; block tables and the
prefix cache stay consistent after rejections; cancelling frees everything."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from conftest import cache_sharing_kernels
from tiny_models import make_tiny_hf_model

from stoker import LLM, SamplingParams
from stoker.config import EngineConfig
from stoker.engine.core import EngineCore
from stoker.engine.params import EngineCoreRequest
from stoker.engine.runner import accept, verification_rows
from stoker.engine.sampler import Sampler, SampleRow
from stoker.engine.spec.ngram import NgramProposer
from stoker.engine.spec.policy import SpeculationPolicy

NUM_PROMPTS = 24


def random_prompts(vocab: int, count: int = NUM_PROMPTS) -> list[list[int]]:
    """Prompts that repeat a phrase (what a copy/quote request looks like) and plain random ones."""
    g = torch.Generator().manual_seed(11)
    prompts = []
    for i in range(count):
        phrase = torch.randint(3, vocab, (3 + i % 5,), generator=g).tolist()
        noise = torch.randint(3, vocab, (i % 7,), generator=g).tolist()
        prompts.append(noise + phrase * (2 + i % 4) if i % 3 else noise + phrase)
    return prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("spec"))


def _llm(path: Path, method: str, **args: object) -> LLM:
    settings: dict[str, object] = {"dtype": "float32", "num_kv_blocks": 128, "block_size": 8}
    settings.update(args)
    return LLM(str(path), speculative_method=method, num_speculative_tokens=4, **settings)


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _assert_speculated(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens > 0, "no drafts were verified: the test exercised nothing"
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, (
        f"want both accepted and rejected drafts, got {stats.spec_accepted_tokens}/{stats.spec_draft_tokens}"
    )


# ------------------------------------------------------------------ proposer


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    proposer = NgramProposer(min_n=2, max_n=3)
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    # [1, 2, 3] last occurred before position 8: 5, 6 followed it, then 1, 2.
    assert proposer.propose_one(("a", 0), tokens, 4) == [5, 6, 1, 2]
    assert proposer.propose_one(("a", 0), tokens, 1) == [5]
    # Incremental: one more token, the index catches up without a rebuild.
    tokens.append(5)
    assert proposer.propose_one(("a", 0), tokens, 3) == [6, 1, 2]
    assert proposer.propose_one(("b", 0), [7, 8, 9], 4) == []
    assert proposer.propose_one(("a", 0), tokens, 0) == []


def test_ngram_prefers_the_longest_match() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    # 1-gram [3] last followed by 7; the 3-gram [1, 2, 3] by 4.
    tokens = [1, 2, 3, 4, 0, 3, 7, 1, 2, 3]
    assert proposer.propose_one(("a", 0), tokens, 1) == [4]
    proposer.forget(("a", 0))
    assert proposer._indexes == {}
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(min_n=3, max_n=2)


def test_auto_policy_backs_off_a_sequence_whose_guesses_fail() -> None:
    policy = SpeculationPolicy("auto", num_tokens=4, max_batch=4)
    key = ("r", 0)
    assert policy.step_allows(4) and not policy.step_allows(5)
    assert SpeculationPolicy("ngram", 4, 4).step_allows(64)
    assert policy.num_drafts(key) >= 1
    for _ in range(10):
        if policy.num_drafts(key) == 0:
            break
        policy.record(key, 4, 0)
    paused = [policy.num_drafts(key) for _ in range(8)]
    assert paused == [0] * 8 or paused.count(0) >= 7, paused
    # A sequence whose guesses are always right asks for the most.
    good = ("g", 0)
    for _ in range(10):
        policy.record(good, policy.num_drafts(good), policy.num_drafts(good))
    assert policy.num_drafts(good) == 4


def test_draft_length_follows_acceptance_and_row_costs() -> None:
    from stoker.engine.spec.policy import best_draft_length, row_costs

    measured = [8.8, 10.2, 13.4, 18.0, 23.0]  # ms for 1..5 rows, the default model on Zen 4
    assert best_draft_length(0.3, measured, 4) == 1
    assert best_draft_length(0.8, measured, 4) == 2
    assert best_draft_length(0.95, measured, 4) == 2  # rows 4 and 5 cost more than they are worth here
    assert best_draft_length(0.95, [1.0] * 5, 4) == 4  # free rows: as many as allowed
    assert best_draft_length(0.95, measured, 2) == 2
    calls: list[int] = []
    costs = row_costs(calls.append, 3, repeats=2)
    assert len(costs) == 3 and calls == [1, 2, 3, 1, 2, 3, 1, 2, 3]  # warm-up, then the counts in turn

    def one_row_slow(rows: int) -> None:  # as if something else took the core during the 1-row runs
        time.sleep(0.004 if rows == 1 else 0.0005)

    costs = row_costs(one_row_slow, 3, repeats=2)
    assert costs[0] >= 0.004 and costs[1] == costs[0] and costs[2] == costs[1]  # more rows never cost less
    policy = SpeculationPolicy("auto", num_tokens=4, max_batch=4)
    policy.costs = [1.0, 1.1, 1.2, 1.3, 1.4]  # rows nearly free (a wide machine)
    key = ("r", 0)
    for _ in range(6):
        policy.record(key, 2, 2)  # always right: acceptance -> 1
    assert policy.num_drafts(key) == 4


def test_row_costs_measured_after_construction(tiny: Path) -> None:
    """EngineCore leaves auto's row costs unknown (the engine process measures
    them when first idle after it reports ready, off the path to /ready); LLM
    measures them as soon as it has built its engine."""
    llm = _llm(tiny, "auto")
    spec = llm.engine.speculator
    assert spec is not None
    assert len(spec.policy.costs) == 5 and all(cost > 0 for cost in spec.policy.costs)
    settings = {"speculative_method": "auto", "num_speculative_tokens": 4, "dtype": "float32", "num_kv_blocks": 64}
    core = EngineCore(EngineConfig(model=str(tiny), **settings))
    assert core.speculator is not None and core.speculator.policy.costs == []
    core.measure_row_costs()
    assert len(core.speculator.policy.costs) == 5


# ------------------------------------------------------------- verification


def test_accept_keeps_drafts_up_to_the_first_disagreement() -> None:
    from stoker.engine.sampler import SampledToken

    sampled = [SampledToken(t, None) for t in (5, 6, 9, 4)]
    assert [t.token_id for t in accept(sampled, [5, 6, 7])] == [5, 6, 9]
    assert [t.token_id for t in accept(sampled, [1, 6, 7])] == [5]
    assert [t.token_id for t in accept(sampled, [5, 6, 9])] == [5, 6, 9, 4]


def test_verification_is_exact_rejection_sampling() -> None:
    """The target distribution p over 6 tokens; a fixed draft d. Sampling the
    verification row and keeping d only when the sample is d must give tokens
    distributed as p: P(d) = p(d) (accepted), and the rest in proportion."""
    from stoker.engine.outputs import ScheduledRequest

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -30.0, -30.0]])
    p = torch.softmax(logits[0], dim=-1)
    draft = 5
    counts: Counter[int] = Counter()
    trials = 6000
    sampler = Sampler()
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    batch = 200  # verifications side by side in one sampler call, as the engine batches them
    for _ in range(trials // batch):
        per_request = []
        for _ in range(batch):
            row = SampleRow(params, [1], [], g, [])
            s = ScheduledRequest(("r", 0), [1, draft], 0, [1], row, num_draft_tokens=1)
            per_request.append(verification_rows(s))
        rows = [row for request_rows in per_request for row in request_rows]
        sampled = sampler(logits.expand(len(rows), -1).clone(), rows)
        start = 0
        for request_rows in per_request:
            counts[accept(sampled[start : start + len(request_rows)], [draft])[0].token_id] += 1
            start += len(request_rows)
    observed = torch.tensor([counts[i] for i in range(8)], dtype=torch.float64)
    expected = p.double() * trials
    mask = expected > 5
    chi2 = float((((observed - expected) ** 2) / expected)[mask].sum())
    # 5 degrees of freedom: the 0.999 quantile is 20.5.
    assert chi2 < 20.5, (chi2, observed.tolist(), expected.tolist())
    assert observed[~mask].sum() == 0


# ------------------------------------------------------------ engine: exact


@pytest.mark.parametrize("method", ["ngram", "auto"])
def test_greedy_identical_with_and_without_speculation_batched(tiny: Path, method: str) -> None:
    """auto at a batch of 24 drafts only once at most 4 sequences still decode (the tail)."""
    base = _llm(tiny, "none")
    prompts = random_prompts(base.tokenizer.vocab_size)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = _generate(base, prompts, greedy)
    spec = _llm(tiny, method)
    assert _generate(spec, prompts, greedy) == expected
    # One at a time too (single stream: every step may speculate).
    assert [_generate(spec, [p], greedy)[0] for p in prompts[:6]] == expected[:6]
    _assert_speculated(spec)


def test_seeded_sampling_penalties_and_logprobs_identical(tiny: Path) -> None:
    """Same seed, same tokens: each position draws the uniform it would draw
    without speculation, and the generator is rewound past rejected drafts.
    Low temperatures (still the random path, not greedy) because a random
    model's sampled text repeats too little for n-gram guesses at 1.0."""
    prompts = random_prompts(make_vocab(tiny))[:12]
    params = [
        SamplingParams(
            max_tokens=32,
            temperature=0.05 if i % 2 else 0.1,
            top_p=0.9 if i % 3 == 0 else 1.0,
            top_k=20 if i % 4 == 1 else -1,
            repetition_penalty=1.1 if i % 5 == 2 else 1.0,
            frequency_penalty=0.3 if i % 5 == 3 else 0.0,
            min_tokens=10,
            seed=100 + i,
            logprobs=2,
            ignore_eos=i % 2 == 0,
        )
        for i in range(len(prompts))
    ]
    outs = {}
    for method in ("none", "ngram"):
        llm = _llm(tiny, method)
        outs[method] = llm.generate(prompts, params)
        if method == "ngram":
            assert llm.engine.stats().spec_draft_tokens > 0
    for a, b in zip(outs["none"], outs["ngram"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert la is not None and lb is not None and len(la) == len(lb)
        for x, y in zip(la, lb):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def make_vocab(path: Path) -> int:
    """The tiny model's vocabulary size, read from its config (no engine built for it)."""
    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def test_stops_and_max_tokens_hold_inside_an_accepted_run(tiny: Path) -> None:
    base, spec = _llm(tiny, "none"), _llm(tiny, "ngram")
    prompts = random_prompts(base.tokenizer.vocab_size)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = _generate(base, prompts, greedy)
    # Stop on a token the loop repeats, and cut at odd lengths: both land inside accepted runs.
    for i, tokens in enumerate(full[:10]):
        stop_token = tokens[len(tokens) // 2]
        params = SamplingParams(max_tokens=7 + i, temperature=0, stop_token_ids=[stop_token], ignore_eos=True)
        a = base.generate([prompts[i]], params)[0].outputs[0]
        b = spec.generate([prompts[i]], params)[0].outputs[0]
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert len(b.token_ids) <= 7 + i


def test_quantized_fused_decoder_greedy_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.models.quant import kernels

    if kernels._library("portable") is None:
        pytest.skip("no C compiler")
    from quant_models import T, write_quant_gguf

    monkeypatch.setenv("STOKER_CACHE_DIR", cache_sharing_kernels(tmp_path / "cache"))
    path = write_quant_gguf(tmp_path / "tiny-q8.gguf", "qwen2", {}, T.Q8_0)
    base = _llm(path, "none", quantization="auto")
    assert base.engine.runner.model.fused is not None
    prompts = random_prompts(base.engine.model_config.vocab_size, 16)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    expected = _generate(base, prompts, greedy)
    spec = _llm(path, "ngram", quantization="auto")
    assert _generate(spec, prompts, greedy) == expected
    _assert_speculated(spec)


# ------------------------------------------------- engine: cache and lifecycle


def _check_consistent(llm: LLM) -> None:
    """Every running sequence: computed KV never past its tokens, hashed blocks
    keyed by exactly its tokens, chained from the first block."""
    kv = llm.engine.kv
    for r in llm.engine.scheduler.running:
        assert r.num_computed_tokens <= r.num_tokens
        blocks = kv.req_blocks.get(r.key, [])
        parent = None
        for i in range(kv.num_hashed.get(r.key, 0)):
            block = blocks[i]
            assert (i + 1) * kv.block_size <= r.num_computed_tokens
            assert block.token_ids == tuple(r.token_ids[i * kv.block_size : (i + 1) * kv.block_size])
            assert block.parent_hash == parent
            parent = block.block_hash


def test_block_tables_and_prefix_cache_consistent_after_rejections(tiny: Path) -> None:
    spec = _llm(tiny, "ngram", block_size=4)
    prompts = random_prompts(spec.tokenizer.vocab_size, 8)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    core = spec.engine
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", p, greedy, 0.0))
    outputs: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for delta in core.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        _check_consistent(spec)
    _assert_speculated(spec)
    assert core.kv.num_used_blocks == 0
    # The prefix cache now holds these sequences' blocks: prompts + outputs as new
    # prompts must hit it and still continue exactly as a cold engine does.
    continued = [p + outputs[f"r{i}"] for i, p in enumerate(prompts)]
    cold = _generate(_llm(tiny, "none", block_size=4, enable_prefix_caching=False), continued, greedy)
    warm = spec.generate(continued, greedy)
    assert [o.outputs[0].token_ids for o in warm] == cold
    assert sum(o.num_cached_tokens for o in warm) > 0


def test_preemption_during_speculation_loses_nothing(tiny: Path) -> None:
    prompts = random_prompts(make_vocab(tiny), 12)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = _generate(_llm(tiny, "none"), prompts, greedy)
    small = _llm(tiny, "ngram", num_kv_blocks=24, block_size=8, max_num_batched_tokens=64)
    assert _generate(small, prompts, greedy) == expected
    assert small.engine.scheduler.num_preemptions > 0
    _assert_speculated(small)


def test_cancel_during_speculation_frees_everything(tiny: Path) -> None:
    spec = _llm(tiny, "ngram")
    core = spec.engine
    prompts = random_prompts(spec.tokenizer.vocab_size, 6)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"c{i}", p, SamplingParams(max_tokens=60, temperature=0), 0.0))
    for _ in range(12):
        core.step()
    assert core.stats().spec_draft_tokens > 0
    core.abort_requests([f"c{i}" for i in range(len(prompts))])
    assert not core.has_unfinished_requests()
    assert core.kv.num_used_blocks == 0
    assert core.speculator is not None and core.speculator.proposer._indexes == {}  # type: ignore[attr-defined]


def test_counters_and_per_sample_totals(tiny: Path) -> None:
    spec = _llm(tiny, "ngram")
    prompts = random_prompts(spec.tokenizer.vocab_size, 8)
    outs = spec.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    stats = spec.engine.stats()
    drafted = sum(o.outputs[0].num_draft_tokens for o in outs)
    accepted = sum(o.outputs[0].num_accepted_draft_tokens for o in outs)
    assert drafted == stats.spec_draft_tokens and accepted == stats.spec_accepted_tokens
    per_position = stats.spec_accepted_per_position
    assert len(per_position) == 4 and sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)  # a draft is kept only after its predecessors
    assert stats.spec_drafts > 0


def test_per_request_switch(tiny: Path) -> None:
    """num_speculative_tokens on a request: 0 never drafts for it, k caps its drafts; tokens are the same."""
    spec = _llm(tiny, "ngram")
    prompts = random_prompts(spec.tokenizer.vocab_size, 6)
    greedy = dict(max_tokens=30, temperature=0, ignore_eos=True)
    params = [SamplingParams(**greedy, num_speculative_tokens=k) for k in (0, 1, None, 0, 1, None)]  # type: ignore[arg-type]
    outs = spec.generate(prompts, params)
    plain = _generate(_llm(tiny, "none"), prompts, SamplingParams(**greedy))  # type: ignore[arg-type]
    assert [o.outputs[0].token_ids for o in outs] == plain
    drafted = [o.outputs[0].num_draft_tokens for o in outs]
    assert drafted[0] == drafted[3] == 0 and drafted[2] + drafted[5] > 0
    steps_with_drafts = [o.outputs[0].num_draft_tokens for o in outs[1::3]]
    assert all(d <= 29 for d in steps_with_drafts)  # one draft per step at most, 29 decode steps
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=17)


def test_off_and_auto_config() -> None:
    with pytest.raises(ValueError, match="speculative_ngram_min"):
        EngineConfig(speculative_ngram_min=5, speculative_ngram_max=3)
    with pytest.raises(ValueError):
        EngineConfig(num_speculative_tokens=17)
    with pytest.raises(ValueError):
        EngineConfig.model_validate({"speculative_method": "medusa"})


def test_none_and_zero_tokens_never_draft(tiny: Path) -> None:
    prompts = random_prompts(make_vocab(tiny), 4)
    for llm in (_llm(tiny, "none"), LLM(str(tiny), dtype="float32", num_kv_blocks=64, num_speculative_tokens=0)):
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
        assert llm.engine.speculator is None and llm.engine.stats().spec_draft_tokens == 0


# ---------------------------------------------------------------- draft model


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes and tokenizer, other random weights: a draft that guesses badly."""
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("spec-other"), seed=5)


@pytest.mark.parametrize("draft_kind", ["same", "other"])
def test_draft_model_greedy_identical_batched_with_preemption(tiny: Path, other_tiny: Path, draft_kind: str) -> None:
    """A draft identical to the target guesses nearly always right; another
    random model nearly always wrong. Both: the target's tokens, unchanged,
    through a small cache that preempts."""
    draft = tiny if draft_kind == "same" else other_tiny
    prompts = random_prompts(make_vocab(tiny), 20)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = _generate(_llm(tiny, "none"), prompts, greedy)
    spec = _llm(tiny, "draft", speculative_model=str(draft), num_kv_blocks=24, max_num_batched_tokens=64)
    assert _generate(spec, prompts, greedy) == expected
    assert spec.engine.scheduler.num_preemptions > 0
    stats = spec.engine.stats()
    assert stats.spec_draft_tokens > 0
    if draft_kind == "same":
        assert stats.spec_accepted_tokens > 0.8 * stats.spec_draft_tokens, stats
    else:
        assert stats.spec_accepted_tokens < 0.5 * stats.spec_draft_tokens, stats
    # Seeded sampling: the same tokens as without speculation.
    seeded = [SamplingParams(max_tokens=20, temperature=0.7, seed=i, ignore_eos=True) for i in range(len(prompts))]
    assert _generate(spec, prompts, seeded) == _generate(_llm(tiny, "none"), prompts, seeded)
    proposer = spec.engine.speculator.proposer  # type: ignore[union-attr]
    assert proposer._sequences == {} and proposer.kv.num_used_blocks == 0  # type: ignore[attr-defined]


def test_draft_model_bad_settings(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(speculative_method="draft")
    from stoker.bench.synthetic_gguf import LlamaShape, write_llama_gguf

    shape = LlamaShape(hidden=256, intermediate=512, layers=1, heads=4, kv_heads=2, vocab=300, context=256)
    other_vocab = write_llama_gguf(tmp_path / "other-vocab.gguf", shape)
    with pytest.raises(ValueError, match=r"--speculative-model .*vocabulary has \d+ tokens"):
        _llm(tiny, "draft", speculative_model=str(other_vocab))
    with pytest.raises((ValueError, OSError)):
        _llm(tiny, "draft", speculative_model=str(tmp_path / "missing.gguf"))
