"""Issue 34 item 5: one request cannot slow everyone's steps. The work each
step does per sequence must not grow with the lists one client sends: stop
token ids are a set, logit_bias and the min_tokens ids are tensors built once
when the request is added, stop strings go through one automaton, the
detokenizer's window keeps moving while the text ends in U+FFFD, and grammars
compile off the step loop (the request waits until its grammar is ready).

Timing-free: each test checks the structure that bounds the work (what is
looked up, what is scanned, how long the decode window gets, which thread
compiles), not how long a step took."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
import torch
from conftest import ServerProcess, start_server
from tiny_models import make_tiny_hf_model

from stoker import LLM
from stoker.engine.detokenizer import IncrementalDetokenizer
from stoker.engine.grammar_compiler import GrammarCompiler
from stoker.engine.grammars import choice_grammar
from stoker.engine.params import EngineCoreRequest, FinishReason, SamplingParams
from stoker.engine.request import Request
from stoker.engine.sampler import Sampler, SampleRow

VOCAB = 49152


class _NoScan(list[int]):
    """A list that fails the test if anything walks or searches it."""

    def __iter__(self) -> Iterator[int]:
        raise AssertionError("a client's list was scanned during a step")

    def __contains__(self, item: object) -> bool:
        raise AssertionError("a client's list was searched during a step")


class _NoWalk(dict[int, float]):
    """A logit_bias that fails the test if a step walks it."""

    def items(self) -> Any:
        raise AssertionError("logit_bias was walked during a step")

    def keys(self) -> Any:
        raise AssertionError("logit_bias was walked during a step")

    def values(self) -> Any:
        raise AssertionError("logit_bias was walked during a step")

    def __iter__(self) -> Iterator[int]:
        raise AssertionError("logit_bias was walked during a step")


def test_check_stop_looks_a_token_up_in_a_set_built_once() -> None:
    from stoker.engine.sampler import prepare

    params = SamplingParams(stop_token_ids=list(range(1, 10_001)), max_tokens=100)
    r = Request("r", 0, [1, 2], params, 0.0, max_tokens=100, prepared=prepare(params))
    assert isinstance(r.prepared.stop_token_ids, frozenset)
    params.stop_token_ids = _NoScan(params.stop_token_ids)  # from now on, a scan fails
    for token in (20_000, 20_001, 20_002):
        r.append_token(token, 0.0)
        r.check_stop(frozenset(), 1000)
        assert not r.is_finished
    r.append_token(9_999, 0.0)
    r.check_stop(frozenset(), 1000)
    assert (r.finish_reason, r.stop_reason) == (FinishReason.STOP, 9_999)


def test_logit_bias_reaches_the_sampler_as_tensors_built_once() -> None:
    from stoker.engine.sampler import prepare

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=g)
    # A whole-vocabulary bias that makes token 7 the argmax: +100 on it, -100 on the rest.
    bias = {t: (100.0 if t == 7 else -100.0) for t in range(VOCAB)}
    params = SamplingParams(temperature=0.0, logit_bias=bias, min_tokens=5, stop_token_ids=[11, 12])
    prepared = prepare(params, [0])
    assert prepared.bias_ids is not None and prepared.bias_ids.numel() == VOCAB
    assert prepared.bias_values is not None and prepared.bias_values.dtype == torch.float32
    assert sorted(prepared.suppress_ids.tolist()) == [0, 11, 12]  # eos and the stop ids, while < min_tokens
    params.logit_bias = _NoWalk(bias)  # truthy, but walking it fails
    params.stop_token_ids = _NoScan(params.stop_token_ids)
    plain = SamplingParams(temperature=0.0)
    rows = [
        SampleRow(params, [1], [], None, [0], prepared=prepared),
        SampleRow(plain, [1], [], None, [0]),
        SampleRow(params, [1], [2, 3], None, [0], prepared=prepared),
    ]
    picked = [s.token_id for s in Sampler()(logits, rows)]
    assert picked == [7, int(logits[1].argmax()), 7]


class _ByteTokenizer:
    """One token per byte; records the longest window it was asked to decode."""

    def __init__(self) -> None:
        self.longest = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_run_of_incomplete_utf8_keeps_the_window_bounded() -> None:
    tok = _ByteTokenizer()
    ids = [0xF0] + [0x80] * 999  # a lead byte, then continuation bytes that never make a character
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    deltas = [detok.add([t]).text for t in ids]
    streamed_before_the_end = sum(len(d) for d in deltas)
    deltas.append(detok.flush().text)
    assert "".join(deltas) == bytes(ids).decode("utf-8", errors="replace")
    assert tok.longest <= 16, f"the decode window grew to {tok.longest} tokens"
    assert streamed_before_the_end >= 990  # the text streamed, not all at the end


def test_moving_on_never_splits_a_character() -> None:
    tok = _ByteTokenizer()
    chunk = b"\x80" * 10 + "€".encode() + b"\xbf" * 7 + "😀".encode() + b"\xe2\x82" + b"a" + b"\x9f" * 9 + "é".encode()
    ids = list(chunk * 20)
    for step in (1, 3):
        detok = IncrementalDetokenizer(tok, [], SamplingParams())
        deltas = [detok.add(ids[i : i + step]).text for i in range(0, len(ids), step)]
        deltas.append(detok.flush().text)
        text = "".join(deltas)
        assert text == bytes(ids).decode("utf-8", errors="replace")
        assert text.count("€") == text.count("😀") == text.count("é") == 20
    assert tok.longest <= 24


def test_long_stop_lists_are_not_searched_at_every_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 stop strings of 1024 characters that the output keeps matching the
    prefix of: the exact search runs only once a stop string has ended."""
    searches = []
    real = IncrementalDetokenizer._find_stop

    def counted(self: IncrementalDetokenizer, text: str) -> Any:
        searches.append(len(text))
        return real(self, text)

    monkeypatch.setattr(IncrementalDetokenizer, "_find_stop", counted)
    stops = ["B" + "A" * 1022 + "!" for _ in range(63)] + ["A" * 1023 + "!"]
    tok = _ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=stops))
    out = [detok.add([ord("A")]).text for _ in range(2000)]
    assert "".join(out) == "A" * (2000 - 1023)  # the last 1023 could still start the stop string
    assert searches == []
    assert detok.add([ord("!")]).stop_string == "A" * 1023 + "!"
    assert len(searches) == 1


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = make_tiny_hf_model("llama", tmp_path_factory.mktemp("step-work"))
    return LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=64)


