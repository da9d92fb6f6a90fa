"""RequestGate: the request path through the control layer in two calls.

    adm = await gate.admit(...)   # model allowed? budget? rate limits? capacity?
    ...  run the request in the engine with adm.priority / adm.deadline ...
    gate.finish(adm, finished)    # reconcile limits; ledger row, metrics, log line, trace

Order of checks at admission: the key's own quota first (403 model, 429
budget, 429 rate/concurrency), capacity last (503), so a client over its
quota is told so even when the server is busy, and a capacity refusal
refunds what the rate limiter had taken.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request

from stoker.control.admission import AdmissionController, QueueView, Ticket
from stoker.control.budgets import STORE_RETRY_AFTER, BudgetExceeded, DatabaseUnavailable, SharedBudgets
from stoker.control.cost import RequestCost
from stoker.control.keys import ApiKey
from stoker.control.ledger import UsageLedger, period_end
from stoker.control.limits import Lease, Limiter
from stoker.engine.params import RequestTimes
from stoker.errors import APIError
from stoker.observe.logs import RequestLogger, RequestRecord
from stoker.observe.metrics import Metrics
from stoker.observe.tracing import RequestTracer


class FinishedRequest(Protocol):
    """What the gate reads of a request's end. The server's FinishedRecord
    (stoker/server/hooks.py) is one; control declares what it needs rather than
    import the layer above it."""

    @property
    def request_id(self) -> str: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def status(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...
    @property
    def finish_reasons(self) -> list[str]: ...
    @property
    def times(self) -> list[RequestTimes]: ...
    @property
    def error(self) -> str | None: ...
    @property
    def stream(self) -> bool: ...
    @property
    def http_request(self) -> Request | None: ...
    @property
    def draft_tokens(self) -> int: ...
    @property
    def accepted_draft_tokens(self) -> int: ...
    @property
    def engine_request_id(self) -> str | None: ...
    @property
    def charged(self) -> bool: ...


@dataclass
class Admission:
    request_id: str
    key: ApiKey | None
    model: str
    priority: int
    deadline: float | None
    prompt_tokens: int
    estimated_tokens: int
    arrival: float
    admitted_at: float
    lease: Lease
    ticket: Ticket
    trace_headers: dict[str, str] = field(default_factory=dict)
    done: bool = False
    reservation: str | None = None
    """Its budget reservation in the shared database (settled by its ledger row)."""
    reserved_here: bool = False
    """Its estimate is reserved of its key's budget in this process (_reserved) until it finishes."""

    @property
    def headers(self) -> dict[str, str]:
        """x-ratelimit-* headers to put on the response."""
        return self.lease.headers


