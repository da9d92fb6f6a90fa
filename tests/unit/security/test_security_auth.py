"""Issue 34, items 1 and 7, against real `stoker serve` processes (fake engine core):
open mode serves inference and no operator action; a database that has held a
key keeps its server authenticated for good; open mode refuses a non-loopback
address unless --allow-open; the router and metrics scopes; what answers without
a key once keys exist; absolute paths only for admin keys; the database URL
redacted in the start-up messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import FAKE_CORE, REPO, TESTS_DIR, ServerProcess, auth, free_port, start_server
from sqlalchemy import delete, select

from stoker.control import db as dbmod
from stoker.control.keys import KeyStore

pytestmark = pytest.mark.timeout(180)
FAKE_ARGS = ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256"]
CREATE_HINT = "stoker keys create --name NAME --admin"
COMPLETION = {"prompt": "hi", "max_tokens": 2}
ROUTER_PATHS = ["/get_load", "/server_info", "/get_server_info", "/model_info", "/get_model_info"]
DOCS_PATHS = ["/docs", "/redoc", "/openapi.json"]


def keystore(db: str) -> KeyStore:
    return KeyStore(dbmod.open_db(db))


def serve_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "stoker.cli", "serve", "--port", str(free_port()), *args]


def serve_env(db: str) -> dict[str, str]:
    return {**os.environ, "STOKER_DB": db, "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO])}


def absolute_paths(value: Any) -> list[str]:
    """Every string in a JSON value that is an absolute path."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in absolute_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in absolute_paths(v)]
    return [value] if isinstance(value, str) and os.path.isabs(value) else []


# -- open mode ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server([*FAKE_ARGS, "--metrics-require-auth"], str(tmp_path_factory.mktemp("open")))
    try:
        yield server
    finally:
        server.stop()


def test_open_mode_serves_inference_and_no_operator_action(open_server: ServerProcess, tmp_path) -> None:
    url = open_server.url
    assert httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30).status_code == 200
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    refused = [
        httpx.post(f"{url}/flush_cache", timeout=10),
        httpx.get(f"{url}/admin/models", timeout=10),
        httpx.post(f"{url}/admin/models", json={"name": "x", "path": str(tmp_path)}, timeout=10),
        httpx.delete(f"{url}/admin/models/{model['id']}", timeout=10),
        httpx.post(f"{url}/admin/models/{model['id']}/promote", timeout=10),
        httpx.get(f"{url}/admin/keys", timeout=10),
        httpx.post(f"{url}/admin/keys", json={"name": "me", "admin": True}, timeout=10),
        httpx.get(f"{url}/metrics", timeout=10),  # --metrics-require-auth: shut until a key exists
    ]
    for r in refused:
        assert r.status_code == 403, (r.request.method, r.request.url, r.text)
        assert CREATE_HINT in r.json()["error"]["message"], r.text
    # Nothing was changed: the model is still there, no key was made.
    assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == model["id"]
    # Read-only endpoints stay open in open mode (routers drive an open replica), but no paths in /v1/models.
    assert httpx.get(f"{url}/get_load", timeout=10).status_code == 200
    assert not absolute_paths(model), model
    ready = httpx.get(f"{url}/ready", timeout=10).json()
    assert "engine_stats" in ready
    assert "open: no key has ever been created in" in open_server.log()  # the start line says why