def test_grammars_compile_off_the_step_loop(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a grammar compiles (held here until released), steps go on for the
    others; the compiler never runs on the thread that calls add_request and step."""
    engine = llm.engine
    on_loop: list[bool] = []
    entered = threading.Event()
    release = threading.Event()
    real = GrammarCompiler.compile

    def slow_compile(self: GrammarCompiler, grammar: str) -> Any:
        on_loop.append(threading.current_thread() is threading.main_thread())
        entered.set()
        release.wait(5)
        return real(self, grammar)

    monkeypatch.setattr(GrammarCompiler, "compile", slow_compile)
    choices = ["alpha", "beta", f"gamma{time.time_ns()}"]  # never compiled before
    grammar = choice_grammar(choices)
    now = time.time()
    engine.add_request(EngineCoreRequest("g", [5, 6, 7], SamplingParams(max_tokens=20, grammar=grammar), now))
    engine.add_request(EngineCoreRequest("p", [5, 6, 8], SamplingParams(max_tokens=6, ignore_eos=True), now))
    texts: dict[str, str] = {"g": "", "p": ""}
    finished: set[str] = set()
    while "p" not in finished:
        for delta in engine.step():
            texts[delta.request_id] += delta.new_text
            if delta.finished:
                finished.add(delta.request_id)
    # On a loaded machine "p" can finish before the compile thread is scheduled at all.
    assert entered.wait(10), "the grammar compile never started"
    assert on_loop == [False], "the grammar compiled on the step loop's thread"
    assert "g" not in finished and texts["g"] == ""  # waiting for its grammar, outside the scheduler
    release.set()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            texts[delta.request_id] += delta.new_text
            if delta.finished:
                finished.add(delta.request_id)
    assert texts["g"] in choices
    assert len(on_loop) == 1  # once per grammar: the second request hits the cache
    engine.add_request(EngineCoreRequest("g2", [5, 6], SamplingParams(max_tokens=20, grammar=grammar), time.time()))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(on_loop) == 1


# ------------------------------------------------------------ over HTTP


def _continuation_byte_tokens(folder: str) -> list[int]:
    """Ids of the single bytes 0x80-0xBF in the SmolLM2 (GPT-2 byte-level) vocabulary."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(folder).get_vocab()
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in visible}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [vocab[chars[b]] for b in range(0x80, 0xC0)]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, list[int]]]:
    tmp = tmp_path_factory.mktemp("step-work-server")
    model = make_tiny_hf_model("llama", tmp)
    server = start_server(
        ["--model", str(model), "--dtype", "float32", "--no-embedding-model", "--max-model-len", "512"], str(tmp)
    )
    try:
        yield server, _continuation_byte_tokens(str(model))
    finally:
        server.stop()


def test_a_request_forcing_incomplete_utf8_streams_and_completes(
    tiny_server: tuple[ServerProcess, list[int]],
) -> None:
    server, continuation = tiny_server
    body = {
        "prompt": "Hello",
        "max_tokens": 120,
        "ignore_eos": True,
        "stream": True,
        "logit_bias": {str(t): 100 for t in continuation},
        "stop": ["B" + "A" * 1000 for _ in range(60)],
        "stop_token_ids": list(range(VOCAB - 200, VOCAB)),
    }
    chunks: list[str] = []
    finish = None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("text"):
                chunks.append(choice["text"])
            finish = choice.get("finish_reason") or finish
    text = "".join(chunks)
    assert finish == "length"
    assert text == "\ufffd" * 120  # one per stray continuation byte, as decode shows them
    assert len(chunks) >= 20, f"the text came in {len(chunks)} chunk(s), not as it was generated"
