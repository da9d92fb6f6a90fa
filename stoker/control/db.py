"""The control plane's database: API keys and the usage ledger, through
SQLAlchemy Core. SQLite file by default, PostgreSQL (or anything SQLAlchemy
speaks) by URL.

Migrations: a small versioned table (`stoker_schema`) rather than Alembic.
The schema is two tables owned by one package; Alembic would add a
dependency, an env.py and a migrations folder that every user would carry,
and it still needs a "stamp head on a fresh database" step. Here a fresh
database is created from the current table definitions and stamped with
SCHEMA_VERSION; an older one gets each later step of MIGRATIONS applied, in
order, in one transaction, so an interrupted upgrade leaves nothing half done.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    inspect,
    select,
    text,
)

from stoker.redact import redact_url

metadata = MetaData()

api_keys = Table(
    "stoker_api_keys",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("name", String(200), nullable=False),
    Column("prefix", String(40), nullable=False),  # shown in listings so people can tell keys apart
    Column("secret_hash", String(64), nullable=False, unique=True),
    Column("scopes", Text, nullable=False),  # JSON list
    Column("models", Text, nullable=True),  # JSON list; NULL means every model
    Column("rpm", Integer, nullable=True),
    Column("tpm", Integer, nullable=True),
    Column("max_concurrent", Integer, nullable=True),
    Column("budget_tokens", Integer, nullable=True),
    Column("budget_period", String(10), nullable=False, default="month"),
    Column("priority", String(20), nullable=False, default="interactive"),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=True),
    Column("revoked_at", Float, nullable=True),
)

usage = Table(
    "stoker_usage",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("request_id", String(128), nullable=False),
    Column("key_id", String(32), nullable=True),  # NULL in open mode
    Column("model", String(200), nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("cached_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("queue_time", Float, nullable=True),
    Column("ttft", Float, nullable=True),
    Column("latency", Float, nullable=True),
    Column("finish_reason", String(20), nullable=True),
    Column("status", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    # Budget checks sum one key's rows since the start of a period.
    Index("ix_stoker_usage_key_time", "key_id", "created_at"),
)

# Budget reservations shared by replicas on one database (PostgreSQL): one row
# per admitted request of a key with a budget, holding its estimate (prompt +
# max_tokens x n) until the ledger writes the request's usage row, which
# deletes the reservation in the same transaction, so at every moment a
# request is counted exactly once (reserved or used). expires_at is renewed by
# the replica holding the row; a dead replica's rows lapse after the TTL.
budget_reservations = Table(
    "stoker_budget_reservations",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("key_id", String(32), nullable=False),
    Column("tokens", Integer, nullable=False),
    Column("replica", String(32), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    Index("ix_stoker_budget_reservations_key", "key_id", "expires_at"),
    Index("ix_stoker_budget_reservations_replica", "replica"),
)

# Facts about the database itself, one row each. "auth_latch": written in the
# transaction that creates the first key and never removed by stoker, so a
# database that has held a key keeps its server authenticated after every key
# is revoked or expires, across restarts (ControlPlane.open reads it).
flags = Table(
    "stoker_flags",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", Text, nullable=False),
    Column("set_at", Float, nullable=False),
)
AUTH_LATCH = "auth_latch"

schema_table = Table(
    "stoker_schema",
    metadata,
    Column("version", Integer, primary_key=True),
    Column("applied_at", Float, nullable=False),
)

SCHEMA_VERSION = 3


def _add_budget_reservations(conn: Connection) -> None:
    budget_reservations.create(conn)


def _add_flags(conn: Connection) -> None:
    """The flags table; a database that already holds keys is latched at once
    (its server was authenticated by them and must stay so)."""
    import time

    flags.create(conn, checkfirst=True)
    first = conn.execute(select(api_keys.c.id).order_by(api_keys.c.created_at).limit(1)).first()
    if first is not None:
        conn.execute(
            flags.insert().values(name=AUTH_LATCH, value=f"key {first[0]} (schema upgrade)", set_at=time.time())
        )


# version -> step that upgrades a database from version-1 to version. Add a
# step here (and bump SCHEMA_VERSION) whenever a table above changes.
MIGRATIONS: dict[int, Callable[[Connection], None]] = {2: _add_budget_reservations, 3: _add_flags}

# Key of the PostgreSQL advisory lock that serializes migrations: several
# replicas starting at once on a fresh database must not all create the tables.
MIGRATION_LOCK = 0x5707E2


def default_db_url() -> str:
    """$STOKER_DB if set, else a SQLite file under ~/.stoker (shared by `stoker keys` and `stoker serve`)."""
    configured = os.environ.get("STOKER_DB")
    if configured:
        return configured
    return str(Path.home() / ".stoker" / "stoker.db")


def to_url(db: str) -> str:
    """A bare path means a SQLite file; anything with a scheme is a SQLAlchemy URL."""
    if "://" in db:
        return db
    if db == ":memory:":
        return "sqlite://"
    path = Path(db).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def make_engine(db: str | None = None) -> Engine:
    url = to_url(db or default_db_url())
    if url.startswith("sqlite"):
        from sqlalchemy.pool import StaticPool

        kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False, "timeout": SQLITE_LOCK_WAIT_S}}
        if url in ("sqlite://", "sqlite:///:memory:"):
            # One shared connection, or every thread would see its own empty database.
            kwargs["poolclass"] = StaticPool
        engine = create_engine(url, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            # WAL lets the CLI read keys while the server's ledger writer commits.
            _wal_journal(cur)
            cur.close()

    elif url.startswith("postgresql"):
        # A database that does not answer fails a connection in seconds, not
        # after the OS's TCP timeout: start-up says so, a request gets its 503.
        engine = create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": CONNECT_TIMEOUT})
    else:
        engine = create_engine(url, pool_pre_ping=True)
    return engine


CONNECT_TIMEOUT = 3
SQLITE_LOCK_WAIT_S = 30.0


def _wal_journal(cur: Any) -> None:
    """PRAGMA journal_mode=WAL, waiting out another process converting the same
    new file: SQLite answers "database is locked" at once there, without its
    busy handler (seen with 3 servers starting together on one file, ~6% of
    the time). Once one has converted it the file stays WAL and this is a no-op."""
    import sqlite3
    import time

    deadline = time.monotonic() + SQLITE_LOCK_WAIT_S
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def is_shared(engine: Engine) -> bool:
    """A database several replicas can share as one (a server, not a SQLite file)."""
    return engine.dialect.name != "sqlite"


def current_version(conn: Connection) -> int:
    if not inspect(conn).has_table(schema_table.name):
        return 0
    found = conn.execute(select(schema_table.c.version).order_by(schema_table.c.version.desc())).first()
    return int(found[0]) if found else 0


def migrate(engine: Engine) -> int:
    """Bring the schema to SCHEMA_VERSION; idempotent and safe to call at every start."""
    import time

    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            # Held until this transaction ends; a replica that waited here then
            # sees the tables the first one created (DDL is transactional there).
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
        elif engine.dialect.name == "sqlite":
            # The driver begins a transaction lazily, at the first write: two
            # servers starting together on one file both read version 0 and the
            # second's CREATE TABLE failed. Take the write lock before reading.
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        version = current_version(conn)
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"database schema version {version} is newer than this stoker ({SCHEMA_VERSION}); upgrade stoker"
            )
        if version == 0:
            metadata.create_all(conn)
            conn.execute(schema_table.insert().values(version=SCHEMA_VERSION, applied_at=time.time()))
            return SCHEMA_VERSION
        for step in range(version + 1, SCHEMA_VERSION + 1):
            MIGRATIONS[step](conn)
            conn.execute(schema_table.insert().values(version=step, applied_at=time.time()))
    return SCHEMA_VERSION


def open_db(db: str | None = None) -> Engine:
    """Engine with an up-to-date schema. A database that cannot be reached or
    migrated raises StartupRefused: one line naming --db, without the password."""
    from sqlalchemy.exc import DBAPIError, NoSuchModuleError

    from stoker.errors import StartupRefused

    url = to_url(db or default_db_url())
    try:
        engine = make_engine(url)
        migrate(engine)
    except (DBAPIError, NoSuchModuleError) as exc:
        # The driver's message can span lines (libpq adds hints); the first says what failed.
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise StartupRefused(f"--db {redact_url(url)}: cannot open the database ({reason})") from None
    return engine
