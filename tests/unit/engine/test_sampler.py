"""Sampler: exact greedy, penalties against straightforward references,
min_tokens masking, shape controls against transformers' warpers, seeds
that ignore the rest of the batch, and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from stoker.engine.params import SamplingParams
from stoker.engine.sampler import Sampler, SampleRow, _argmax, _invert_cdf, _shaped_probs

VOCAB = 64


def row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    eos: list[int] | None = None,
    **kw: object,
) -> SampleRow:
    params = SamplingParams(**kw)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SampleRow(params, prompt or [], output or [], gen, eos if eos is not None else [])


def logits(n: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_fast_path_is_argmax_any_dtype() -> None:
    x = logits(8).to(torch.bfloat16)
    out = Sampler()(x, [row(temperature=0.0) for _ in range(8)])
    assert [o.token_id for o in out] == x.float().argmax(-1).tolist()
    assert all(o.logprob is None for o in out)


def test_greedy_ties_pick_the_first_index_like_torch() -> None:
    x = torch.zeros(3, 1000)
    x[0, [700, 300]] = 5.0  # tie across blocks
    x[1, [3, 5]] = 5.0  # tie inside a block
    x[2] = -math.inf
    x[2, 999] = 1.0  # in the padded last block
    out = Sampler()(x, [row(temperature=0.0) for _ in range(3)])
    assert [o.token_id for o in out] == [300, 3, 999] == x.argmax(-1).tolist()


def test_greedy_off_the_cpu_float32_path_is_torch_argmax_too() -> None:
    """The block-maxima argmax serves logits numpy cannot take (another device, another
    dtype); float64 on the CPU takes it here: the same ties as torch.argmax."""
    x = torch.zeros(3, 1000, dtype=torch.float64)
    x[0, [700, 300]] = 5.0
    x[1, [3, 5]] = 5.0
    x[2] = -math.inf
    x[2, 999] = 1.0
    assert _argmax(x) == [300, 3, 999] == x.argmax(-1).tolist()
    y = logits(16, vocab=151936, seed=3).double()
    assert _argmax(y) == y.argmax(-1).tolist()


def test_empty_batch_and_shape_check() -> None:
    assert Sampler()(torch.empty(0, VOCAB), []) == []
    with pytest.raises(ValueError):
        Sampler()(logits(2), [row()])


def reference_penalties(x: torch.Tensor, r: SampleRow) -> torch.Tensor:
    x = x.clone()
    p = r.params
    for t in set(r.prompt_token_ids + r.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(r.output_token_ids):
        c = r.output_token_ids.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def test_penalties_match_reference_and_leave_input_alone() -> None:
    x = logits(4)
    before = x.clone()
    rows = [
        row([1, 2, 3], [3, 3, 5], temperature=0.0, repetition_penalty=1.3),
        row([7], [8, 8, 8, 9], temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4),
        row([10, 11], [11, 12, 12], temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.5),
        row([1], [2], temperature=0.0),
    ]
    out = Sampler()(x, rows)
    assert torch.equal(x, before)
    for i, r in enumerate(rows):
        assert out[i].token_id == int(reference_penalties(x[i], r).argmax())


def test_repetition_penalty_matches_transformers() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    x = logits(1, 16)
    ids = [4, 9, 9, 13]
    r = row(ids[:2], ids[2:], temperature=0.0, repetition_penalty=1.7, logprobs=16)
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([ids]), x.clone())
    lp = Sampler()(x, [r])[0].logprob
    assert lp is not None
    ours = torch.full((16,), math.nan)
    for t, v in lp.top:
        ours[t] = v
    assert torch.allclose(ours, torch.log_softmax(hf[0], -1), atol=1e-5)


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    x = torch.zeros(3, VOCAB)
    x[:, 5] = 10.0  # eos would win greedy
    x[:, 6] = 9.0  # a stop token id comes next
    rows = [
        row(output=[1], eos=[5], temperature=0.0, min_tokens=3, stop_token_ids=[6]),
        row(output=[1, 2, 3], eos=[5], temperature=0.0, min_tokens=3, stop_token_ids=[6]),
        row(output=[1], eos=[5], temperature=0.0, min_tokens=3, ignore_eos=True),
    ]
    out = Sampler()(x, rows)
    assert [o.token_id for o in out] == [0, 5, 5]


def test_min_tokens_masked_ids_never_sampled() -> None:
    x = torch.zeros(16, 4)
    x[:, 0] = 5.0
    rows = [row(output=[], eos=[0], min_tokens=2, seed=i) for i in range(16)]
    assert all(o.token_id != 0 for o in Sampler()(x, rows))


def hf_mask(x: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    # float64: transformers' float32 cumsum over a large vocabulary rounds
    # by ~1e-6, which moves its cut by a token in a flat tail (5.x does).
    z = x.double().unsqueeze(0) / temperature
    if top_k > 0:
        z = TopKLogitsWarper(top_k)(None, z)
    if top_p < 1.0:
        z = TopPLogitsWarper(top_p)(None, z)
    return z[0] > -math.inf


@pytest.mark.parametrize("vocab", [64, 5000])
def test_top_k_top_p_keep_the_same_tokens_as_transformers(vocab: int) -> None:
    # vocab 5000 with scale 0.3 is flat enough that the nucleus exceeds the
    # 256 candidates and the full-sort fallback runs.
    settings = [(0.7, 0, 0.9), (1.0, 10, 1.0), (1.3, 20, 0.5), (1.0, 0, 0.95), (0.5, 3, 0.99), (1.0, 1, 1.0)]
    for scale in (3.0, 0.3):
        x = logits(len(settings), vocab, seed=vocab, scale=scale)
        rows = [row(temperature=t, top_k=k, top_p=p) for t, k, p in settings]
        z = _shaped_probs(x.clone(), rows, list(range(len(rows))))
        for i, (t, k, p) in enumerate(settings):
            assert torch.equal(z[i] > 0, hf_mask(x[i], t, k, p)), (scale, settings[i])


def test_top_p_widens_its_net_for_a_long_tail() -> None:
    # One token at ~50% and a tail of tiny tokens far below 1e-4 of it that
    # together hold the other half: the first candidate net is not enough.
    x = logits(2, 49152, scale=0.05)  # distinct tail values: no ties at the cut
    x[0, 7] = math.log(49151.0)
    x[1, 9] = math.log(49151.0 * 1e9)  # second row: net of the best token suffices
    rows = [row(top_p=0.9), row(top_p=0.9)]
    z = _shaped_probs(x.clone(), rows, [0, 1])
    for i in range(2):
        assert torch.equal(z[i] > 0, exact_top_p_mask(x[i], 0.9))
        assert torch.equal(z[i] > 0, hf_mask(x[i], 1.0, 0, 0.9))


def exact_top_p_mask(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition, in float64: a token stays while the mass strictly before it is below top_p."""
    p = torch.softmax(x.double(), -1)
    s, idx = p.sort(descending=True, stable=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[idx[s.cumsum(0) - s < top_p]] = True
    return keep


def test_invert_cdf_edges() -> None:
    probs = torch.zeros(3, 1000)  # not a multiple of the block size
    probs[:, 999] = 1.0
    probs[1, 0] = 1.0
    probs[2, 255:257] = 1.0  # straddles a block boundary
    assert _invert_cdf(probs, torch.tensor([0.0, 0.0, 0.0])) == [999, 0, 255]
    assert _invert_cdf(probs, torch.tensor([1 - 2**-24] * 3)) == [999, 999, 999]
    assert _invert_cdf(probs, torch.tensor([0.5, 0.49, 0.4])) == [999, 0, 256]


def test_min_p_keeps_tokens_within_factor_of_best() -> None:
    x = logits(1)
    z = _shaped_probs(x.clone(), [row(temperature=0.8, min_p=0.1)], [0])[0]
    probs = torch.softmax(x[0] / 0.8, -1)
    assert torch.equal(z > 0, probs >= 0.1 * probs.max())


def test_sampling_follows_the_distribution() -> None:
    torch.manual_seed(1234)
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    out = Sampler()(x, [row() for _ in range(4000)])
    freq = torch.bincount(torch.tensor([o.token_id for o in out]), minlength=4).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    # top_k=2 renormalises over the two best.
    out = Sampler()(x, [row(top_k=2) for _ in range(4000)])
    freq = torch.bincount(torch.tensor([o.token_id for o in out]), minlength=4).float() / 4000
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.625) < 0.03


