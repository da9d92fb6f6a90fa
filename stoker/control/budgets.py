"""SharedBudgets: token budgets enforced across replicas that share one
database server (PostgreSQL), through rows in stoker_budget_reservations.

Admission of a request on a key with a budget is one transaction:

    lock the key's row (SELECT ... FOR UPDATE: replicas admit a key's requests one at a time)
    used     = the key's usage rows this period
    reserved = the key's live reservations (every replica's requests in flight or not yet written)
    used + reserved + estimate > budget  ->  refuse (429)
    else insert a reservation of the request's estimate (control/cost.py:
    prompt tokens + prompts x n x max_tokens, the most it can be billed)

The ledger deletes a reservation in the transaction that writes its usage row
(UsageLedger.flush), so a request is always counted once, as an estimate or as
what it used, and what it used is never more than its estimate. Hence the
bound: a key's spend in a period never passes its budget, however many
replicas serve it; only a replica that dies with unwritten usage (its rows
lapse after the TTL, its usage is lost with it) or --on-store-failure open
(admitted unmetered while the database is down) escape it.

Each replica renews its rows' expiry every third of the TTL; the rows of a
replica that died (with its unwritten usage) lapse after the TTL.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from sqlalchemy import Engine, delete, func, select, update
from sqlalchemy.exc import DBAPIError

from stoker.control.db import api_keys, budget_reservations, usage
from stoker.control.ledger import period_start
from stoker.redact import redact_url

log = logging.getLogger("stoker.control.budgets")

STORE_RETRY_AFTER = 2.0


class BudgetExceeded(Exception):
    def __init__(self, used: int, reserved: int) -> None:
        super().__init__(f"{used} used, {reserved} reserved")
        self.used = used
        self.reserved = reserved


class DatabaseUnavailable(Exception):
    """The shared database did not answer; the caller fails closed (503) or open."""


class SharedBudgets:
    def __init__(
        self,
        engine: Engine,
        ttl: float = 30.0,
        replica: str | None = None,
        count_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.count_failure = count_failure
        """Called with "budget_reserve", "budget_release" or "budget_renew" when the database fails it."""
        self.ttl = ttl
        self.replica = replica or uuid.uuid4().hex
        self.unreachable_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unreleased: set[str] = set()
        self._lock = threading.Lock()

    # -- admission -----------------------------------------------------------

    def reserve(
        self, key_id: str, budget: int, period: str, estimate: int, now: float | None = None
    ) -> tuple[str, int]:
        """Reserve `estimate` tokens of the key's budget: (reservation id, tokens used
        this period), only if used + reserved + estimate <= budget. Raises BudgetExceeded or
        DatabaseUnavailable. Blocking: call off the loop."""
        now = now if now is not None else time.time()
        start = period_start(period, now)
        rid = uuid.uuid4().hex
        try:
            with self.engine.begin() as conn:
                conn.execute(select(api_keys.c.id).where(api_keys.c.id == key_id).with_for_update())
                used = conn.execute(
                    select(func.coalesce(func.sum(usage.c.prompt_tokens + usage.c.completion_tokens), 0)).where(
                        usage.c.key_id == key_id, usage.c.created_at >= start
                    )
                ).scalar_one()
                reserved = conn.execute(
                    select(func.coalesce(func.sum(budget_reservations.c.tokens), 0)).where(
                        budget_reservations.c.key_id == key_id, budget_reservations.c.expires_at > now
                    )
                ).scalar_one()
                self._answered()
                if int(used) + int(reserved) + estimate > budget:
                    raise BudgetExceeded(int(used), int(reserved))
                conn.execute(
                    budget_reservations.insert().values(
                        id=rid,
                        key_id=key_id,
                        tokens=estimate,
                        replica=self.replica,
                        created_at=now,
                        expires_at=now + self.ttl,
                    )
                )
        except DBAPIError as exc:
            self._failed(exc, "budget_reserve")
            raise DatabaseUnavailable(str(exc.orig or exc).strip().splitlines()[0]) from None
        return rid, int(used)

    def release(self, reservation_id: str) -> None:
        """Drop a reservation whose request was refused after it was made (no usage row will come)."""
        try:
            with self.engine.begin() as conn:
                conn.execute(delete(budget_reservations).where(budget_reservations.c.id == reservation_id))
        except DBAPIError as exc:
            # Renewal would keep it alive: delete it with the next renewal instead.
            self._failed(exc, "budget_release")
            with self._lock:
                self._unreleased.add(reservation_id)

    # -- renewal -------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="stoker-budgets", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.renew()
            except DBAPIError as exc:
                self._failed(exc, "budget_renew")

    def renew(self, now: float | None = None) -> None:
        """Extend this replica's rows; delete everyone's long-lapsed ones."""
        now = now if now is not None else time.time()
        with self._lock:
            unreleased = list(self._unreleased)
        with self.engine.begin() as conn:
            if unreleased:
                conn.execute(delete(budget_reservations).where(budget_reservations.c.id.in_(unreleased)))
            conn.execute(
                update(budget_reservations)
                .where(budget_reservations.c.replica == self.replica)
                .values(expires_at=now + self.ttl)
            )
            conn.execute(delete(budget_reservations).where(budget_reservations.c.expires_at < now - self.ttl))
        with self._lock:
            self._unreleased.difference_update(unreleased)
        self._answered()

    # -- failure state ---------------------------------------------------------

    def _failed(self, exc: DBAPIError, operation: str) -> None:
        if self.count_failure is not None:
            self.count_failure(operation)
        if self.unreachable_since is None:
            self.unreachable_since = time.time()
            reason = str(exc.orig or exc).strip().splitlines()[0]
            log.error("database at %s unreachable (%s)", redact_url(str(self.engine.url)), reason)

    def _answered(self) -> None:
        if self.unreachable_since is not None:
            log.warning(
                "database at %s answers again after %.1f s",
                redact_url(str(self.engine.url)),
                time.time() - self.unreachable_since,
            )
            self.unreachable_since = None
