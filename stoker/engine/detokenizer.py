"""Incremental detokenization with stop strings, O(new text) per call.

Text is decoded over a short sliding window of output tokens: `_prefix`
marks where the window starts (text before it is already emitted) and
`_read` where the already-decoded part of the window ends. Decoding the
window with and without the new tokens and taking the difference keeps
context-dependent decoders right (SentencePiece drops the space of a
window's first token, byte-level BPE splits characters across tokens) while
never re-decoding the whole output.

Text is held back in two cases:
- the window decodes to a trailing U+FFFD: the rest of a multi-byte
  character may still come. Only for so long: an incomplete character is at
  most 3 bytes, each token at least one, so once more than MAX_HELD_TOKENS
  tokens wait, the window moves on to a token boundary that splits no
  character and leaves the possibly incomplete tail waiting (the U+FFFD
  before it is there to stay). A client that forces bytes that never make
  a character (logit_bias on continuation bytes) so gets U+FFFD as decode
  shows it, and the window, the work per token, stays a few tokens long.
- the tail of the text could be the start of a stop string. A stop string
  that begins in text already emitted is impossible: that text's suffix
  would have been held as a possible stop prefix. So searching the held
  text (shorter than the longest stop string) plus the new text suffices.
  The stop strings make one automaton (Aho-Corasick, _StopMatcher, built
  once per list of stops), fed each new character once: how much to hold
  and whether a stop appeared cost O(new text) per call, whatever the
  number and length of the stop strings.

Why no prompt context: the concatenation of deltas must equal
tokenizer.decode(output_ids), so the window starts at the first output token,
as that decode does.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from stoker.engine.params import SamplingParams

_REPLACEMENT = "\ufffd"
MAX_HELD_TOKENS = 6
"""Tokens decoded but kept back while the text ends in U+FFFD, before the
window moves on anyway (an incomplete UTF-8 character is at most 3 bytes)."""
_TAIL_TOKENS = 3
"""Tokens past the boundary the window moves to: the incomplete character, if
any, lies within them (it is at most 3 bytes, a token at least one)."""


class _StopMatcher:
    """Aho-Corasick over the stop strings: its state after the text so far is
    the longest suffix of the text that is a prefix of some stop string, so
    feeding each new character once says how much to hold back and whether
    a stop string ended."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        ends = [False]
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    ends.append(False)
                node = nxt
            ends[node] = True
        self.fail = [0] * len(self.goto)
        order = list(self.goto[0].values())
        for node in order:  # breadth first: a node's failure link is shallower
            for ch, child in self.goto[node].items():
                f = self.fail[node]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                link = self.goto[f].get(ch, 0)
                self.fail[child] = link if link != child else 0
                ends[child] = ends[child] or ends[self.fail[child]]
                order.append(child)
        self.ends = ends
        """Whether some stop string ends at this state (itself or a suffix)."""

    def step(self, state: int, ch: str) -> int:
        while state and ch not in self.goto[state]:
            state = self.fail[state]
        return self.goto[state].get(ch, 0)


_MATCHERS: OrderedDict[tuple[str, ...], _StopMatcher] = OrderedDict()
_MATCHERS_LOCK = threading.Lock()  # EngineCore builds long lists in a worker thread
_MATCHER_CACHE_SIZE = 64
SMALL_STOPS_CHARS = 256
"""Stop lists up to this many characters in all build in well under a
millisecond; longer ones (up to ~0.1 s for 64 of 1024 characters) are built
off the step loop (EngineCore.add_request)."""


def stop_matcher(stops: tuple[str, ...]) -> _StopMatcher:
    """One automaton per list of stops, least recently used first out: a
    request's n samples (and clients sending the same list) share it."""
    with _MATCHERS_LOCK:
        matcher = _MATCHERS.get(stops)
        if matcher is not None:
            _MATCHERS.move_to_end(stops)
            return matcher
    matcher = _StopMatcher(stops)
    with _MATCHERS_LOCK:
        _MATCHERS[stops] = matcher
        if len(_MATCHERS) > _MATCHER_CACHE_SIZE:
            _MATCHERS.popitem(last=False)
    return matcher


