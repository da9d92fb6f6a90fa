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
  character is still to come;
- the tail of the text could be the start of a stop string. A stop string
  that begins in text already emitted is impossible: that text's suffix
  would have been held as a possible stop prefix. So searching the held
  text (shorter than the longest stop string) plus the new text suffices.

Why no prompt context: the concatenation of deltas must equal
tokenizer.decode(output_ids), so the window starts at the first output token,
as that decode does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from stoker.engine.params import SamplingParams

_REPLACEMENT = "\ufffd"


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
        text = self._held + self._decode_new(flush=finished)
        self._held = ""
        if self._stops:
            hit = self._find_stop(text)
            if hit is not None:
                at, stop = hit
                self.stopped = stop
                return DetokenizerDelta(text[:at], stop)
            if not finished:
                keep = self._stop_prefix_len(text)
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

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """Earliest stop string in text (the first listed wins a tie)."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that starts some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
