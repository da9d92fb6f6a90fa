"""API keys: hashed at rest, scoped, expiring, revocable; schema migrations; the CLI."""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import select

from stoker.control import db as dbmod
from stoker.control.cli import parse_expiry
from stoker.control.keys import AuthOutcome, KeyStore, hash_secret, parse_key_id


@pytest.fixture
def store(tmp_path):
    return KeyStore(dbmod.open_db(str(tmp_path / "k.db")), cache_ttl=60)


def test_secret_is_never_stored_only_its_hash(store):
    key, secret = store.create("alice")
    assert secret.startswith("sk-stoker-") and len(secret) > 50
    with store.engine.connect() as conn:
        row = conn.execute(select(dbmod.api_keys)).one()._mapping
    assert secret not in [str(v) for v in row.values()]
    assert row["secret_hash"] == hash_secret(secret)
    assert "secret_hash" not in key.public() and "secret" not in key.public()


def test_authenticate_outcomes(store):
    key, secret = store.create("alice")
    assert store.authenticate(secret) == (AuthOutcome.OK, key)
    assert store.authenticate("nonsense")[0] is AuthOutcome.MALFORMED
    wrong = secret[:-4] + ("aaaa" if not secret.endswith("aaaa") else "bbbb")
    assert store.authenticate(wrong)[0] is AuthOutcome.WRONG_SECRET
    other = f"sk-stoker-{'0' * 12}-{'x' * 43}"
    assert store.authenticate(other)[0] is AuthOutcome.UNKNOWN
    assert store.revoke(key.id)
    assert not store.revoke(key.id)  # already revoked
    assert store.authenticate(secret)[0] is AuthOutcome.REVOKED  # visible at once: the cache was invalidated


def test_expired_key(store):
    _, secret = store.create("old", expires_at=time.time() - 1)
    assert store.authenticate(secret)[0] is AuthOutcome.EXPIRED
    assert store.count_active() == 0


def test_settings_round_trip(store):
    key, _ = store.create(
        "batchy",
        rpm=5,
        tpm=100,
        max_concurrent=2,
        budget_tokens=1000,
        budget_period="day",
        priority="batch",
        models=["a", "b"],
        admin=True,
    )
    got = store.get(key.id)
    assert got == key
    assert got.is_admin and got.allows_model("a") and not got.allows_model("c")
    assert [k.id for k in store.list_keys()] == [key.id]
    assert store.count_active() == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rpm": 0},
        {"tpm": -1},
        {"priority": "urgent"},
        {"budget_period": "year"},
        {"models": [""]},
        {"max_concurrent": True},
    ],
)
def test_invalid_settings(store, kwargs):
    with pytest.raises(ValueError):
        store.create("x", **kwargs)


def test_parse_key_id():
    assert parse_key_id("sk-stoker-0123456789ab-" + "y" * 43) == "0123456789ab"
    assert parse_key_id("sk-stoker-0123456789ab" + "y" * 43) is None
    assert parse_key_id("sk-other-0123456789ab-" + "y" * 43) is None
    assert parse_key_id("sk-stoker-XYZ456789ab-" + "y" * 43) is None


def test_unknown_ids_are_cached(store, monkeypatch):
    calls = []
    real = store.get
    monkeypatch.setattr(store, "get", lambda kid: calls.append(kid) or real(kid))
    fake = f"sk-stoker-{'1' * 12}-{'x' * 43}"
    for _ in range(5):
        store.authenticate(fake)
    assert len(calls) == 1


def test_migration_is_idempotent_and_versioned(tmp_path):
    engine = dbmod.open_db(str(tmp_path / "m.db"))
    assert dbmod.migrate(engine) == dbmod.SCHEMA_VERSION
    with engine.connect() as conn:
        assert dbmod.current_version(conn) == dbmod.SCHEMA_VERSION


def test_migration_steps_apply_in_order(tmp_path, monkeypatch):
    engine = dbmod.open_db(str(tmp_path / "m.db"))
    applied = []
    monkeypatch.setattr(dbmod, "SCHEMA_VERSION", dbmod.SCHEMA_VERSION + 2)
    monkeypatch.setitem(dbmod.MIGRATIONS, dbmod.SCHEMA_VERSION - 1, lambda conn: applied.append("a"))
    monkeypatch.setitem(dbmod.MIGRATIONS, dbmod.SCHEMA_VERSION, lambda conn: applied.append("b"))
    dbmod.migrate(engine)
    dbmod.migrate(engine)
    assert applied == ["a", "b"]


def test_newer_schema_is_refused(tmp_path, monkeypatch):
    engine = dbmod.open_db(str(tmp_path / "m.db"))
    monkeypatch.setattr(dbmod, "SCHEMA_VERSION", 0)
    with pytest.raises(RuntimeError, match="newer"):
        dbmod.migrate(engine)


def test_parse_expiry():
    now = 1_700_000_000.0
    assert parse_expiry("30d", now) == now + 30 * 86400
    assert parse_expiry("2030-01-31", now) == parse_expiry("2030-02-01T00:00:00+00:00", now)


def test_cli_create_list_show_revoke(tmp_path, capsys):
    from stoker.cli import main

    db = str(tmp_path / "cli.db")
    assert (
        main(
            [
                "keys",
                "create",
                "--db",
                db,
                "--name",
                "bob",
                "--rpm",
                "3",
                "--models",
                "m1,m2",
                "--budget-tokens",
                "500",
                "--budget-period",
                "day",
                "--priority",
                "batch",
                "--json",
            ]
        )
        == 0
    )
    created = json.loads(capsys.readouterr().out)
    assert created["secret"].startswith("sk-stoker-") and created["models"] == ["m1", "m2"]
    assert main(["keys", "list", "--db", db, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [k["id"] for k in listed] == [created["id"]] and "secret" not in listed[0]
    assert main(["keys", "show", "--db", db, created["id"], "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["usage"]["budget_remaining"] == 500
    assert main(["keys", "revoke", "--db", db, created["id"]]) == 0
    assert main(["keys", "list", "--db", db]) == 0
    assert "revoked" in capsys.readouterr().out
    assert main(["keys", "revoke", "--db", db, "nope"]) == 1


def _open_db_in_process(path: str) -> str:
    from stoker.control.db import open_db

    try:
        open_db(path).dispose()
    except Exception as exc:  # the result is compared, not raised, across processes
        return repr(exc)
    return "ok"


def test_servers_starting_together_on_one_sqlite_file_both_open_it(tmp_path) -> None:
    """Two servers on the default SQLite file at once: the second's CREATE TABLE
    used to fail ("already exists") because both read schema version 0."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(3) as pool:
        for round_ in range(3):
            path = str(tmp_path / f"race{round_}.db")
            assert pool.map(_open_db_in_process, [path] * 3) == ["ok"] * 3
