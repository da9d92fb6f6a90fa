"""Usage ledger: batched writes off the request path, budgets per period, nothing lost at shutdown."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from sqlalchemy import func, select

from stoker.control.db import open_db, usage
from stoker.control.ledger import UsageLedger, period_end, period_start
from stoker.observe.logs import RequestRecord


def rec(
    i: int, key_id: str | None = "k1", prompt: int = 10, completion: int = 5, at: float | None = None
) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}",
        key_id=key_id,
        model="m",
        prompt_tokens=prompt,
        cached_tokens=2,
        completion_tokens=completion,
        status=200,
        finish_reason="stop",
        ttft=0.1,
        latency=0.5,
        created_at=at or 0.0,
    )


def count(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(usage)).scalar_one()


@pytest.fixture
def engine(tmp_path):
    return open_db(str(tmp_path / "u.db"))


def test_record_does_not_write_until_flush(engine):
    ledger = UsageLedger(engine)
    for i in range(3):
        ledger.record(rec(i))
    assert count(engine) == 0 and ledger.pending == 3
    assert ledger.flush() == 3
    assert count(engine) == 3 and ledger.pending == 0


def test_background_writer_batches(engine):
    ledger = UsageLedger(engine, flush_interval=0.05, batch_size=4)
    ledger.start()
    for i in range(10):
        ledger.record(rec(i))
    deadline = time.time() + 5
    while count(engine) < 10 and time.time() < deadline:
        time.sleep(0.02)
    assert count(engine) == 10
    ledger.close()


def test_close_flushes_everything(engine):
    ledger = UsageLedger(engine, flush_interval=3600, batch_size=10_000)
    ledger.start()
    for i in range(1234):
        ledger.record(rec(i))
    ledger.close()
    assert count(engine) == 1234


def test_failed_write_keeps_rows_for_retry(engine, monkeypatch):
    ledger = UsageLedger(engine)
    ledger.record(rec(1))
    real_begin = engine.begin
    monkeypatch.setattr(engine, "begin", lambda: (_ for _ in ()).throw(RuntimeError("db down")))
    with pytest.raises(RuntimeError):
        ledger.flush()
    assert ledger.pending == 1 and ledger.write_errors == 1
    monkeypatch.setattr(engine, "begin", real_begin)
    assert ledger.flush() == 1


def test_pending_is_bounded(engine):
    ledger = UsageLedger(engine, max_pending=5)
    for i in range(8):
        ledger.record(rec(i))
    assert ledger.pending == 5 and ledger.dropped == 3


def test_used_counts_written_and_pending_then_tracks_in_memory(engine):
    ledger = UsageLedger(engine)
    ledger.record(rec(1))  # 15 tokens
    ledger.flush()
    ledger.record(rec(2))  # pending
    ledger.record(rec(3, key_id="other"))
    assert ledger.used_cached("k1", "day") is None
    assert ledger.used("k1", "day") == 30
    ledger.record(rec(4, prompt=100, completion=0))
    assert ledger.used_cached("k1", "day") == 130  # no query needed
    ledger.flush()
    ledger._totals.clear()
    assert ledger.used("k1", "day") == 130


def test_old_periods_do_not_count(engine):
    ledger = UsageLedger(engine)
    ledger.record(rec(1, at=time.time() - 3 * 86400))
    ledger.record(rec(2))
    ledger.flush()
    assert ledger.used("k1", "day") == 15
    assert ledger.summary("k1")["total_tokens"] == 30


def test_periods():
    t = dt.datetime(2025, 12, 15, 13, 30, tzinfo=dt.timezone.utc).timestamp()
    assert period_start("day", t) == dt.datetime(2025, 12, 15, tzinfo=dt.timezone.utc).timestamp()
    assert period_start("month", t) == dt.datetime(2025, 12, 1, tzinfo=dt.timezone.utc).timestamp()
    assert period_end("month", t) == dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc).timestamp()
    assert period_end("day", t) == dt.datetime(2025, 12, 16, tzinfo=dt.timezone.utc).timestamp()


def test_concurrent_records_from_threads(engine):
    ledger = UsageLedger(engine, flush_interval=0.01, batch_size=7)
    ledger.start()
    threads = [
        threading.Thread(target=lambda j=j: [ledger.record(rec(j * 100 + i)) for i in range(50)]) for j in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ledger.close()
    assert count(engine) == 200
    assert ledger.summary("k1")["requests"] == 200


def test_key_report(engine):
    ledger = UsageLedger(engine)
    ledger.record(rec(1))
    report = ledger.key_report("k1", "month", 100)
    assert report["this_period"]["cached_tokens"] == 2 and report["budget_remaining"] == 85
