"""ControlPlane: every control and observability part, built from one
settings object, with the lifecycle the server's lifespan needs.

    plane = ControlPlane.open(ControlSettings(db=..., require_auth=...))
    app.state.control = plane          # auth dependencies and admin routes find it here
    ...
    plane.close()                      # at shutdown: flushes the usage ledger

Open mode: when the database holds no active key (and --require-auth is not
given) the server accepts unauthenticated requests and says so loudly. The
first key created (CLI or admin API) switches authentication on within
`key_cache_ttl` seconds, without a restart; revoking every key later never
switches it off again.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy.exc import DBAPIError

from stoker.control.admission import AdmissionController
from stoker.control.budgets import SharedBudgets
from stoker.control.db import default_db_url, is_shared, open_db, redact_url
from stoker.control.gate import Admission, RequestGate
from stoker.control.keys import ApiKey, KeyStore
from stoker.control.ledger import UsageLedger
from stoker.control.limits import Limiter, RateLimiter
from stoker.control.policy import DEADLINE_HEADER, resolve_deadline, resolve_priority
from stoker.control.settings import ControlSettings
from stoker.engine.params import EngineStats
from stoker.errors import StartupRefused
from stoker.observe.logs import RequestLogger, request_id_of
from stoker.observe.metrics import Metrics
from stoker.observe.tracing import RequestTracer

log = logging.getLogger("stoker.control")

__all__ = ["AuthRequiredButNoKeys", "ControlPlane", "ControlSettings"]


class AuthRequiredButNoKeys(StartupRefused):
    """--require-auth without an active key: `stoker serve` exits 2 with this message."""


def open_limiter(settings: ControlSettings, metrics: Metrics | None = None) -> Limiter:
    """In process, or in the Redis of --redis-url (checked now: StartupRefused if unusable),
    its failed calls counted in metrics."""
    if settings.redis_url is None:
        return RateLimiter()
    from stoker.control.store import RedisRateLimiter, check_redis_url, redact

    check_redis_url(settings.redis_url)
    log.info(
        "rate limits and concurrency in Redis at %s (shared with every replica using it; on failure: %s)",
        redact(settings.redis_url),
        settings.on_store_failure,
    )
    return RedisRateLimiter(
        settings.redis_url,
        on_failure=settings.on_store_failure,
        lease_ttl=settings.redis_lease_ttl,
        count_failure=metrics.store_failure_counter("redis") if metrics is not None else None,
    )


class ControlPlane:
    def __init__(
        self,
        settings: ControlSettings,
        keys: KeyStore,
        ledger: UsageLedger,
        metrics: Metrics,
        tracer: RequestTracer,
        request_log: RequestLogger,
        limiter: Limiter | None = None,
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.ledger = ledger
        self.metrics = metrics
        self.tracer = tracer
        self.request_log = request_log
        self.limiter: Limiter = limiter or RateLimiter()
        self.admission = AdmissionController(
            max_queued_requests=settings.max_queued_requests,
            max_queued_tokens=settings.max_queued_tokens,
            batch_share=settings.batch_queue_share,
        )
        self.gate = RequestGate(self.limiter, self.admission, ledger, metrics, request_log, tracer)
        self._auth_on = settings.require_auth
        self._auth_checked = 0.0
        metrics.ledger_pending.set_function(lambda: ledger.pending)

    @classmethod
    def open(
        cls,
        settings: ControlSettings | None = None,
        tracer: RequestTracer | None = None,
        request_log: RequestLogger | None = None,
    ) -> ControlPlane:
        """Open the database (migrating it), start the ledger writer, check the auth mode.
        Raises AuthRequiredButNoKeys when require_auth is set and no key exists."""
        settings = settings or ControlSettings()
        # Made first so that every store reports its failed calls to it (stoker:store_failures_total).
        metrics = Metrics(settings.model_name, settings.metrics_per_key)
        limiter = open_limiter(settings, metrics)
        engine = open_db(settings.db)
        db_failed = metrics.store_failure_counter("db")
        keys = KeyStore(engine, cache_ttl=settings.key_cache_ttl, count_failure=db_failed)
        ledger = UsageLedger(engine, flush_interval=settings.ledger_flush_interval, count_failure=db_failed)
        plane = cls(
            settings,
            keys,
            ledger,
            metrics,
            tracer or RequestTracer(settings.otlp_endpoint),
            request_log or RequestLogger(),
            limiter,
        )
        active = keys.count_active()
        if settings.require_auth and active == 0:
            engine.dispose()
            raise AuthRequiredButNoKeys(
                f"--require-auth is set but the key database ({settings.db or default_db_url()}) has no active key; "
                "create one with `stoker keys create --name NAME`"
            )
        if is_shared(engine):
            # Replicas share this database: budget reservations live there too.
            budgets = SharedBudgets(engine, count_failure=db_failed)
            plane.gate.budgets = budgets
            plane.gate.on_store_failure = settings.on_store_failure
            budgets.start()
            log.info(
                "budgets reserved in the shared database %s (on failure: %s)",
                redact_url(str(engine.url)),
                settings.on_store_failure,
            )
        plane._auth_on = settings.require_auth or active > 0
        plane._auth_checked = time.monotonic()
        if not plane._auth_on:
            log.warning("=" * 72)
            log.warning("NO API KEYS: stoker is running OPEN; anyone who can reach it can use it.")
            log.warning("Create a key with `stoker keys create --name NAME` (auth switches on by itself)")
            log.warning("or start with --require-auth to refuse to run without keys.")
            log.warning("=" * 72)
        ledger.start()
        return plane

    # -- auth mode ------------------------------------------------------------------

    def auth_enabled(self) -> bool:
        """True once any key exists (a one-way latch); re-checked at most every key_cache_ttl."""
        if self._auth_on:
            return True
        now = time.monotonic()
        if now - self._auth_checked >= self.settings.key_cache_ttl:
            self._auth_checked = now
            try:
                active = self.keys.count_active()
            except DBAPIError as exc:
                # The database is away: keep the last answer (no key yet) rather than fail the
                # request with a 500; the next check after key_cache_ttl asks again.
                if self.keys.count_failure is not None:
                    self.keys.count_failure("key_lookup")
                log.warning("could not count API keys (%s); authentication stays off until the database answers", exc)
                return self._auth_on
            if active > 0:
                self._auth_on = True
                log.warning("an API key now exists: authentication is on")
        return self._auth_on

    # -- request path ---------------------------------------------------------------

    async def admit_http(
        self,
        request: Any,
        key: ApiKey | None,
        *,
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        n: int = 1,
        priority: int | str | None = None,
        timeout: float | None = None,
        arrival: float | None = None,
        capacity: bool = True,
    ) -> Admission:
        """gate.admit for an HTTP request: resolves the request id (request.state.request_id,
        set by RequestIdMiddleware), priority (body field), deadline (x-stoker-deadline-ms
        header or body `timeout`) and trace headers. Raises APIError (400/403/429/503)."""
        return await self.gate.admit(
            request_id=request_id_of(request),
            key=key,
            model=model,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            n=n,
            priority=resolve_priority(key, priority),
            deadline=resolve_deadline(request.headers.get(DEADLINE_HEADER), timeout, self.settings.max_queue_wait),
            arrival=arrival,
            headers=request.headers,
            capacity=capacity,
        )

    # -- engine and lifecycle ---------------------------------------------------------

    def track_model(self, name: str) -> AdmissionController:
        """A model the server serves gets its own admission queue bound (the
        first one the default controller), so one model's full queue refuses
        only its own requests."""
        gate = self.gate
        controller = gate.model_admission.get(name)
        if controller is None:
            if not gate.model_admission:
                controller = self.admission
            else:
                controller = AdmissionController(
                    max_queued_requests=self.settings.max_queued_requests,
                    max_queued_tokens=self.settings.max_queued_tokens,
                    batch_share=self.settings.batch_queue_share,
                )
                controller.draining = self.admission.draining
            gate.model_admission[name] = controller
        return controller

    def update_engine_stats(
        self,
        stats: EngineStats,
        taken_at: float | None = None,
        model: str | None = None,
        source: str | None = None,
        queue: bool = True,
    ) -> None:
        """Feed every fresh EngineStats snapshot here (admission + metrics).
        model: the model it is of (None: the only one); source: which engine
        (a model has several during a swap or canary), so each engine's
        counters are followed apart; queue: whether it is the snapshot of the
        version that admission bounds (the stable one)."""
        if queue:
            (self.track_model(model) if model else self.admission).update(stats, taken_at)
        self.metrics.update_from_engine_stats(stats, model, source, gauges=queue)
        q = self.gate.queue()
        self.metrics.queued_requests.set(q.requests)
        self.metrics.queued_tokens.set(q.tokens)
        self.metrics.drain_rate.set(sum(c.drain_rate()[1] for c in self.gate.controllers()))

    def engine_restarted(self, source: str | None = None) -> None:
        self.metrics.engine_restarted(source)

    def start_drain(self) -> None:
        """Refuse new requests (503) while in-flight ones finish."""
        for controller in self.gate.controllers():
            controller.draining = True
        self.metrics.draining.set(1)

    async def aclose(self) -> None:
        """Let the limiter's last releases land (a shared store) and stop its background work."""
        await self.limiter.aclose()

    def close(self) -> None:
        """Flush the usage ledger and traces. Call after in-flight requests have finished."""
        if self.gate.budgets is not None:
            self.gate.budgets.close()
        self.ledger.close()
        self.tracer.shutdown()
        self.keys.engine.dispose()
