"""Workloads hit exact token lengths: with a tiny fake tokenizer always, and
with the default model's tokenizer when it is installed."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Sequence

import pytest

from stoker.bench.offline import prompt_lengths
from stoker.bench.workload import (
    LengthDist,
    as_messages,
    as_prompt,
    fit_text,
    load_dataset,
    parse_int_list,
    synthetic,
    synthetic_token_ids,
)


class SplitTokenizer:
    """Words split into 3-character pieces (the first with its leading space):
    token counts depend on word lengths, and a cut can land mid-word."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.inverse: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for i, word in enumerate(text.split(" ")):
            piece = ("" if i == 0 else " ") + word
            for j in range(0, len(piece), 3):
                ids.append(self._id(piece[j : j + 3]))
        return [t for t in ids if self.inverse[t] != ""]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.inverse[i] for i in ids)

    def _id(self, piece: str) -> int:
        if piece not in self.vocab:
            self.vocab[piece] = len(self.inverse)
            self.inverse.append(piece)
        return self.vocab[piece]


def test_length_distributions_parse_and_sample() -> None:
    rng = random.Random(0)
    assert LengthDist.parse("128").sample(rng, 3) == [128, 128, 128]
    assert LengthDist.parse("fixed:7").sample(rng, 1) == [7]
    uniform = LengthDist.parse("100:1000").sample(rng, 500)
    assert min(uniform) >= 100 and max(uniform) <= 1000 and max(uniform) - min(uniform) > 700
    assert LengthDist.parse("uniform:5:5").sample(rng, 2) == [5, 5]
    normal = LengthDist.parse("normal:200:10").sample(rng, 500)
    assert 190 < sum(normal) / len(normal) < 210 and min(normal) >= 1
    for bad in ("abc", "10:5", "normal:1", ""):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 50, 333])
def test_fit_text_is_exact(n: int) -> None:
    tok = SplitTokenizer()
    text = fit_text(tok, random.Random(n), n)
    assert len(tok.encode(text)) == n


def test_synthetic_prompts_have_their_target_lengths_and_differ() -> None:
    tok = SplitTokenizer()
    specs = synthetic(tok, 20, LengthDist.parse("10:200"), LengthDist.parse("16"), seed=1)
    expected = LengthDist.parse("10:200").sample(random.Random(1), 20)
    assert [len(tok.encode(s.prompt)) for s in specs] == expected == [s.input_len for s in specs]
    assert all(s.output_len == 16 for s in specs)
    assert len({s.prompt for s in specs}) == 20
    # Same seed, same workload: every server in a comparison sees the same prompts.
    assert [s.prompt for s in synthetic(tok, 20, LengthDist.parse("10:200"), None, seed=1)] == [s.prompt for s in specs]


def test_shared_prefix_workload_shares_exact_prefix_tokens() -> None:
    tok = SplitTokenizer()
    specs = synthetic(tok, 8, LengthDist.parse("20"), None, seed=2, shared_prefix_len=50, num_prefixes=4)
    assert [s.prefix_group for s in specs] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert all(len(tok.encode(s.prompt)) == 70 for s in specs)
    a, b, c = (tok.encode(specs[i].prompt) for i in (0, 4, 1))
    common = sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], zip(a, b)))
    assert common >= 50 and a != b
    assert a[:50] != c[:50]


def test_variants_draw_new_prompts_behind_the_same_prefixes() -> None:
    tok = SplitTokenizer()
    kw = {"seed": 3, "shared_prefix_len": 30, "num_prefixes": 2}
    v0 = synthetic(tok, 4, LengthDist.parse("10"), None, **kw)
    v1 = synthetic(tok, 4, LengthDist.parse("10"), None, variant=1, **kw)
    assert synthetic(tok, 4, LengthDist.parse("10"), None, variant=1, **kw) == v1
    for a, b in zip(v0, v1):
        ta, tb = tok.encode(a.prompt), tok.encode(b.prompt)
        assert ta[:30] == tb[:30] and ta != tb and len(ta) == len(tb) == 40


def test_chat_overhead_is_subtracted() -> None:
    tok = SplitTokenizer()
    (spec,) = synthetic(tok, 1, LengthDist.parse("100"), None, chat_overhead=30)
    assert spec.input_len == 70


def test_token_id_prompts_are_exact() -> None:
    tok = SplitTokenizer()
    prompts = synthetic_token_ids(tok, [5, 100, 1], seed=3)
    assert [len(p) for p in prompts] == [5, 100, 1]


def test_offline_lengths_spread_over_the_range() -> None:
    lens = prompt_lengths("100:1000", 10, seed=0)
    assert sorted(lens) == [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]
    assert lens != sorted(lens)
    assert prompt_lengths("100:1000", 10, seed=0) == lens


def test_dataset_prompts_and_conversations(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [
        {"prompt": "one two three", "max_tokens": 5},
        {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello you all"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    tok = SplitTokenizer()
    specs = load_dataset(str(path), LengthDist.parse("9"), tok=tok)
    assert [s.output_len for s in specs] == [5, len(tok.encode("hello you all")), 9]
    assert specs[1].messages == [{"role": "user", "content": "hi there"}]  # the reference reply is not sent
    assert as_messages(specs[0]) == [{"role": "user", "content": "one two three"}]
    assert as_prompt(specs[2]).startswith("system: be brief\nuser: why")
    path.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        load_dataset(str(path))


def test_parse_int_list() -> None:
    assert parse_int_list("1,4, 16,32") == [1, 4, 16, 32]
    with pytest.raises(ValueError):
        parse_int_list("1,x")


@pytest.mark.integration
def test_exact_lengths_with_the_default_models_tokenizer() -> None:
    from stoker.bench.workload import load_tokenizer

    try:
        tok = load_tokenizer()
    except FileNotFoundError:
        pytest.skip("default model not installed")
    lens = LengthDist.parse("1:1000").sample(random.Random(5), 30)
    specs = synthetic(tok, 30, LengthDist.parse("1:1000"), None, seed=5)
    assert [len(tok.encode(s.prompt)) for s in specs] == lens
    shared = synthetic(tok, 4, LengthDist.parse("50"), None, seed=6, shared_prefix_len=200, num_prefixes=2)
    ids = [tok.encode(s.prompt) for s in shared]
    assert all(len(x) == 250 for x in ids)
    assert ids[0][:200] == ids[2][:200] and ids[1][:200] == ids[3][:200] and ids[0][:200] != ids[1][:200]
    assert tok.chat_overhead() > 0
