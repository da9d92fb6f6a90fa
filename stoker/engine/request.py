"""One sequence the engine is working on: its tokens, progress, blocks and timestamps."""

from __future__ import annotations

import time
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from stoker.engine.params import (
    EngineCoreOutput,
    FinishReason,
    KVTransferParams,
    RequestTimes,
    SamplingParams,
    TokenLogprob,
)
from stoker.engine.sampler import PreparedParams, prepare

if TYPE_CHECKING:
    from stoker.engine.detokenizer import IncrementalDetokenizer
    from stoker.engine.reasoning import SequenceReasoning
    from stoker.engine.structured import SequenceGrammar


class RequestStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    PREEMPTED = auto()
    FINISHED = auto()


class Request:
    """A single sample being generated. A prompt with n > 1 becomes n Requests
    that share the prompt (and, through the prefix cache, its KV blocks)."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        deadline: float | None = None,
        max_tokens: int = 16,
        generator: torch.Generator | None = None,
        prepared: PreparedParams | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.prepared = prepared
        """params' lists as sets and tensors (stoker/engine/sampler.py): built once
        per request by EngineCore.add_request and shared by its samples (or by
        Scheduler.add), so checking a token costs the same whatever the lists' lengths."""
        self.priority = priority
        self.lora_name = lora_name
        """The LoRA adapter its tokens run with (kept across preemption); None: the base model."""
        self.hash_root: bytes | None = None
        """Where its prefix-cache hash chain starts: None for the base, its adapter's root
        (stoker/engine/lora_registry.py) set by the scheduler each time it is admitted."""
        self.kv_transfer: KVTransferParams | None = None
        """Sample 0 of a request a PD router split: its prompt's KV blocks are parked for a decode worker
        (send) or pulled from a prefill worker (stoker/engine/kv_transfer*.py)."""
        self.deadline = deadline
        self.max_tokens = max_tokens
        """params.max_tokens resolved against the context length."""
        self.generator = generator
        self.arrival_time = arrival_time
        self.arrival_seq = 0
        """Tie-breaker in arrival order, set by the scheduler."""
        self.status = RequestStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        """Prompt tokens served by the prefix cache on first scheduling; -1 until then."""
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.times = RequestTimes(arrival=arrival_time)
        self.detokenizer: IncrementalDetokenizer | None = None
        self.pending_logprobs: list[TokenLogprob] = []
        self.pending_token_ids: list[int] = []
        """Tokens sampled since the last output was emitted."""
        self.pending_text = ""
        self.prompt_logprobs: list[TokenLogprob | None] = [None]
        """With params.prompt_logprobs: one entry per prompt token scored so far
        (the first has no context, so None). Sample 0 alone scores and sends
        them, with its first delta; samples 1..n-1 share its cached prompt."""
        self.prompt_logprobs_sent = False
        self.num_draft_tokens = 0
        """Speculative tokens verified for this sequence (stoker/engine/spec/)."""
        self.num_accepted_draft_tokens = 0
        self.grammar: SequenceGrammar | None = None
        """With params.grammar: this sequence's matcher, advanced by every appended
        token (by the scheduler); kept across preemption, which keeps the tokens."""
        self.reasoning: SequenceReasoning | None = None
        """With params.reasoning: this sequence's phases and thinking text
        (stoker/engine/reasoning.py); self.detokenizer then sees the answer only."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.pending_token_ids.append(token_id)
        if self.reasoning is not None:
            self.reasoning.accept(token_id)
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.last_token = now
        self.times.token_times.append(now)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions still to score; such a request computes its whole
        prompt rather than taking prefix-cache hits, which would skip them."""
        return (
            self.index == 0
            and self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    def check_stop(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        """After appending a token: detokenize it and finish on eos, a stop
        token id, a stop string, max_tokens or the context length."""
        token = self.output_token_ids[-1]
        params = self.params
        if self.prepared is None:  # a Request used outside the scheduler
            self.prepared = prepare(params, eos_token_ids)
        reason: FinishReason | None = None
        stop_reason: int | str | None = None
        if self.num_output_tokens >= params.min_tokens and token in self.prepared.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, token
        elif (self.num_output_tokens >= params.min_tokens and not params.ignore_eos and token in eos_token_ids) or (
            self.grammar is not None and self.grammar.done  # the grammar is complete
        ):
            reason = FinishReason.STOP
        elif self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            reason = FinishReason.LENGTH
        stop_string: str | None = None
        if self.detokenizer is not None:
            # The detokenizer holds back text that may start a stop string; finished releases it.
            finished = reason is not None
            # With reasoning, the request's detokenizer is the answer's: thinking tokens go elsewhere.
            tokens = [token] if self.reasoning is None else self.reasoning.route_text(finished)
            if tokens or finished:
                delta = self.detokenizer.add(tokens, finished)
                self.pending_text += delta.text
                stop_string = delta.stop_string
        if stop_string is not None:
            self.finish(FinishReason.STOP, stop_string)
        elif reason is not None:
            self.finish(reason, stop_reason)

    def take_delta(self) -> EngineCoreOutput:
        """What changed since the last delta, as an EngineCoreOutput; resets the pending parts."""
        prompt_logprobs = None
        if (
            self.index == 0
            and self.params.prompt_logprobs is not None
            and not self.prompt_logprobs_sent
            and (self.num_output_tokens or self.is_finished)
        ):
            prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        out = EngineCoreOutput(
            request_id=self.request_id,
            index=self.index,
            new_token_ids=self.pending_token_ids,
            new_text=self.pending_text,
            new_logprobs=self.pending_logprobs if self.params.logprobs is not None else None,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=max(self.num_cached_tokens, 0),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
            times=self.times if self.is_finished else None,
            prompt_logprobs=prompt_logprobs,
            num_draft_tokens=self.num_draft_tokens if self.is_finished else 0,
            num_accepted_draft_tokens=self.num_accepted_draft_tokens if self.is_finished else 0,
            new_reasoning_text=self.reasoning.take_text() if self.reasoning is not None else "",
            num_reasoning_tokens=self.reasoning.state.num_tokens if self.reasoning is not None else 0,
        )
        self.pending_token_ids, self.pending_logprobs, self.pending_text = [], [], ""
        return out

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.times.finished = time.time()

    def sort_key(self) -> tuple[int, float, float, int]:
        """Service order: priority class, then earliest deadline, then arrival."""
        deadline = self.deadline if self.deadline is not None else float("inf")
        return (self.priority, deadline, self.arrival_time, self.arrival_seq)
