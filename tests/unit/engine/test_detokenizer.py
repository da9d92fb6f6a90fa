"""IncrementalDetokenizer: deltas add up to the full decode (real SmolLM2
tokenizer and a byte-per-token fake that splits every multi-byte character),
no partial characters, stop strings never leak, work per call stays small."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import pytest

from stoker.engine.detokenizer import IncrementalDetokenizer
from stoker.engine.params import SamplingParams

TEXTS = [
    "Hello, world! How are you today?",
    " leading spaces   and  double  spaces.\n\nNew paragraph\ttab",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 done.",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트.",
    "Accents: café, naïve, façade, Ångström, ñandú, Dvořák — “quotes” … ellipsis",
    "Code: def f(x):\n    return x ** 2  # comment\n",
    "Mixed: a😀b中c é d 🇺🇳 end",
]


class ByteTokenizer:
    """One token per UTF-8 byte: every multi-byte character is split."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.longest = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return super().decode(ids, skip_special_tokens)


class HFAdapter:
    def __init__(self, hf: object) -> None:
        self.hf = hf

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)  # type: ignore[attr-defined]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        return self.hf.convert_ids_to_tokens(ids)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def smollm() -> HFAdapter:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from stoker.config import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return HFAdapter(hf)


def feed(tok: object, ids: list[int], chunk: int = 1, **params: object) -> tuple[list[str], str | None]:
    detok = IncrementalDetokenizer(tok, [1, 2, 3], SamplingParams(**params))  # type: ignore[arg-type]
    deltas: list[str] = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        d = detok.add(ids[i : i + chunk], finished=last)
        deltas.append(d.text)
        if d.stop_string is not None:
            return deltas, d.stop_string
    return deltas, None


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_real_tokenizer_deltas_add_up(smollm: HFAdapter, text: str, chunk: int) -> None:
    ids = smollm.encode(text)
    deltas, stop = feed(smollm, ids, chunk)
    assert stop is None
    assert "".join(deltas) == smollm.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_split_characters_are_held_until_complete(text: str) -> None:
    tok = ByteTokenizer()
    deltas, _ = feed(tok, tok.encode(text))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    emoji = tok.encode("😀")
    assert feed(tok, emoji)[0] == ["", "", "", "😀"]


def test_special_tokens_follow_skip_special_tokens(smollm: HFAdapter) -> None:
    ids = smollm.encode("Hi there") + [2]  # 2 is <|im_end|>
    assert "".join(feed(smollm, ids)[0]) == "Hi there"
    assert "".join(feed(smollm, ids, skip_special_tokens=False)[0]) == "Hi there<|im_end|>"


def test_stop_string_across_tokens_is_never_emitted(smollm: HFAdapter) -> None:
    text = "The answer is 42. END of story, more text"
    ids = smollm.encode(text)
    deltas, stop = feed(smollm, ids, stop=["END of"])
    assert stop == "END of"
    assert "".join(deltas) == "The answer is 42. "
    assert not any("E" in d for d in deltas)


def test_held_prefix_is_released_when_it_does_not_complete() -> None:
    tok = ByteTokenizer()
    deltas, stop = feed(tok, tok.encode("ab\nc\n"), stop=["\n\n"])
    assert stop is None
    assert deltas == ["a", "b", "", "\nc", "\n"]  # the last "\n" comes out on finish
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["\n\n"]))
    assert [detok.add([b]).text for b in b"x\n"] == ["x", ""]
    assert detok.flush().text == "\n"


def reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Generation stops where a stop string first ends; the earliest-starting one wins."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[: end - len(s)], s
    return text, None


def test_stop_strings_match_a_brute_force_reference() -> None:
    rng = random.Random(0)
    tok = ByteTokenizer()
    alphabet = ["a", "b", "é", "😀", " ", "\n"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        deltas, stop = feed(tok, tok.encode(text), stop=stops)
        want_text, want_stop = reference_stop(text, stops)
        assert ("".join(deltas), stop) == (want_text, want_stop), (text, stops)
        # Nothing emitted may ever be part of the stop string found.
        if want_stop is not None:
            assert want_stop not in "".join(deltas)


def test_after_a_stop_nothing_more_comes_out() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["x"]))
    assert detok.add(tok.encode("abxcd")).text == "ab"
    assert detok.stopped == "x"
    assert detok.add(tok.encode("efg"), finished=True).text == ""


def test_work_per_call_does_not_grow_with_output() -> None:
    tok = CountingTokenizer()
    text = ("word 😀 中文 é " * 300).encode("utf-8")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["never appears"]))
    out = [detok.add([b]).text for b in text]
    out.append(detok.flush().text)
    assert "".join(out) == text.decode("utf-8")
    assert tok.longest <= 8  # the window spans a character or two, not the output


def test_an_unfinished_character_is_released_on_finish_as_decode_shows_it() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("ok") + tok.encode("😀")[:2]
    deltas, _ = feed(tok, ids)
    assert deltas[:-1] == ["o", "k", ""]
    assert "".join(deltas) == tok.decode(ids)