def stop_matcher_ready(stops: Sequence[str]) -> bool:
    """Whether making a detokenizer for these stops is quick: none, a short
    list, or one already built."""
    if sum(len(s) for s in stops) <= SMALL_STOPS_CHARS:
        return True
    with _MATCHERS_LOCK:
        return tuple(stops) in _MATCHERS


class _Decodes(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class DetokenizerDelta:
    text: str
    """New text for the client; never part of a stop string."""
    stop_string: str | None = None
    """The stop string that ended the output, if one appeared in this call."""


class IncrementalDetokenizer:
    """One per sample. Call add() with each step's new token ids; pass
    finished=True on the last call (eos, stop token, length) to release the
    text held back as a possible stop-string prefix or incomplete character."""

    def __init__(self, tokenizer: _Decodes | Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._matcher = stop_matcher(tuple(self._stops)) if self._stops else None
        self._state = 0  # the matcher's, after all text decoded so far
        self._tokens: list[int] = []
        self._prefix = 0
        self._read = 0
        self._held = ""  # decoded but not emitted: a possible stop-string prefix
        self.stopped: str | None = None
        """The stop string that ended the output; later calls return nothing."""
        self.num_prompt_tokens = len(prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._tokens

    def add(self, new_token_ids: list[int], finished: bool = False) -> DetokenizerDelta:
        if self.stopped is not None:
            return DetokenizerDelta("")
        self._tokens.extend(new_token_ids)
        new = self._decode_new(flush=finished)
        text = self._held + new
        self._held = ""
        if self._matcher is not None:
            matcher, state, hit = self._matcher, self._state, False
            for ch in new:
                state = matcher.step(state, ch)
                hit = hit or matcher.ends[state]
            self._state = state
            if hit:  # rare (once per output): the exact search decides which stop and where
                found = self._find_stop(text)
                if found is not None:
                    at, stop = found
                    self.stopped = stop
                    return DetokenizerDelta(text[:at], stop)
            if not finished:
                # The automaton's depth: the longest suffix that starts some stop string
                # (never longer than text: held was the previous one).
                keep = matcher.depth[state]
                if keep:
                    text, self._held = text[:-keep], text[-keep:]
        return DetokenizerDelta(text)

    def flush(self) -> DetokenizerDelta:
        """Release everything held back (same as add([], finished=True))."""
        return self.add([], finished=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_new(self, flush: bool) -> str:
        """Text of the tokens past the read offset, unless it ends in an
        incomplete character (then nothing, and the window keeps growing)."""
        if self._read == len(self._tokens):
            return ""
        before = self._decode(self._tokens[self._prefix : self._read])
        after = self._decode(self._tokens[self._prefix :])
        if len(after) > len(before) and (flush or not after.endswith(_REPLACEMENT)):
            self._prefix, self._read = self._read, len(self._tokens)
            return after[len(before) :]
        if flush:  # nothing visible (e.g. only skipped special tokens)
            self._prefix = self._read = len(self._tokens)
            return ""
        if len(self._tokens) - self._read > MAX_HELD_TOKENS:
            return self._move_on(before, after)
        return ""

    def _move_on(self, before: str, after: str) -> str:
        """The text ends in U+FFFD after more tokens than any character needs:
        emit up to a token boundary q at least _TAIL_TOKENS before the end
        whose text the whole window's text starts with (so q splits no
        character) and which leaves the possibly incomplete tail (at most 3
        characters: a byte-fallback decoder shows each byte of it as one
        U+FFFD) behind it; the window then starts there."""
        end = len(self._tokens)
        for q in range(end - _TAIL_TOKENS, self._read, -1):
            head = self._decode(self._tokens[self._prefix : q])
            if len(before) <= len(head) <= len(after) - _TAIL_TOKENS and after.startswith(head):
                self._prefix, self._read = self._read, q
                return head[len(before) :]
        if end - self._read > 2 * MAX_HELD_TOKENS:
            # No such boundary (tokens that decode to nothing after an incomplete
            # character): show the text as decode does now rather than let the window grow.
            self._prefix, self._read = self._read, end
            return after[len(before) :]
        return ""

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """Earliest stop string in text (the first listed wins a tie)."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best
