"""ControlPlane: every control and observability part, built from one
settings object, with the lifecycle the server's lifespan needs.

    plane = ControlPlane.open(ControlSettings(db=..., require_auth=...))
    app.state.control = plane          # auth dependencies and admin routes find it here
    ...
    plane.close()                      # at shutdown: flushes the usage ledger

Open mode: while no key has ever been created in the database (and
--require-auth is not given) the server accepts unauthenticated inference
requests (and the read-only router, metrics and docs endpoints), and no
operator action: the admin API, model loading and /flush_cache need a key. The first key created (CLI or admin
API) writes a latch into the database (stoker_flags) and switches
authentication on within `key_cache_ttl` seconds, without a restart; from then
on the server is authenticated for good, across restarts, even when every key
is revoked or has expired. Open mode on an address other than loopback refuses
to start unless --allow-open says it is meant.
"""

from __future__ import annotations

import logging
import time

from fastapi import Request
from sqlalchemy.exc import DBAPIError

from stoker.control.admission import AdmissionController
from stoker.control.budgets import SharedBudgets
from stoker.control.db import is_shared, open_db
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
from stoker.redact import redact_url

log = logging.getLogger("stoker.control")

__all__ = ["AuthRequiredButNoKeys", "ControlPlane", "ControlSettings", "OpenOnPublicAddress"]


class AuthRequiredButNoKeys(StartupRefused):
    """--require-auth without an active key: `stoker serve` exits 2 with this message."""


class OpenOnPublicAddress(StartupRefused):
    """Open mode on an address other than loopback without --allow-open: `stoker serve` exits 2."""


CREATE_FIRST_KEY = "`stoker keys create --name NAME --admin`"


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach: 127.0.0.0/8, ::1, localhost.
    Anything else (0.0.0.0, ::, a name, an interface's address) may be reached from outside."""
    import ipaddress

    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def open_limiter(settings: ControlSettings, metrics: Metrics | None = None) -> Limiter:
    """In process, or in the Redis of --redis-url (checked now: StartupRefused if unusable),
    its failed calls counted in metrics."""
    if settings.redis_url is None:
        return RateLimiter()
    from stoker.control.store import RedisRateLimiter, check_redis_url

    check_redis_url(settings.redis_url)
    log.info(
        "rate limits and concurrency in Redis at %s (shared with every replica using it; on failure: %s)",
        redact_url(settings.redis_url),
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
        self.auth_reason = "--require-auth is set" if settings.require_auth else ""
        """Why the server is in the mode it is in, for the start line and the log."""
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
        where = redact_url(str(engine.url))
        try:
            latch = keys.latch()
            active = keys.count_active()
        except DBAPIError as exc:
            engine.dispose()
            reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
            raise StartupRefused(f"--db {where}: cannot read the keys ({reason})") from None
        if settings.require_auth and active == 0:
            engine.dispose()
            raise AuthRequiredButNoKeys(
                f"--require-auth is set but the key database ({where}) has no active key; "
                f"create one with {CREATE_FIRST_KEY}"
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
        plane._auth_on = settings.require_auth or latch is not None
        plane._auth_checked = time.monotonic()
        if latch is not None:
            plane.auth_reason = f"the key database {where} has held a key since {latch}; {active} active"
        elif settings.require_auth:
            plane.auth_reason = f"--require-auth is set; {active} active key(s) in {where}"
        else:
            plane.auth_reason = f"no key has ever been created in {where}"
        if plane._auth_on:
            log.info("authenticated: %s", plane.auth_reason)
        else:
            log.warning("=" * 72)
            log.warning("open: %s.", plane.auth_reason)
            log.warning("stoker is running OPEN: anyone who can reach it can use it for inference.")
            log.warning("Inference needs no key; the admin API, model loading and /flush_cache are")
            log.warning("shut until a key exists. Create the first admin key with")
            log.warning("%s (authentication switches on by itself, for good),", CREATE_FIRST_KEY)
            log.warning("or start with --require-auth to refuse to run without keys.")
            log.warning("=" * 72)
        ledger.start()
        return plane

    # -- auth mode ------------------------------------------------------------------

    def auth_enabled(self) -> bool:
        """True once the database has held a key (a persisted one-way latch); while it
        has not, re-checked at most every key_cache_ttl."""
        if self._auth_on:
            return True
        now = time.monotonic()
        if now - self._auth_checked >= self.settings.key_cache_ttl:
            self._auth_checked = now
            try:
                latch = self.keys.latch()
            except DBAPIError as exc:
                # The database is away: keep the last answer (no key yet) rather than fail the
                # request with a 500; the next check after key_cache_ttl asks again.
                if self.keys.count_failure is not None:
                    self.keys.count_failure("key_lookup")
                log.warning(
                    "could not read the auth latch (%s); authentication stays off until the database answers", exc
                )
                return self._auth_on
            if latch is not None:
                self._auth_on = True
                self.auth_reason = (
                    f"the key database {redact_url(str(self.keys.engine.url))} has held a key since {latch}"
                )
                log.warning("authenticated: %s", self.auth_reason)
        return self._auth_on

    def check_exposure(self, host: str, allow_open: bool) -> None:
        """Refuse open mode on an address other than loopback unless allow_open
        (--allow-open) says it is meant: OpenOnPublicAddress, which `stoker serve`
        turns into exit 2."""
        if self.auth_enabled() or allow_open or is_loopback(host):
            return
        raise OpenOnPublicAddress(
            f"--host {host}: refusing to serve open (no API key) on an address other than loopback: "
            f"{self.auth_reason}. Create the first admin key with {CREATE_FIRST_KEY} "
            "(and start with --require-auth), bind 127.0.0.1, or pass --allow-open to serve inference "
            "to anyone who can reach this address on purpose"
        )

    # -- request path ---------------------------------------------------------------

    async def admit_http(
        self,
        request: Request,
        key: ApiKey | None,
        *,
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        n: int = 1,
        prompts: int = 1,
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
            prompts=prompts,
            priority=resolve_priority(key, priority),
            deadline=resolve_deadline(request.headers.get(DEADLINE_HEADER), timeout, self.settings.max_queue_wait),
            arrival=arrival,
            headers=request.headers,
            capacity=capacity,
        )

    # -- engine and lifecycle ---------------------------------------------------------

    def track_model(self, name: str, queue_of: str | None = None) -> AdmissionController:
        """A model the server serves gets its own admission queue bound (the
        first one the default controller), so one model's full queue refuses
        only its own requests. queue_of: the model whose engine queue name's
        requests join (a LoRA adapter's base), whose bound they share."""
        gate = self.gate
        if queue_of is not None and queue_of != name:
            gate.model_admission[name] = self.track_model(queue_of)
            return gate.model_admission[name]
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
