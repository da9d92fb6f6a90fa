"""One sequence the engine is working on: its tokens, progress, blocks and timestamps."""

from __future__ import annotations

import time
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from stoker.engine.params import (
    FinishReason,
    RequestTimes,
    SamplingParams,
    TokenLogprob,
)

if TYPE_CHECKING:
    from stoker.engine.detokenizer import IncrementalDetokenizer


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
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.priority = priority
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
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.last_token = now
        self.times.token_times.append(now)

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
