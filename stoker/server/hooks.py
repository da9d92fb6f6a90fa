"""Where control (keys, limits, admission) and observability plug into the
request path, without the server knowing what they do.

  before(request)            every /v1/* and tokenizer call, before the body is
                             used: authenticate, rate-limit. Raise to refuse.
  admit(request, info)       generation requests after tokenization, when the
                             prompt size is known and before the engine sees
                             them: token limits, admission. Raise to refuse. May
                             set request.state.priority / request.state.deadline.
  finished(record)           once per generation request, however it ended:
                             usage ledger, metrics, log line, trace.
  operator(request)          operations that change the server for every client
                             (POST /flush_cache, /admin/models): authorise an operator. Raise to refuse.
  fallback(event)            a request served by a fallback model: count it.

A stoker.errors.APIError raised by a hook becomes that HTTP response.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from stoker.control.cost import RequestCost
from stoker.engine.params import RequestTimes

logger = logging.getLogger(__name__)


@dataclass
class AdmissionInfo:
    endpoint: str
    """"chat", "completion", "responses", "messages" or "embedding"."""
    model: str
    prompt_tokens: int
    """Sum over the request's prompts (a completion may carry several)."""
    max_tokens: int
    """Upper bound on generated tokens per sample."""
    n: int
    stream: bool
    priority: int | str | None = None
    """The body's `priority` as given (validated by the request model); None if absent."""
    timeout: float | None = None
    """The body's `timeout` in seconds; None if absent."""
    prompts: int = 1
    """Prompts in the request (a completion may carry several), each sampled n times."""

    @property
    def cost(self) -> RequestCost:
        """The request's whole cost: what admission, rate limits and budgets see."""
        return RequestCost(self.prompt_tokens, self.max_tokens, self.n, self.prompts)


@dataclass
class FinishedRecord:
    request_id: str
    endpoint: str
    model: str
    status: int
    """HTTP status the client saw (200 for a stream that later failed; see error)."""
    model_version: str | None = None
    """The version of the model that served it ("v1", "v2", ...)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    times: list[RequestTimes] = field(default_factory=list)
    """Engine-stamped times per sample (queue, first token, tokens, finish)."""
    error: str | None = None
    """None on success; "deadline" when the engine dropped or cut the request at
    its deadline (504 if no token was sent, else finish_reason "abort")."""
    stream: bool = False
    started: float = 0.0
    """time.time() when the server received the request."""
    http_request: Request | None = None
    """For request.state set by the before/admit hooks (key id, trace span, ...)."""
    draft_tokens: int = 0
    """Speculative draft tokens verified for the request's samples (0: none)."""
    accepted_draft_tokens: int = 0
    engine_request_id: str | None = None
    """The engine's id for the request: request_id (the server's own id), suffixed
    only if that id is still in flight; "-<i>" is appended per prompt when there are several."""
    charged: bool = True
    """Whether its usage counts against its key; False for a prefill worker's half of a split request."""


@dataclass(frozen=True)
class FallbackEvent:
    asked: str
    """The model the request named."""
    served: str
    """The model in its fallback chain that answered."""
    reason: str
    """"unavailable" (engine down, restarting, loading) or "overloaded" (its admission answered 503)."""


BeforeHook = Callable[[Request], Awaitable[None]]
AdmitHook = Callable[[Request, AdmissionInfo], Awaitable[None]]
FinishedHook = Callable[[FinishedRecord], Any]
FallbackHook = Callable[[FallbackEvent], Any]


@dataclass
class ServerHooks:
    before: list[BeforeHook] = field(default_factory=list)
    admit: list[AdmitHook] = field(default_factory=list)
    finished: list[FinishedHook] = field(default_factory=list)
    operator: list[BeforeHook] = field(default_factory=list)
    fallback: list[FallbackHook] = field(default_factory=list)

    async def run_before(self, request: Request) -> None:
        for hook in self.before:
            await hook(request)

    async def run_operator(self, request: Request) -> None:
        for hook in self.operator:
            await hook(request)

    async def run_admit(self, request: Request, info: AdmissionInfo) -> None:
        for hook in self.admit:
            await hook(request, info)

    def run_finished(self, record: FinishedRecord) -> None:
        for hook in self.finished:
            try:
                hook(record)
            except Exception:  # a broken metric must never break a response
                logger.exception("finished hook failed")

    def run_fallback(self, event: FallbackEvent) -> None:
        for hook in self.fallback:
            try:
                hook(event)
            except Exception:
                logger.exception("fallback hook failed")
