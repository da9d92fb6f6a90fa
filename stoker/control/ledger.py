"""Usage ledger: one row per finished request, written in batches by a
background thread so the request path never waits on the database, and
flushed completely on shutdown.

Budgets are checked against a per-key in-memory running total for the
current period: loaded once from the database (sum of that key's rows since
the period started) and then advanced by every record, flushed or not, so
the check costs no query and pending rows are never forgotten.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, delete, func, select

from stoker.control.db import budget_reservations, usage
from stoker.observe.logs import RequestRecord

log = logging.getLogger("stoker.ledger")


def usage_tokens(rec: RequestRecord) -> int:
    """What a request counts against its key's budget: prompt (when metered) and completion tokens."""
    return ((rec.prompt_tokens or 0) if rec.metered else 0) + (rec.completion_tokens or 0)


def usage_row(rec: RequestRecord) -> dict[str, object]:
    """The request's row in stoker_usage: its usage columns of the record."""
    return {
        "request_id": rec.request_id,
        "key_id": rec.key_id,
        "model": rec.model,
        "prompt_tokens": (rec.prompt_tokens or 0) if rec.metered else 0,
        "cached_tokens": rec.cached_tokens or 0,
        "completion_tokens": rec.completion_tokens or 0,
        "status": rec.status,
        "finish_reason": rec.finish_reason,
        "queue_time": rec.queue_time,
        "ttft": rec.ttft,
        "latency": rec.latency,
        "created_at": rec.created_at,
    }


def period_start(period: str, now: float) -> float:
    """Start (UTC) of the day or month containing `now`."""
    t = dt.datetime.fromtimestamp(now, dt.timezone.utc)
    start = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "month":
        start = start.replace(day=1)
    elif period != "day":
        raise ValueError(f"unknown budget period {period!r}")
    return start.timestamp()


def period_end(period: str, now: float) -> float:
    start = dt.datetime.fromtimestamp(period_start(period, now), dt.timezone.utc)
    if period == "day":
        return (start + dt.timedelta(days=1)).timestamp()
    year, month = (start.year + 1, 1) if start.month == 12 else (start.year, start.month + 1)
    return start.replace(year=year, month=month).timestamp()


