"""A thinking model's reply, one sequence at a time: thinking first, then the
answer, kept apart (SamplingParams.reasoning, a ReasoningParams).

The phases follow from the output tokens alone, so preemption (which keeps
the tokens) keeps them, and speculation only has to stop where they change:

    AWAITING   before the first output token, when the model may open its
               thinking: a first token equal to start_token_ids[0] opens it
               (the rest of a multi-token start marker is then forced), any
               other first token is the answer's, and there is no thinking.
    THINKING   from the first output token with thinking_open, else after the
               start marker. Every token counts in num_tokens (markers
               included); tokens that may begin the end marker are held back
               from the text until the marker completes or fails to.
    ANSWER     after the end marker. Only answer tokens reach the grammar and
               the answer's detokenizer (so stop strings apply to it alone).

A budget ends the thinking: once it holds `budget` tokens (the start marker
not counted) without the end marker, each next token is forced to be the
rest of the end marker, through a one-token bitmask on the path the grammar's
masks take, so logprobs, penalties and verification of drafts see it as any
constrained step. eos and stop token ids end a sequence in either phase;
max_tokens bounds thinking and answer together.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from enum import Enum, auto

import torch

from stoker.engine.detokenizer import IncrementalDetokenizer
from stoker.engine.params import ReasoningParams, SamplingParams
from stoker.engine.structured import SequenceGrammar, bitmask_words
from stoker.models.tokenizer import Tokenizer

_BITS = 32


class Phase(Enum):
    AWAITING = auto()
    THINKING = auto()
    ANSWER = auto()


@dataclass
class Routed:
    """Where one output token's tokens go (a held token is released later)."""

    thinking: list[int] = field(default_factory=list)
    """Thinking tokens now known not to be part of the end marker: for the thinking text."""
    answer: list[int] = field(default_factory=list)
    """Answer tokens: for the grammar and the answer text."""
    thinking_ended: bool = False
    """This token completed the end marker: no more thinking text will come."""


def _set_bit(mask: torch.Tensor, token_id: int) -> None:
    mask[token_id // _BITS] |= 1 << (token_id % _BITS)


class ReasoningState:
    """The phase machine of one sequence, over token ids only."""

    def __init__(self, params: ReasoningParams, vocab_size: int) -> None:
        self.params = params
        self.vocab_size = vocab_size
        if params.thinking_open:
            self.phase = Phase.THINKING
        elif params.start_token_ids:
            self.phase = Phase.AWAITING
        else:
            self.phase = Phase.ANSWER
        self.num_tokens = 0
        """Thinking tokens so far, markers included (usage's reasoning_tokens)."""
        self.num_budgeted = 0
        """Thinking tokens the budget counts: all but the start marker."""
        self._start_matched = 0
        self._end = list(params.end_token_ids)
        self._held: list[int] = []
        """The output's last tokens while they are a proper prefix of the end marker."""

    @property
    def answering(self) -> bool:
        return self.phase is Phase.ANSWER

    def forced_token(self) -> int | None:
        """The token the next position must be: the rest of a start marker
        whose first token came, or of the end marker once the budget is spent."""
        params = self.params
        if self.phase is Phase.AWAITING and self._start_matched:
            return params.start_token_ids[self._start_matched]
        if self.phase is Phase.THINKING and params.budget is not None and self.num_budgeted >= params.budget:
            return params.end_token_ids[len(self._held)]
        return None

    def accept(self, token_id: int) -> Routed:
        """Advance by one output token; says where it (and any token it releases) goes."""
        params = self.params
        if self.phase is Phase.AWAITING:
            if token_id == params.start_token_ids[self._start_matched]:
                self._start_matched += 1
                self.num_tokens += 1
                if self._start_matched == len(params.start_token_ids):
                    self.phase = Phase.THINKING
                return Routed()
            self.phase = Phase.ANSWER  # only the first token can differ: the rest is forced
        if self.phase is Phase.ANSWER:
            return Routed(answer=[token_id])
        self.num_tokens += 1
        self.num_budgeted += 1
        end = self._end
        if not self._held and token_id != end[0]:  # the common case: plain thinking
            return Routed(thinking=[token_id])
        held = self._held + [token_id]
        if held == end:
            self._held = []
            self.phase = Phase.ANSWER
            return Routed(thinking_ended=True)
        # Keep the longest suffix that may still begin the end marker; the rest is thinking.
        keep = next(k for k in range(min(len(held), len(end) - 1), -1, -1) if held[len(held) - k :] == end[:k])
        self._held = held[len(held) - keep :]
        return Routed(thinking=held[: len(held) - keep])

    def release_held(self) -> list[int]:
        """On finishing while thinking: the tokens held as a possible end marker were thinking."""
        held, self._held = self._held, []
        return held

    def step_bitmask(self, grammar: SequenceGrammar | None) -> torch.Tensor | None:
        """The next position's mask (int32 words, as the grammar's), or None when unconstrained."""
        forced = self.forced_token()
        if forced is not None:
            mask = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
            _set_bit(mask, forced)
            return mask
        if grammar is None or self.phase is Phase.THINKING:
            return None
        mask = grammar.next_bitmask()
        if self.phase is Phase.AWAITING:
            # The answer's grammar, or the thinking's opening.
            _set_bit(mask, self.params.start_token_ids[0])
        return mask

    @property
    def may_draft(self) -> bool:
        """Whether speculative tokens may follow this step's first position (a
        forced or awaiting position is decided one step at a time)."""
        return self.phase is not Phase.AWAITING and self.forced_token() is None

    def drafts_within_phase(self, drafts: list[int], constrained: bool) -> int:
        """How many of the guesses to verify while thinking: each position the
        step samples after them must need no mask (verification gives them
        none), so the guesses stop before the budget forces a token and, with
        a grammar, before the answer starts. The target then samples the
        token at that point itself, exactly as without speculation."""
        walk = copy.copy(self)
        walk._held = list(self._held)
        for kept, token in enumerate(drafts):
            walk.accept(token)
            if walk.forced_token() is not None or (constrained and walk.answering):
                return kept
        return len(drafts)


class SequenceReasoning:
    """One sequence's phases and its thinking text, detokenized apart from the
    answer: the concatenated thinking text is decode(thinking tokens, markers
    left out), with the detokenizer's guarantees, and the answer's
    detokenizer (the request's own) sees only answer tokens."""

    def __init__(
        self,
        params: SamplingParams,
        reasoning: ReasoningParams,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        vocab_size: int,
    ) -> None:
        self.state = ReasoningState(reasoning, vocab_size)
        # Stop strings apply to the answer only.
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, replace(params, stop=[]))
        self.pending_text = ""
        """Thinking text since the last delta."""
        self.last = Routed()
        """Where the latest output token went."""

    def accept(self, token_id: int) -> Routed:
        self.last = self.state.accept(token_id)
        return self.last

    def route_text(self, finished: bool) -> list[int]:
        """After accept: the latest token's thinking text into pending_text;
        returns its answer tokens, for the answer's detokenizer."""
        routed = self.last
        thinking = routed.thinking
        if finished and self.state.phase is Phase.THINKING:
            thinking = thinking + self.state.release_held()
        if thinking or finished or routed.thinking_ended:
            self.pending_text += self.detokenizer.add(thinking, finished or routed.thinking_ended).text
        return routed.answer

    def take_text(self) -> str:
        text, self.pending_text = self.pending_text, ""
        return text
