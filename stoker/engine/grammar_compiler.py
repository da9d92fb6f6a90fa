"""Compiling grammars for one tokenizer: llguidance matchers, cached by grammar.

Compiling builds a matcher's lexer and parser tables. It is cached by grammar
string, least recently used first out; each sequence gets a deep copy of the
compiled matcher (stoker/engine/structured.py uses it). llguidance bounds
compile and per-token work by "fuel" limits, so a pathological schema fails
fast with an error instead of stalling a step.

The front end compiles here too, to refuse a bad grammar with a 400 before the
engine sees it; so this module imports neither torch nor, until a compiler is
built, transformers (llguidance.hf): the front end imports it before it spawns
the engine, and those imports would delay the engine's start.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


class GrammarError(ValueError):
    """The grammar does not compile (bad schema, regex or grammar syntax, or a
    resource limit); the message names the problem."""


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's default limits (about 20 ms of lexer work to build, about
    15 ms per token at worst) -- the same in the front end, which validates,
    and in the engine, which runs."""
    return llguidance.LLParserLimits()


class GrammarCompiler:
    """Compiles grammars for one tokenizer, with an LRU cache of compiled matchers."""

    def __init__(
        self,
        hf_tokenizer: PreTrainedTokenizerFast,
        vocab_size: int,
        eos_token_ids: list[int] | None,
        cache_size: int = 256,
    ) -> None:
        self.vocab_size = vocab_size
        """The logits' width: masks cover every id below it."""
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the front end compiles from worker threads
        self.num_compiled = 0
        self.compile_seconds: deque[float] = deque(maxlen=256)
        """Durations of the latest compiles (num_compiled counts them all)."""

    def cached(self, grammar: str) -> llguidance.LLMatcher | None:
        """The compiled matcher if this grammar is in the cache, without compiling."""
        with self._lock:
            matcher = self._cache.get(grammar)
            if matcher is not None:
                self._cache.move_to_end(grammar)
            return matcher

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """A compiled matcher in its initial state (the cached one: copy before use).
        Raises GrammarError naming the problem."""
        with self._lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
                return cached
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
        with self._lock:
            self.compile_seconds.append(time.perf_counter() - started)
            self.num_compiled += 1
            if matcher.is_error():
                raise GrammarError(matcher.get_error())
            self._cache[grammar] = matcher
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence."""
        return self.compile(grammar).deep_copy()