def test_non_loopback_open_mode_refuses_to_start_unless_allowed(tmp_path) -> None:
    db = str(tmp_path / "keys.db")
    proc = subprocess.run(
        serve_command([*FAKE_ARGS, "--host", "0.0.0.0"]),
        env=serve_env(db),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--allow-open" in proc.stderr and CREATE_HINT in proc.stderr, proc.stderr[-2000:]
    # On purpose: it serves (inference only).
    allowed = start_server([*FAKE_ARGS, "--host", "0.0.0.0", "--allow-open"], str(tmp_path), {"STOKER_DB": db})
    try:
        assert httpx.post(f"{allowed.url}/v1/completions", json=COMPLETION, timeout=30).status_code == 200
        assert httpx.post(f"{allowed.url}/flush_cache", timeout=10).status_code == 403
    finally:
        allowed.stop()
    # With a key the address is fine without the flag: the server is authenticated.
    keystore(db).create("root", admin=True)
    keyed = start_server([*FAKE_ARGS, "--host", "0.0.0.0"], str(tmp_path), {"STOKER_DB": db})
    try:
        assert "authenticated: the key database" in keyed.log()
        assert httpx.post(f"{keyed.url}/v1/completions", json=COMPLETION, timeout=30).status_code == 401
    finally:
        keyed.stop()


# -- the latch ------------------------------------------------------------------------


def test_a_database_that_held_a_key_stays_authenticated(tmp_path) -> None:
    """Every key revoked (or expired), the server restarted: still authenticated."""
    db = str(tmp_path / "keys.db")
    server = start_server([*FAKE_ARGS, "--key-cache-ttl", "0.2"], str(tmp_path), {"STOKER_DB": db})
    try:
        assert httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=30).status_code == 200
        store = keystore(db)
        key, secret = store.create("first")
        _, expiring = store.create("brief", expires_at=time.time() + 0.3)
        store.revoke(key.id)
        time.sleep(0.6)  # past the key cache and the expiry: no active key is left
        assert store.count_active() == 0
        r = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=30)
        assert r.status_code == 401, r.text
        assert httpx.post(f"{server.url}/v1/completions", json=COMPLETION, headers=auth(secret)).status_code == 401
    finally:
        server.stop()
    again = start_server(FAKE_ARGS, str(tmp_path), {"STOKER_DB": db})
    try:
        assert f"authenticated: the key database sqlite:///{db} has held a key since key {key.id}" in again.log()
        r = httpx.post(f"{again.url}/v1/completions", json=COMPLETION, timeout=30)
        assert r.status_code == 401, r.text
        assert httpx.post(f"{again.url}/v1/completions", json=COMPLETION, headers=auth(expiring)).status_code == 401
        assert httpx.get(f"{again.url}/get_load", timeout=10).status_code == 401
    finally:
        again.stop()


def test_an_older_database_with_keys_is_latched_by_the_upgrade(tmp_path) -> None:
    """A schema-2 database (before the latch) holding only a revoked key: the upgrade latches it."""
    db = str(tmp_path / "old.db")
    store = keystore(db)
    key, _ = store.create("old")
    store.revoke(key.id)
    with store.engine.begin() as conn:  # back to schema 2: no flags table, no step 3
        dbmod.flags.drop(conn)
        conn.execute(delete(dbmod.schema_table))
        conn.execute(dbmod.schema_table.insert().values(version=2, applied_at=time.time()))
    store.engine.dispose()
    upgraded = keystore(db)
    assert upgraded.latch() == f"key {key.id} (schema upgrade)"
    with upgraded.engine.connect() as conn:
        assert conn.execute(select(dbmod.schema_table.c.version)).scalars().all()[-1] == dbmod.SCHEMA_VERSION


def test_require_auth_refusal_and_start_line_redact_the_database_password(tmp_path) -> None:
    db = f"sqlite:///{tmp_path}/keys.db?uri=true&password=hunter2"
    proc = subprocess.run(
        serve_command([*FAKE_ARGS, "--require-auth", "--db", db]),
        env=serve_env(db),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "has no active key" in proc.stderr and "password=***" in proc.stderr, proc.stderr[-2000:]
    assert "hunter2" not in proc.stdout + proc.stderr
    proc = subprocess.run(
        serve_command([*FAKE_ARGS, "--host", "0.0.0.0", "--db", db]),
        env=serve_env(db),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 2 and "open: no key has ever been created in" in proc.stderr, proc.stderr[-2000:]
    assert "hunter2" not in proc.stdout + proc.stderr


# -- scopes and what answers without a key -------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("keyed")
    db = str(tmp / "keys.db")
    store = keystore(db)
    secrets = {
        "admin": store.create("admin", admin=True)[1],
        "inference": store.create("inference")[1],
        "router": store.create("router", scopes=["router"])[1],
        "metrics": store.create("metrics", scopes=["metrics"])[1],
    }
    store.engine.dispose()
    server = start_server(FAKE_ARGS, str(tmp), {"STOKER_DB": db})
    try:
        yield server, secrets
    finally:
        server.stop()


def status(url: str, secret: str | None, method: str = "GET") -> int:
    headers = auth(secret) if secret else {}
    return httpx.request(method, url, headers=headers, timeout=30).status_code


def test_router_metrics_and_docs_need_their_scope(keyed) -> None:
    server, keys = keyed
    url = server.url
    for path in ROUTER_PATHS:
        got = {who: status(url + path, keys.get(who)) for who in ("none", "inference", "metrics", "router", "admin")}
        assert got == {"none": 401, "inference": 403, "metrics": 403, "router": 200, "admin": 200}, (path, got)
    got = {who: status(url + "/metrics", keys.get(who)) for who in ("none", "inference", "router", "metrics", "admin")}
    assert got == {"none": 401, "inference": 403, "router": 403, "metrics": 200, "admin": 200}, got
    got = {who: status(url + "/flush_cache", keys.get(who), "POST") for who in ("none", "inference", "metrics")}
    assert got == {"none": 401, "inference": 403, "metrics": 403}, got
    assert status(url + "/flush_cache", keys["router"], "POST") == 200
    for path in DOCS_PATHS:
        got = {who: status(url + path, keys.get(who)) for who in ("none", "inference", "metrics")}
        assert got == {"none": 401, "inference": 200, "metrics": 200}, (path, got)
    # The router key is for routing, not for generating.
    assert httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=auth(keys["router"])).status_code == 403
    assert httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=auth(keys["inference"])).status_code == 200