class UsageLedger:
    def __init__(
        self,
        engine: Engine,
        flush_interval: float = 1.0,
        batch_size: int = 500,
        max_pending: int = 1_000_000,
        count_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.count_failure = count_failure
        """Called with "ledger_write" for each batch the database refused (the rows are kept)."""
        self.flush_interval = flush_interval
        self.batch_size = batch_size
        self.max_pending = max_pending
        self._pending: deque[RequestRecord] = deque()
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()  # one writer at a time: the thread or a final flush
        self._stop = False
        self._thread: threading.Thread | None = None
        # key_id -> (period start, tokens used in that period)
        self._totals: dict[str, tuple[float, int]] = {}
        self._totals_lock = threading.Lock()
        self.written = 0
        self.dropped = 0
        self.write_errors = 0
        self.failing_since: float | None = None

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="stoker-ledger", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the writer and write everything still pending."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.flush()
        if self._pending:
            log.error("ledger: %d usage records could not be written at shutdown", len(self._pending))

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- request path --------------------------------------------------------

    def record(self, rec: RequestRecord) -> None:
        """Queue its usage row; never blocks on the database."""
        if not rec.created_at:
            rec.created_at = time.time()
        # Totals and the pending queue change together (lock order: totals, then
        # queue) so used() never sees a record in one but not the other.
        with self._totals_lock:
            if rec.key_id is not None:
                entry = self._totals.get(rec.key_id)
                if entry is not None and rec.created_at >= entry[0]:
                    self._totals[rec.key_id] = (entry[0], entry[1] + usage_tokens(rec))
            with self._cond:
                if len(self._pending) >= self.max_pending:
                    # The database has been failing for a long time; keep memory bounded.
                    self._pending.popleft()
                    self.dropped += 1
                    log.error("ledger: pending queue full, dropped the oldest usage record")
                self._pending.append(rec)
                if len(self._pending) >= self.batch_size:
                    self._cond.notify()

    def used_cached(self, key_id: str, period: str, now: float | None = None) -> int | None:
        """Tokens used this period if known without a query, else None."""
        start = period_start(period, now if now is not None else time.time())
        with self._totals_lock:
            entry = self._totals.get(key_id)
        return entry[1] if entry is not None and entry[0] == start else None

    def used(self, key_id: str, period: str, now: float | None = None) -> int:
        """Tokens (prompt + completion) a key used this period, including rows not yet written.
        May query the database (call it off the event loop on a cache miss)."""
        now = now if now is not None else time.time()
        cached = self.used_cached(key_id, period, now)
        if cached is not None:
            return cached
        start = period_start(period, now)
        # Hold the write lock so a batch cannot land between the sum and the
        # pending scan (it would be counted twice or not at all).
        with self._write_lock:
            with self.engine.connect() as conn:
                stored = conn.execute(
                    select(func.coalesce(func.sum(usage.c.prompt_tokens + usage.c.completion_tokens), 0)).where(
                        usage.c.key_id == key_id, usage.c.created_at >= start
                    )
                ).scalar_one()
            with self._totals_lock:
                with self._cond:
                    pending = sum(
                        usage_tokens(r) for r in self._pending if r.key_id == key_id and r.created_at >= start
                    )
                total = int(stored) + pending
                self._totals[key_id] = (start, total)
        return total

    # -- writer --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._stop and len(self._pending) < self.batch_size:
                    self._cond.wait(self.flush_interval)
                if self._stop:
                    return
            try:
                self.flush()
            except Exception:
                time.sleep(self.flush_interval)

    def flush(self) -> int:
        """Write all pending rows in batches; returns how many were written."""
        written = 0
        while True:
            with self._write_lock:
                with self._cond:
                    batch = [self._pending.popleft() for _ in range(min(self.batch_size, len(self._pending)))]
                if not batch:
                    return written
                try:
                    with self.engine.begin() as conn:
                        conn.execute(usage.insert(), [usage_row(r) for r in batch])
                        # Same transaction: a request is counted once, as reserved or as used.
                        settled = [r.reservation_id for r in batch if r.reservation_id]
                        if settled:
                            conn.execute(delete(budget_reservations).where(budget_reservations.c.id.in_(settled)))
                except Exception as exc:
                    self.write_errors += 1
                    if self.count_failure is not None:
                        self.count_failure("ledger_write")
                    if self.failing_since is None:
                        # Once per outage, not once per retry: the writer retries every flush_interval.
                        self.failing_since = time.time()
                        log.error(
                            "ledger: writing %d usage records failed (%s); keeping them and retrying",
                            len(batch),
                            str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
                            if str(exc)
                            else type(exc).__name__,
                        )
                    with self._cond:
                        self._pending.extendleft(reversed(batch))
                    raise
                if self.failing_since is not None:
                    log.warning(
                        "ledger: usage rows written again after %.1f s (%d pending)",
                        time.time() - self.failing_since,
                        len(self._pending),
                    )
                    self.failing_since = None
                self.written += len(batch)
                written += len(batch)

    # -- reports -------------------------------------------------------------

    def summary(self, key_id: str | None = None, since: float | None = None) -> dict[str, Any]:
        """Totals of written rows (call flush() first for an exact figure)."""
        cols = [
            func.count().label("requests"),
            func.coalesce(func.sum(usage.c.prompt_tokens), 0).label("prompt_tokens"),
            func.coalesce(func.sum(usage.c.cached_tokens), 0).label("cached_tokens"),
            func.coalesce(func.sum(usage.c.completion_tokens), 0).label("completion_tokens"),
        ]
        query = select(*cols)
        if key_id is not None:
            query = query.where(usage.c.key_id == key_id)
        if since is not None:
            query = query.where(usage.c.created_at >= since)
        with self.engine.connect() as conn:
            row = conn.execute(query).one()._mapping
        out = {k: int(v) for k, v in row.items()}
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        return out

    def key_report(
        self, key_id: str, period: str, budget_tokens: int | None, now: float | None = None
    ) -> dict[str, Any]:
        """Usage this budget period and in total, pending rows included (they are flushed first)."""
        now = now if now is not None else time.time()
        self.flush()
        start = period_start(period, now)
        this_period = self.summary(key_id, since=start)
        out = {"period": period, "period_start": start, "this_period": this_period, "all_time": self.summary(key_id)}
        if budget_tokens is not None:
            out["budget_remaining"] = max(0, budget_tokens - this_period["total_tokens"])
        return out

    def rows(self, key_id: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        query = select(usage).order_by(usage.c.id.desc()).limit(limit)
        if key_id is not None:
            query = query.where(usage.c.key_id == key_id)
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(query)]