def test_seeded_rows_ignore_batch_composition() -> None:
    def run(batch_extra: int, steps: int = 12) -> list[int]:
        sampler = Sampler()
        seeded = row(seed=42, temperature=0.9, top_p=0.9)
        others = [row(temperature=1.0, top_k=5) for _ in range(batch_extra)]
        got = []
        for step in range(steps):
            x_main = logits(1, 512, seed=step)
            x_other = logits(batch_extra, 512, seed=100 + step)
            batch = [*others[: batch_extra // 2], seeded, *others[batch_extra // 2 :]]
            x = torch.cat([x_other[: batch_extra // 2], x_main, x_other[batch_extra // 2 :]])
            out = sampler(x, batch)
            got.append(out[batch_extra // 2].token_id)
        return got

    torch.manual_seed(0)
    a = run(0)
    torch.manual_seed(1)
    b = run(7)
    torch.manual_seed(2)
    c = run(20)
    assert a == b == c
    assert len(set(a)) > 1


def test_logprobs_are_processed_logits_before_temperature() -> None:
    x = logits(3)
    rows = [
        row(temperature=0.0, logprobs=5),
        row(seed=1, temperature=0.5, top_k=3, logprobs=0),
        row(output=[7], temperature=0.0, presence_penalty=2.0, logprobs=2),
    ]
    out = Sampler()(x, rows)
    for i, o in enumerate(out):
        ref = torch.log_softmax(reference_penalties(x[i], rows[i]), -1)
        lp = o.logprob
        assert lp is not None and lp.token_id == o.token_id
        assert lp.logprob == pytest.approx(float(ref[o.token_id]), abs=1e-5)
        k = rows[i].params.logprobs
        assert [t for t, _ in lp.top] == ref.topk(k).indices.tolist() if k else lp.top == []
        assert all(a >= b for (_, a), (_, b) in zip(lp.top, lp.top[1:]))


def test_mixed_batch_greedy_rows_stay_exact() -> None:
    x = logits(6, 1000)
    rows = [row(temperature=0.0) if i % 2 else row(temperature=1.0, top_p=0.8, seed=i) for i in range(6)]
    out = Sampler()(x, rows)
    for i in range(1, 6, 2):
        assert out[i].token_id == int(x[i].argmax())


@pytest.mark.parametrize(
    "extreme",
    [
        {"repetition_penalty": 5e-324},
        {"repetition_penalty": 1e308},
        {"repetition_penalty": 5e-324, "temperature": 1e-5},
        {"repetition_penalty": 1e308, "temperature": 1e300, "top_p": 5e-324},
        {"min_p": 5e-324, "presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"min_p": 1.0, "top_k": 1, "temperature": 2.0},
    ],
)
def test_extreme_parameters_keep_the_math_finite(extreme: dict[str, float]) -> None:
    # Every token of the prompt seen, some with negative logits: a tiny penalty
    # divides positive logits by 5e-324, a huge one multiplies negative ones by 1e308.
    x = logits(4, scale=50.0)
    rows = [row(list(range(VOCAB)), [1, 1, 2], seed=i, logprobs=5, **extreme) for i in range(3)]
    rows.append(row(list(range(VOCAB)), [3], logprobs=0, **{**extreme, "temperature": 0.0}))
    for o in Sampler()(x, rows):
        assert 0 <= o.token_id < VOCAB
        lp = o.logprob
        assert lp is not None
        values = [lp.logprob, *(v for _, v in lp.top)]
        assert not any(math.isnan(v) for v in values), values
        assert all(v <= 0.0 for v in values) and math.isfinite(lp.logprob), values


def test_logit_bias_is_added_before_penalties_and_shows_in_logprobs() -> None:
    x = logits(3)
    rows = [
        row(temperature=0.0, logit_bias={7: 100.0}),
        row(temperature=1.0, seed=3, logit_bias={int(x[1].argmax()): -100.0, 9: 100.0}, logprobs=1),
        row(temperature=0.0, logit_bias={5: 100.0}, repetition_penalty=1e9, output=[5], logprobs=0),
    ]
    out = Sampler()(x, rows)
    assert out[0].token_id == 7
    assert out[1].token_id == 9 and out[1].logprob is not None and out[1].logprob.top[0][0] == 9
    # Bias first, then the penalty: 5 got +100, then was divided by 1e9.
    assert out[2].token_id != 5
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 100.5})


# ---- seeds through the engine (tiny random model, float32) -----------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("sampler-seed")))


def _tokens(outputs: list, i: int = 0) -> list[int]:
    return list(outputs[i].outputs[0].token_ids)


def test_seeded_request_gives_the_same_tokens_alone_and_in_any_batch(tiny_model: str) -> None:
    from stoker.engine.llm import LLM

    llm = LLM(tiny_model, dtype="float32", num_kv_blocks=256)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = "The quick brown fox"
    alone = _tokens(llm.generate(prompt, seeded))
    others = [
        ("Once upon a time in a land far away", SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)),
        ("1 2 3", SamplingParams(temperature=0.0, max_tokens=5)),
        ("Hello", SamplingParams(temperature=0.7, top_p=0.8, seed=5, max_tokens=12, ignore_eos=True)),
    ]
    batch = llm.generate(
        [others[0][0], prompt, others[1][0], others[2][0]], [others[0][1], seeded, *[p for _, p in others[1:]]]
    )
    assert _tokens(batch, 1) == alone
    assert len(set(alone)) > 1  # really sampled, not a constant
    # n samples of one seeded request differ from each other but are each reproducible.
    two = llm.generate(prompt, SamplingParams(temperature=1.0, seed=1234, n=2, max_tokens=24, ignore_eos=True))[0]
    assert list(two.outputs[0].token_ids) == alone and list(two.outputs[1].token_ids) != alone


def test_server_seed_makes_unseeded_requests_reproducible(tiny_model: str) -> None:
    from stoker.engine.llm import LLM

    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    prompts = ["The quick brown fox", "The quick brown fox", "Once upon a time"]

    def run(seed: int) -> list[list[int]]:
        llm = LLM(tiny_model, dtype="float32", num_kv_blocks=256, seed=seed)
        first = llm.generate(prompts, params)
        second = llm.generate(prompts[0], params)  # later requests draw later seeds
        return [_tokens(first, i) for i in range(3)] + [_tokens(second)]

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c
    assert a[0] != a[1] != a[3]  # identical unseeded requests still differ


def test_biased_greedy_tokens_are_what_the_dense_sum_gives() -> None:
    """The bias, prepared as tensors once per request, adds exactly what the
    client asked: greedy picks argmax(logits + bias), rows apart."""
    vocab = 49152
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, vocab, generator=g)
    biases = [{int(t): float(b) for t, b in zip(torch.randint(0, vocab, (300,), generator=g), torch.randn(300) * 5)}]
    biases.append({int(x[1].argmax()): -100.0})
    rows = [SampleRow(SamplingParams(temperature=0.0, logit_bias=b), [], [], None, []) for b in biases]
    rows += [SampleRow(SamplingParams(temperature=0.0), [], [], None, []) for _ in range(2)]
    dense = x.clone()
    for i, b in enumerate(biases):
        for t, v in b.items():
            dense[i, t] += torch.tensor(v, dtype=torch.float32)
    assert [s.token_id for s in Sampler()(x, rows)] == dense.argmax(dim=-1).tolist()