class RequestGate:
    def __init__(
        self,
        limiter: Limiter,
        admission: AdmissionController,
        ledger: UsageLedger | None = None,
        metrics: Metrics | None = None,
        request_log: RequestLogger | None = None,
        tracer: RequestTracer | None = None,
        budgets: SharedBudgets | None = None,
        on_store_failure: str = "closed",
    ) -> None:
        self.limiter = limiter
        self.budgets = budgets
        """Budget reservations in a database shared by replicas; None: in this process (_reserved)."""
        self.on_store_failure = on_store_failure
        self.admission = admission
        self.model_admission: dict[str, AdmissionController] = {}
        """Each model's own queue bound, once the server serves several (others use `admission`)."""
        self.ledger = ledger
        self.metrics = metrics
        self.request_log = request_log
        self.tracer = tracer
        self._reserved: dict[str, int] = {}  # key id -> estimated tokens of its in-flight requests
        self._exhausted: dict[str, float] = {}  # key id -> end of the period it ran out in
        self.in_flight = 0

    # -- admission ---------------------------------------------------------------

    def admission_for(self, model: str) -> AdmissionController:
        return self.model_admission.get(model, self.admission)

    def controllers(self) -> list[AdmissionController]:
        # One per engine queue: a LoRA adapter's name shares its base's controller.
        return list({id(c): c for c in [self.admission, *self.model_admission.values()]}.values())

    def queue(self) -> QueueView:
        """What waits for every model's engine together."""
        views = [c.queue() for c in self.controllers()]
        return QueueView(sum(v.requests for v in views), sum(v.tokens for v in views))

    async def admit(
        self,
        *,
        request_id: str,
        key: ApiKey | None,
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        priority: int = 0,
        deadline: float | None = None,
        n: int = 1,
        prompts: int = 1,
        arrival: float | None = None,
        headers: Mapping[str, str] | None = None,
        capacity: bool = True,
    ) -> Admission:
        """Admit or raise APIError (403/429/503); a refusal is counted,
        logged and traced here. priority/deadline come from stoker.control.policy.
        The request's whole cost (RequestCost: its prompts, n samples each, up to
        max_tokens per sample) is what the budget, the rate limits and the queue see;
        it holds one of the key's concurrency slots per prompt.
        capacity=False skips the engine-queue check (work that never enters the
        engine's queue, such as embeddings) but keeps the key's quotas."""
        arrival = arrival if arrival is not None else time.time()
        trace_headers = {k: v for k, v in (headers or {}).items() if k.lower() in ("traceparent", "tracestate")}
        cost = RequestCost(prompt_tokens, max_tokens, n, prompts)
        estimate = cost.tokens
        reservation: str | None = None
        local = False
        try:
            if key is not None:
                if not key.allows_model(model):
                    raise APIError(
                        403,
                        f"This API key may not use the model '{model}'.",
                        "permission_error",
                        code="model_not_allowed",
                        param="model",
                        reason="model",
                    )
                reservation, local = await self._check_budget(key, arrival, estimate)
            try:
                lease = await self.limiter.acquire(key, estimate, cost.prompts)
                try:
                    queue = self.admission_for(model)
                    ticket = queue.admit(cost.queued_tokens, priority) if capacity else Ticket(arrival, 0, visible=True)
                except APIError:
                    self.limiter.release(lease, None)
                    raise
            except APIError:
                if reservation is not None and self.budgets is not None:
                    await asyncio.to_thread(self.budgets.release, reservation)
                if local and key is not None:
                    self._unreserve(key.id, estimate)
                raise
        except APIError as exc:
            self._count_refusal(exc)
            self.refused(
                exc,
                request_id=request_id,
                key=key,
                model=model,
                arrival=arrival,
                headers=trace_headers,
                prompt_tokens=prompt_tokens,
                priority=priority,
            )
            raise
        self.in_flight += 1
        if self.metrics:
            self.metrics.in_flight.set(self.in_flight)
            q = self.queue()
            self.metrics.queued_requests.set(q.requests)
            self.metrics.queued_tokens.set(q.tokens)
        return Admission(
            request_id,
            key,
            model,
            priority,
            deadline,
            prompt_tokens,
            estimate,
            arrival,
            time.time(),
            lease,
            ticket,
            trace_headers,
            reservation=reservation,
            reserved_here=local,
        )

    async def _check_budget(self, key: ApiKey, now: float, estimate: int) -> tuple[str | None, bool]:
        """Reserve the request's estimate of the key's budget or refuse (429):
        (the shared reservation made, if any; whether it was reserved in this process).
        Admitted only if used + reserved + estimate <= budget, so settlement (at most
        the estimate) can never take a key past its budget."""
        if key.budget_tokens is None or self.ledger is None:
            return None, False
        if self.budgets is not None:
            return await self._reserve_shared(key, now, estimate), False
        used = self.ledger.used_cached(key.id, key.budget_period, now)
        if used is None:
            # First check this period: one query, off the event loop.
            used = await asyncio.to_thread(self.ledger.used, key.id, key.budget_period, now)
        # From here to the reservation nothing awaits: two requests of one key
        # cannot both pass the check on the same remainder.
        reserved = self._reserved.get(key.id, 0)
        if self.metrics:
            self.metrics.set_budget_remaining(key.id, key.name, max(0, key.budget_tokens - used))
        if used + reserved + estimate > key.budget_tokens:
            raise self._over_budget(key, now, used, reserved, estimate)
        self._reserved[key.id] = reserved + estimate
        return None, True

    def _unreserve(self, key_id: str, estimate: int) -> None:
        left = self._reserved.get(key_id, 0) - estimate
        if left > 0:
            self._reserved[key_id] = left
        else:
            self._reserved.pop(key_id, None)

    async def _reserve_shared(self, key: ApiKey, now: float, estimate: int) -> str | None:
        assert self.budgets is not None and key.budget_tokens is not None
        try:
            reservation, used = await asyncio.to_thread(
                self.budgets.reserve, key.id, key.budget_tokens, key.budget_period, estimate, now
            )
        except BudgetExceeded as exc:
            if self.metrics:
                self.metrics.set_budget_remaining(key.id, key.name, max(0, key.budget_tokens - exc.used))
            raise self._over_budget(key, now, exc.used, exc.reserved, estimate) from None
        except DatabaseUnavailable:
            if self.on_store_failure == "open":
                return None  # admitted unmetered against the budget; the outage is logged once
            raise APIError(
                503,
                "The key and budget database is unreachable; please retry shortly.",
                "service_unavailable",
                code="store_unavailable",
                reason="store_unavailable",
                retry_after=STORE_RETRY_AFTER,
            ) from None
        if self.metrics:
            self.metrics.set_budget_remaining(key.id, key.name, max(0, key.budget_tokens - used))
        return reservation

    def _over_budget(self, key: ApiKey, now: float, used: int, reserved: int, estimate: int) -> APIError:
        budget = key.budget_tokens
        assert budget is not None
        end = period_end(key.budget_period, now)
        state = f"({used} used, {reserved} reserved by requests in flight)"
        if estimate > budget:
            # No period could ever admit it: no Retry-After, only what to change.
            return APIError(
                429,
                f"Request too large for this key's budget of {budget} tokens per {key.budget_period}: "
                f"Limit {budget}, Requested {estimate} (its prompt tokens plus prompts x n x max_tokens). "
                "Lower max_tokens, n or the number of prompts.",
                "insufficient_quota",
                code="insufficient_quota",
                reason="budget",
            )
        if used >= budget:
            self._exhausted[key.id] = end
            self._update_exhausted(now)
            message = f"This key has used its budget of {budget} tokens for the {key.budget_period} {state}."
        else:
            message = (
                f"This request may use up to {estimate} tokens (its prompt tokens plus prompts x n x max_tokens), "
                f"more than is left of this key's budget of {budget} tokens for the {key.budget_period} {state}."
            )
        return APIError(
            429,
            message,
            "insufficient_quota",
            code="insufficient_quota",
            reason="budget",
            # Only if it fits once the requests in flight settle (at most their estimate) may
            # waiting for them help; otherwise the period must end.
            retry_after=(1 if used + estimate <= budget else end - now),
        )

    def _update_exhausted(self, now: float) -> None:
        for key_id, end in list(self._exhausted.items()):
            if end <= now:
                del self._exhausted[key_id]
        if self.metrics:
            self.metrics.budget_exhausted_keys.set(len(self._exhausted))

    def _count_refusal(self, exc: APIError) -> None:
        if self.metrics is None:
            return
        if exc.status == 503:
            self.metrics.admission_rejections.labels(exc.reason).inc()
        elif exc.status == 429:
            self.metrics.rate_limit_rejections.labels(exc.reason).inc()
        elif exc.status in (401, 403):
            self.metrics.auth_failures.labels(exc.reason).inc()
        self.metrics.observe_error(exc.status)

    # -- the end of a request ----------------------------------------------------

    def finish(self, adm: Admission, finished: FinishedRequest, *, generation: bool = True) -> None:
        """Call exactly once per admission, in a finally block, whatever
        happened (success, error, disconnect, drain); a second call is ignored.

        finished: the server's record of the request's end (its FinishedRecord):
        tokens so far (all n samples, also when cut off), the engine's stamps of each
        sample as far as it got, one finish reason per finished sample.
        generation: False for work outside the engine's queue (embeddings):
        no vllm: request metrics, no drain-rate sample."""
        if adm.done:
            return
        adm.done = True
        now = time.time()
        prompt = finished.prompt_tokens
        completion_tokens = finished.completion_tokens
        samples = list(finished.times)
        first = samples[0] if samples else None
        reasons = list(finished.finish_reasons)
        finish_reason = reasons[0] if reasons else None
        status, error = finished.status, finished.error
        # Metered unless it was dropped while still waiting (e.g. at its
        # deadline): then it used no compute.
        ran = not (bool(samples) and all(t.scheduled is None for t in samples) and completion_tokens == 0)
        # A request that used nothing is refunded entirely, the request itself included; so is a
        # prefill worker's half of a split request, which the decode worker's half is charged for.
        self.limiter.release(adm.lease, prompt + completion_tokens if ran and finished.charged else None)
        settles = self.ledger is not None and finished.charged  # its ledger row settles the reservation
        if adm.reservation is not None and not settles and self.budgets is not None:
            self.budgets.release(adm.reservation)
        if adm.reserved_here and adm.key is not None:
            # The ledger's running total holds its usage from the record() below on;
            # nothing awaits in between, so no admission sees it counted twice or not at all.
            self._unreserve(adm.key.id, adm.estimated_tokens)
        queue = self.admission_for(adm.model)
        queue.mark_visible(adm.ticket)
        if ran and generation:
            # In the queue's unit (each sample's prompt), as the ticket counted it.
            queue.record_finished(adm.ticket.prompt_tokens, now)
        self.in_flight -= 1
        http_request = finished.http_request
        record = RequestRecord(
            request_id=adm.request_id,
            status=status,
            model=adm.model,
            key_id=adm.key.id if adm.key else None,
            key_name=adm.key.name if adm.key else None,
            method=http_request.method if http_request is not None else None,
            path=http_request.url.path if http_request is not None else None,
            prompt_tokens=prompt,
            cached_tokens=finished.cached_tokens,
            completion_tokens=completion_tokens,
            queue_time=_queue_time(first),
            ttft=_ttft(first),
            latency=now - adm.arrival,
            finish_reason=finish_reason,
            priority=adm.priority,
            stream=finished.stream,
            error=error,
            metered=ran,
            created_at=now,
            reservation_id=adm.reservation,
        )
        if self.ledger is not None and finished.charged:
            self.ledger.record(record)
        if self.metrics is not None:
            self._finish_metrics(adm, samples, prompt, completion_tokens, reasons, status, error, ran and generation)
        if self.request_log is not None:
            self.request_log.log(record, **_log_context(finished))
        if self.tracer is not None and self.tracer.enabled:
            self.tracer.record(
                request_id=adm.request_id,
                headers=adm.trace_headers,
                start=adm.arrival,
                end=now,
                admitted_at=adm.admitted_at,
                times=first,
                error=error if status >= 400 or error else None,
                attributes=_trace_attrs(
                    adm.model,
                    adm.key,
                    prompt,
                    completion_tokens,
                    finished.cached_tokens,
                    finish_reason,
                    status,
                    adm.priority,
                ),
            )

    def _finish_metrics(
        self,
        adm: Admission,
        samples: list[RequestTimes],
        prompt: int,
        completion: int,
        reasons: list[str],
        status: int,
        error: str | None,
        observe: bool,
    ) -> None:
        m = self.metrics
        assert m is not None
        m.in_flight.set(self.in_flight)
        if error == "deadline":
            started = any(t.first_token is not None for t in samples)
            m.deadline_drops.labels("running" if started else "queue").inc()
        if observe and status < 400:
            # Token histograms once per request; latencies and outcomes once per sample.
            m.observe_finished(
                samples[0] if samples else None, prompt, completion, reasons[0] if reasons else None, adm.model
            )
            for i, t in enumerate(samples[1:], start=1):
                m.observe_sample(t, reasons[i] if i < len(reasons) else None, adm.model)
        elif status >= 400:
            m.observe_error(status)
        if adm.key is not None and adm.key.budget_tokens is not None and self.ledger is not None:
            used = self.ledger.used_cached(adm.key.id, adm.key.budget_period)
            if used is not None:
                m.set_budget_remaining(adm.key.id, adm.key.name, max(0, adm.key.budget_tokens - used))

    def refused(
        self,
        exc: APIError,
        *,
        request_id: str,
        key: ApiKey | None = None,
        model: str | None = None,
        arrival: float | None = None,
        headers: Mapping[str, str] | None = None,
        prompt_tokens: int | None = None,
        priority: int | None = None,
        method: str | None = None,
        path: str | None = None,
    ) -> None:
        """Log and trace a request refused before it was admitted."""
        now = time.time()
        arrival = arrival if arrival is not None else now
        if self.request_log is not None:
            self.request_log.log(
                RequestRecord(
                    request_id=request_id,
                    status=exc.status,
                    model=model,
                    key_id=key.id if key else None,
                    key_name=key.name if key else None,
                    method=method,
                    path=path,
                    prompt_tokens=prompt_tokens,
                    latency=now - arrival,
                    priority=priority,
                    error=exc.code or exc.type,
                ),
                reason=exc.reason,
            )
        if self.tracer is not None and self.tracer.enabled:
            self.tracer.record(
                request_id=request_id,
                headers=headers,
                start=arrival,
                end=now,
                error=exc.code or exc.type,
                attributes=_trace_attrs(model, key, prompt_tokens, None, None, None, exc.status, priority),
            )


