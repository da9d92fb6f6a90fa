"""HTTPS and mTLS (--ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs)
on the fake core, with certificates made by the openssl command for the test;
and wrong TLS settings refused at start in one line naming the flag."""

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
from conftest import FAKE_CORE, REPO, TESTS_DIR, free_port

from stoker.server.cli import check_tls
from stoker.server.config import ServerConfig

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by the CA."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=stoker test CA", cwd=d)  # fmt: skip
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf", cwd=d)  # fmt: skip
    return d


def _serve(tmp: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", "serve", "--engine-core", FAKE_CORE, "--no-embedding-model"]
        + ["--db", str(tmp / "k.db"), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO])},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _context(pki: Path, client_cert: bool = True) -> ssl.SSLContext:
    """Trusts the test CA; presents the client certificate if asked."""
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client_cert:
        context.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    return context


def _wait(url: str, context: ssl.SSLContext) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2, verify=context).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


@pytest.fixture(scope="module")
def mtls_server(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    proc = _serve(
        tmp_path_factory.mktemp("tls"),
        "--port", str(port),
        "--ssl-keyfile", str(pki / "server.key"), "--ssl-certfile", str(pki / "server.pem"),
        "--ssl-ca-certs", str(pki / "ca.pem"), "--ssl-cert-reqs", "2",
    )  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    try:
        _wait(url, _context(pki))
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_https_with_a_client_certificate(mtls_server: str, pki: Path) -> None:
    client = httpx.Client(verify=_context(pki))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    reply = client.post(f"{mtls_server}/v1/chat/completions", json=body)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]


def test_no_client_certificate_or_plain_http_is_refused(mtls_server: str, pki: Path) -> None:
    with pytest.raises(httpx.HTTPError):  # the handshake fails: no client certificate
        httpx.get(f"{mtls_server}/health", verify=_context(pki, client_cert=False))
    with pytest.raises(httpx.HTTPError):
        httpx.get(mtls_server.replace("https", "http") + "/health")
    with pytest.raises(httpx.HTTPError):  # the server's certificate is checked against the system CAs: unknown
        httpx.get(f"{mtls_server}/health")


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"ssl_certfile": "server.pem"}, "--ssl-keyfile and --ssl-certfile go together"),
        ({"ssl_ca_certs": "ca.pem"}, "need --ssl-certfile"),
        ({"ssl_certfile": "server.pem", "ssl_keyfile": "client.key"}, "--ssl-certfile/--ssl-keyfile: cannot load"),
        ({"ssl_certfile": "nowhere.pem", "ssl_keyfile": "server.key"}, "nowhere.pem"),
        ({"ssl_certfile": "server.pem", "ssl_keyfile": "server.key", "ssl_cert_reqs": 2}, "needs --ssl-ca-certs"),
        ({"ssl_certfile": "server.pem", "ssl_keyfile": "server.key", "ssl_ca_certs": "san.cnf"}, "--ssl-ca-certs: cannot load"),
    ],
)  # fmt: skip
def test_wrong_tls_settings_are_named(pki: Path, settings: dict, says: str) -> None:
    paths = {k: str(pki / v) if isinstance(v, str) else v for k, v in settings.items()}
    with pytest.raises(ValueError, match=None) as info:
        check_tls(ServerConfig(**paths))
    assert says in str(info.value)