def test_probes_without_a_key_learn_only_readiness(keyed) -> None:
    server, keys = keyed
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    ready = httpx.get(f"{server.url}/ready", timeout=10)
    assert ready.status_code == 200 and ready.json() == {"ready": True}
    assert httpx.get(f"{server.url}/version", timeout=10).status_code == 200
    detailed = httpx.get(f"{server.url}/ready", headers=auth(keys["inference"]), timeout=10).json()
    assert detailed["ready"] is True and "engine_stats" in detailed and "engine_pid" in detailed
    assert httpx.get(f"{server.url}/ready", headers=auth("sk-stoker-nope"), timeout=10).status_code == 401


def test_only_admin_keys_see_absolute_paths(keyed) -> None:
    server, keys = keyed
    url = server.url
    listed = httpx.get(f"{url}/v1/models", headers=auth(keys["inference"]), timeout=10).json()["data"]
    assert listed and not absolute_paths(listed), listed
    assert listed[0]["root"] == listed[0]["id"]
    for path in ("/server_info", "/model_info"):
        body = httpx.get(url + path, headers=auth(keys["router"]), timeout=10).json()
        assert not absolute_paths(body), (path, absolute_paths(body))
        assert body["model_path"] == body["served_model_name"]
    metrics = httpx.get(f"{url}/metrics", headers=auth(keys["metrics"]), timeout=10).text
    assert 'path="/' not in metrics
    admin = httpx.get(f"{url}/server_info", headers=auth(keys["admin"]), timeout=10).json()
    assert os.path.isabs(admin["model_path"])
    admin_listed = httpx.get(f"{url}/v1/models", headers=auth(keys["admin"]), timeout=10).json()["data"]
    assert os.path.isabs(admin_listed[0]["root"])


def test_keys_with_scopes_from_the_admin_api_and_the_cli(keyed, tmp_path) -> None:
    server, keys = keyed
    made = httpx.post(
        f"{server.url}/admin/keys",
        json={"name": "prom", "scopes": ["metrics", "router"]},
        headers=auth(keys["admin"]),
        timeout=10,
    )
    assert made.status_code == 201, made.text
    assert made.json()["scopes"] == ["router", "metrics"]
    assert status(f"{server.url}/metrics", made.json()["secret"]) == 200
    bad = httpx.post(
        f"{server.url}/admin/keys", json={"name": "x", "scopes": ["root"]}, headers=auth(keys["admin"]), timeout=10
    )
    assert 400 <= bad.status_code < 500 and "scopes" in bad.text, bad.text

    db = str(tmp_path / "cli.db")
    cli = [sys.executable, "-m", "stoker.cli", "keys", "create", "--db", db, "--name", "r", "--json"]
    env = serve_env(db)
    out = subprocess.run([*cli, "--scope", "router", "--scope", "metrics"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["scopes"] == ["router", "metrics"]
    wrong = subprocess.run([*cli, "--scope", "everything"], env=env, capture_output=True, text=True)
    assert wrong.returncode == 2 and "--scope" in wrong.stderr