def _log_context(finished: FinishedRequest) -> dict[str, object]:
    """The log line's fields beyond the record: which API, the engine's id and, where
    it speculated, draft tokens and acceptance. None for an admission the server never
    finished (no endpoint: ControlMiddleware closed it)."""
    if not finished.endpoint:
        return {}
    context: dict[str, object] = {
        "endpoint": finished.endpoint,
        "engine_request_id": finished.engine_request_id or finished.request_id or None,
    }
    drafted = finished.draft_tokens
    if drafted:
        accepted = finished.accepted_draft_tokens
        context.update(
            spec_draft_tokens=drafted, spec_accepted_tokens=accepted, spec_acceptance=round(accepted / drafted, 3)
        )
    return context


def _queue_time(times: RequestTimes | None) -> float | None:
    return times.scheduled - times.arrival if times and times.scheduled is not None else None


def _ttft(times: RequestTimes | None) -> float | None:
    return times.first_token - times.arrival if times and times.first_token is not None else None


def _trace_attrs(
    model: str | None,
    key: ApiKey | None,
    prompt: int | None,
    completion: int | None,
    cached: int | None,
    finish_reason: str | None,
    status: int,
    priority: int | None,
) -> dict[str, Any]:
    # gen_ai.* follow OpenTelemetry's GenAI semantic conventions.
    return {
        "gen_ai.system": "stoker",
        "gen_ai.request.model": model,
        "gen_ai.usage.input_tokens": prompt,
        "gen_ai.usage.output_tokens": completion,
        "stoker.cached_tokens": cached,
        "gen_ai.response.finish_reasons": [finish_reason] if finish_reason else None,
        "http.response.status_code": status,
        "stoker.key_id": key.id if key else None,
        "stoker.priority": priority,
    }
