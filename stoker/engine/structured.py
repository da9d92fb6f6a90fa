"""Grammar-constrained decoding: llguidance matchers and their token bitmasks.

A constrained request carries a grammar (SamplingParams.grammar, an llguidance
grammar string built by stoker/engine/grammars.py). Each of its sequences owns
an LLMatcher:

- the scheduler asks the matcher for the next-token bitmask when the sequence
  samples this step (never for a prefill chunk that does not reach its end);
- the sampler sets every token outside the mask to -inf for that row only;
- Scheduler.update_from_output advances the matcher with each accepted token,
  and finishes the sequence (finish_reason "stop") when the grammar is done.

With speculative decoding the guesses are walked through the matcher first
(SequenceGrammar.check_drafts): cut at the first token the grammar refuses,
one mask per position the step samples, then rolled back, so the accepted
tokens still advance the matcher in that one place.

Preemption recomputes KV but keeps the sequence's tokens, so the matcher's
state stays exactly right; nothing has to be rolled back or replayed.

Compiling grammars (and their cache) is stoker/engine/grammar_compiler.py;
each sequence gets a deep copy of the compiled matcher.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance

# llguidance.numpy, not llguidance.torch: importing the latter runs a
# torch.compile decorator, which imports dynamo and inductor (~1 s of every
# engine start) for a kernel stoker does not use.
import llguidance.numpy
import numpy as np
import torch

_BITS = 32


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // _BITS)


def next_token_bitmask(matcher: llguidance.LLMatcher, vocab_size: int) -> torch.Tensor:
    """The tokens the grammar allows next, as int32 words (bit i of word w:
    token 32w + i). Called only for a sequence that samples this step."""
    mask = np.zeros((1, bitmask_words(vocab_size)), dtype=np.int32)
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    return torch.from_numpy(mask[0])


def banned_tokens(bitmasks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmasks (on the CPU, where the matchers fill them) ->
    [rows, vocab_size] bool, True where a token is NOT allowed: what the sampler
    fills with -inf. numpy's unpackbits takes ~0.05 ms for 16 rows of a 49k
    vocabulary, where a torch shift per bit took ~0.3 ms; word w's bit i is
    token 32w + i, which is byte order little-endian on every target."""
    inverted = np.bitwise_not(bitmasks.numpy()).view(np.uint8)
    bits = np.unpackbits(inverted, axis=-1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)


def allows(bitmask: torch.Tensor, token_id: int) -> bool:
    """Whether one bitmask (int32 words) has token_id's bit set."""
    if not 0 <= token_id < bitmask.shape[0] * _BITS:
        return False
    return bool((int(bitmask[token_id // _BITS]) >> (token_id % _BITS)) & 1)


@dataclass(frozen=True)
class CheckedDrafts:
    """Speculative guesses the grammar allows, with the mask of every position
    the step samples."""

    token_ids: list[int]
    """The longest prefix of the guesses the grammar accepts (never an
    end-of-sequence token, never past the grammar's end)."""
    bitmasks: list[torch.Tensor]
    """len(token_ids) + 1 masks: bitmasks[j] is the next-token mask once
    token_ids[:j] are consumed, so position j samples exactly as it would
    decoding without speculation."""


class SequenceGrammar:
    """One sequence's matcher: the next-token mask, and advancing by accepted tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_id: int | None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def next_bitmask(self) -> torch.Tensor:
        mask = next_token_bitmask(self.matcher, self.vocab_size)
        if not bool(mask.any()) and self.eos_token_id is not None:
            # Nothing allowed (the matcher is in an error state): let eos end
            # the sequence rather than sample from an all -inf row.
            mask[self.eos_token_id // _BITS] |= 1 << (self.eos_token_id % _BITS)
        return mask

    def check_drafts(self, drafts: list[int], end_token_ids: frozenset[int]) -> CheckedDrafts:
        """Walk speculative guesses through the matcher and roll it back: its
        state afterwards is what it was, so accept() stays the one place it
        advances. An end-of-sequence guess (eos_token_id, end_token_ids) is
        never kept: the matcher counts such a token in its history only while
        the grammar is not yet stopped, so rolling it back could not be exact,
        and the target samples it at that position anyway."""
        masks = [self.next_bitmask()]
        if self.matcher.is_stopped():
            return CheckedDrafts([], masks)
        # validate_tokens changes nothing, where a refused consume_token would
        # leave the matcher in its error state for good.
        valid = self.matcher.validate_tokens(drafts)
        kept: list[int] = []
        for token in drafts[:valid]:
            if token == self.eos_token_id or token in end_token_ids or not allows(masks[-1], token):
                break
            if not self.matcher.consume_token(token):
                # Never expected (validated); the error stays and accept() reports it.
                break
            kept.append(token)
            masks.append(self.next_bitmask())
            if self.matcher.is_stopped():  # the grammar is complete: nothing may follow
                break
        if kept:
            self.matcher.rollback(len(kept))  # a failure is an error state, which accept() reports
        return CheckedDrafts(kept, masks)

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token; afterwards check `done` and `error`."""
        self.matcher.consume_token(token_id)

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return str(self.matcher.get_error()) if self.matcher.is_error() else None
