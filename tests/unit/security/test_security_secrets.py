"""Secrets stay out of output, TLS is modern, Host is checked (issue 34, item 9).

Each test runs against what a user runs: `stoker serve` and `stoker models` as
processes, a real Redis refusing a password, a TLS handshake from a client that
offers only what the server must refuse."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import FAKE_CORE, REPO, TESTS_DIR, ServerProcess, free_port, start_server
from redis_server import RedisServer

from stoker.redact import redact_url

PASSWORD = "hunter2-not-for-logs"


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{PASSWORD}@127.0.0.1:6379/0",
        f"redis://127.0.0.1:6379/0?password={PASSWORD}",
        f"rediss://user:{PASSWORD}@cache.internal:6380?ssl_cert_reqs=none",
        f"postgresql://stoker:{PASSWORD}@db.internal/stoker",
        f"postgresql+psycopg://db.internal/stoker?sslmode=require&password={PASSWORD}",
        f"unix:///run/redis.sock?db=2&password={PASSWORD}",
    ],
)
def test_urls_lose_their_passwords_wherever_they_are(url: str) -> None:
    shown = redact_url(url)
    assert PASSWORD not in shown
    assert "***" in shown
    assert shown.split("://")[0] == url.split("://")[0]  # still says which server


@pytest.mark.parametrize(
    "path", ["/var/lib/stoker/keys.db", "sqlite:////var/lib/stoker/keys.db", "redis://cache:6379/1"]
)
def test_urls_without_secrets_are_shown_as_given(path: str) -> None:
    assert redact_url(path) == path


def _serve_output(tmp: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli", "serve", "--engine-core", FAKE_CORE, "--no-embedding-model"]
        + ["--db", str(tmp / "k.db"), "--port", str(free_port()), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO])},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_redis_password_in_the_query_stays_out_of_the_log(tmp_path: Path) -> None:
    redis = RedisServer(str(tmp_path))
    redis.start()
    try:
        # A Redis without a password of its own takes any AUTH (the default user): the server starts
        # and says where its limits live, which is where the URL used to be printed whole.
        url = f"{redis.url}?password={PASSWORD}"
        server = start_server(["--engine-core", FAKE_CORE, "--no-embedding-model", "--redis-url", url], str(tmp_path))
        server.stop()
    finally:
        redis.stop()
    log = server.log()
    assert "password=***" in log
    assert PASSWORD not in log


def test_the_models_cli_refuses_a_key_on_its_command_line(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "stoker.cli", "models", "--url", "http://127.0.0.1:9", "list"]
    env = {k: v for k, v in os.environ.items() if k != "STOKER_API_KEY"}
    refused = subprocess.run([*command[:3], "models", "--api-key", "sk-secret", *command[4:]],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 2
    assert "STOKER_API_KEY" in refused.stderr and "--api-key-file" in refused.stderr

    empty = tmp_path / "empty"
    empty.write_text("\n")
    bad_file = subprocess.run([*command[:4], "--api-key-file", str(empty), *command[4:]],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad_file.returncode == 2 and "is empty" in bad_file.stderr


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    """A server with one admin key, for the models CLI to reach with the key from a file or the environment."""
    tmp = tmp_path_factory.mktemp("secrets")
    db = str(tmp / "keys.db")
    made = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "keys", "create", "--name", "ops", "--admin", "--db", db],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    secret = next(word for word in made.stdout.split() if word.startswith("sk-"))
    server = start_server(["--engine-core", FAKE_CORE, "--no-embedding-model", "--db", db], str(tmp))
    try:
        yield server, secret
    finally:
        server.stop()


def test_the_models_cli_takes_its_key_from_a_file_or_the_environment(
    keyed_server: tuple[ServerProcess, str], tmp_path: Path
) -> None:
    server, secret = keyed_server
    key_file = tmp_path / "key"
    key_file.write_text(secret + "\n")
    base = [sys.executable, "-m", "stoker.cli", "models", "--url", server.url]
    env = {k: v for k, v in os.environ.items() if k != "STOKER_API_KEY"}
    from_file = subprocess.run([*base, "--api-key-file", str(key_file), "list"],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert from_file.returncode == 0, from_file.stderr
    from_env = subprocess.run([*base, "list"], cwd=REPO, env={**env, "STOKER_API_KEY": secret},
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert from_env.returncode == 0, from_env.stderr
    without = subprocess.run([*base, "list"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert without.returncode == 1 and "401" in without.stderr


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--allowed-hosts", "127.0.0.1 localhost *.stoker.test"],
        str(tmp_path_factory.mktemp("hosts")),
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("host", ["attacker.example", "127.0.0.1.attacker.example", "stoker.test.attacker.example"])
def test_a_foreign_host_header_is_refused(guarded_server: ServerProcess, host: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = httpx.post(f"{guarded_server.url}/v1/chat/completions", json=body, headers={"Host": host}, timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_host"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "api.stoker.test"])
def test_an_allowed_host_header_is_served(guarded_server: ServerProcess, host: str) -> None:
    headers = {"Host": f"{host}:{guarded_server.port}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = httpx.post(f"{guarded_server.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("tls-policy")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.pem",
             "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", cwd=d)  # fmt: skip
    port = free_port()
    log = open(d / "server.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", "serve", "--engine-core", FAKE_CORE, "--no-embedding-model",
         "--db", str(d / "k.db"), "--port", str(port),
         "--ssl-keyfile", str(d / "server.key"), "--ssl-certfile", str(d / "server.pem")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO])}, stdout=log, stderr=log,
    )  # fmt: skip
    server = ServerProcess(proc, port, str(d / "server.log"))
    context = ssl.create_default_context(cafile=str(d / "server.pem"))
    try:
        for _ in range(600):
            try:
                if httpx.get(f"https://127.0.0.1:{port}/health", verify=context, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                if proc.poll() is not None:
                    raise RuntimeError(server.log()) from None
                time.sleep(0.1)
        yield server, d
    finally:
        server.stop()
        log.close()


def _handshake(port: int, ca: Path, *, ciphers: str | None = None, version: ssl.TLSVersion | None = None) -> str:
    """The cipher the server chose for a client limited as asked; raises ssl.SSLError if none fits."""
    import socket

    context = ssl.create_default_context(cafile=str(ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if version is not None:
        context.maximum_version = version
    if ciphers is not None:
        context.set_ciphers(ciphers)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        cipher = tls.cipher()
        assert cipher is not None
        return cipher[0]


def test_tls_offers_only_forward_secret_aead_suites(tls_server: tuple[ServerProcess, Path]) -> None:
    server, d = tls_server
    tls12 = ssl.TLSVersion.TLSv1_2
    chosen = _handshake(server.port, d / "server.pem", version=tls12)
    assert chosen.startswith("ECDHE-") and ("GCM" in chosen or "CHACHA20" in chosen), chosen
    # What uvicorn's default ("TLSv1" cipher string) accepted: CBC suites such as ECDHE-RSA-AES128-SHA256; and
    # below them SHA-1 MACs and static-RSA key exchange.
    for legacy in ("ECDHE-RSA-AES128-SHA256", "AES128-SHA", "ECDHE-RSA-AES128-SHA", "AES256-GCM-SHA384"):
        with pytest.raises(ssl.SSLError):
            _handshake(server.port, d / "server.pem", ciphers=legacy, version=tls12)
    assert _handshake(server.port, d / "server.pem").startswith("TLS_")  # TLS 1.3 still negotiated
