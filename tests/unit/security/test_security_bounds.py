"""Issue 34 item 4, against a real `stoker serve` process: every list and object
in a request body has a documented maximum (400 naming the field and the
maximum); a body over --max-body-bytes is a 413 before it is parsed and a body
sent too slowly a 408; headers are bounded in time (slow-header clients are
cut off) and size; /tokenize, /detokenize, the render endpoints and
count_tokens go through the key's model allow-list and request rate like
generation does; and tokenizing runs off the event loop, so /health stays
fast while a multi-megabyte /tokenize is being served.

New options are given as STOKER_* variables, so the same test runs against a
server that does not know them (and fails there on the behaviour, not on a flag).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from conftest import FAKE_CORE, REPO, ServerProcess, start_server

from stoker.control.db import open_db
from stoker.control.keys import KeyStore

pytestmark = pytest.mark.timeout(300)
CHAT = [{"role": "user", "content": "hi"}]
BODY_LIMIT = 2 * 1024 * 1024
MAX_CONNECTIONS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("bounds")
    db = str(tmp / "stoker.db")
    store = KeyStore(open_db(db))
    keys = {
        "admin": store.create("root", admin=True),
        "rpm": store.create("rpm", rpm=4, models=["fake-model"]),
        "other": store.create("other-model-only", models=["nope"]),
    }
    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256"]
        + ["--max-body-bytes", str(BODY_LIMIT)],
        str(tmp),
        env={
            "STOKER_DB": db,
            "STOKER_REQUIRE_AUTH": "true",
            "STOKER_FAKE_STEP_S": "0.005",
            "STOKER_HEADER_READ_TIMEOUT": "1",
            "STOKER_BODY_READ_TIMEOUT": "1",
            "STOKER_MAX_HEADER_BYTES": "8192",
            "STOKER_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        },
    )
    try:
        yield server, {name: secret for name, (_, secret) in keys.items()}
    finally:
        server.stop()


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def tool(i: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": f"f{i}"}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": CHAT, "max_tokens": 2, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


# The documented maxima (docs/server.md, "Request bounds"), written out: the test
# holds the server to the documentation, and test_docs_list_every_bound the
# documentation to the code.
B = SimpleNamespace(
    MAX_MESSAGES=2048,
    MAX_CONTENT_PARTS=1024,
    MAX_TOOLS=128,
    MAX_STOP_STRINGS=64,
    MAX_STOP_STRING_CHARS=1024,
    MAX_STOP_TOKEN_IDS=256,
    MAX_LOGIT_BIAS=300,
    MAX_TOP_LOGPROBS=20,
    MAX_CHOICES=1024,
    MAX_TEMPLATE_KWARGS=64,
    MAX_PROMPTS=2048,
    MAX_TOKEN_IDS=262_144,
    MAX_EMBEDDING_INPUTS=2048,
    MAX_EXTRA_FIELDS=64,
    MAX_NAME_CHARS=256,
    MAX_INCLUDE=16,
    MAX_JSON_DEPTH=900,
)
# (path, body, what the message must name, the documented maximum)
OVER_THE_BOUND: list[tuple[str, dict[str, Any], str, int]] = [
    ("/v1/chat/completions", chat(messages=CHAT * (B.MAX_MESSAGES + 1)), "messages", B.MAX_MESSAGES),
    (
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * (B.MAX_CONTENT_PARTS + 1)}]),
        "content",
        B.MAX_CONTENT_PARTS,
    ),
    ("/v1/chat/completions", chat(stop=["x"] * (B.MAX_STOP_STRINGS + 1)), "stop", B.MAX_STOP_STRINGS),
    ("/v1/chat/completions", chat(stop="x" * (B.MAX_STOP_STRING_CHARS + 1)), "stop", B.MAX_STOP_STRING_CHARS),
    ("/v1/chat/completions", chat(stop_token_ids=[5] * (B.MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids", 256),
    ("/v1/chat/completions", chat(logit_bias={str(i): 1 for i in range(B.MAX_LOGIT_BIAS + 1)}), "logit_bias", 300),
    ("/v1/chat/completions", chat(logit_bias={"5": 101}), "logit_bias", 100),
    ("/v1/chat/completions", chat(tools=[tool(i) for i in range(B.MAX_TOOLS + 1)]), "tools", B.MAX_TOOLS),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=B.MAX_TOP_LOGPROBS + 1), "top_logprobs", 20),
    (
        "/v1/chat/completions",
        chat(chat_template_kwargs={f"k{i}": 1 for i in range(B.MAX_TEMPLATE_KWARGS + 1)}),
        "chat_template_kwargs",
        B.MAX_TEMPLATE_KWARGS,
    ),
    ("/v1/chat/completions", chat(guided_choice=["a"] * (B.MAX_CHOICES + 1)), "guided_choice", B.MAX_CHOICES),
    ("/v1/chat/completions", chat(user="u" * (B.MAX_NAME_CHARS + 1)), "user", B.MAX_NAME_CHARS),
    ("/v1/chat/completions", chat(**{f"x{i}": 1 for i in range(B.MAX_EXTRA_FIELDS + 1)}), "fields", 64),
    (
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "x", **{f"x{i}": 1 for i in range(B.MAX_EXTRA_FIELDS + 1)}}]),
        "messages.0",
        B.MAX_EXTRA_FIELDS,
    ),
    ("/v1/completions", completion(prompt=["x"] * (B.MAX_PROMPTS + 1)), "prompt", B.MAX_PROMPTS),
    ("/v1/completions", completion(prompt=[5] * (B.MAX_TOKEN_IDS + 1)), "prompt", B.MAX_TOKEN_IDS),
    ("/v1/embeddings", {"input": ["x"] * (B.MAX_EMBEDDING_INPUTS + 1)}, "input", B.MAX_EMBEDDING_INPUTS),
    ("/v1/embeddings", {"input": [5] * (B.MAX_TOKEN_IDS + 1)}, "input", B.MAX_TOKEN_IDS),
    ("/v1/completions", completion(prompt=[[5]] * (B.MAX_PROMPTS + 1)), "prompt", B.MAX_PROMPTS),
    ("/detokenize", {"tokens": [5] * (B.MAX_TOKEN_IDS + 1)}, "tokens", B.MAX_TOKEN_IDS),
    (
        "/v1/messages",
        {"max_tokens": 2, "messages": CHAT * (B.MAX_MESSAGES + 1)},
        "messages",
        B.MAX_MESSAGES,
    ),
    (
        "/v1/responses",
        {"max_output_tokens": 2, "input": [{"role": "user", "content": "x"}] * (B.MAX_MESSAGES + 1)},
        "input",
        B.MAX_MESSAGES,
    ),
]


def test_every_list_and_object_has_a_bound(served: tuple[ServerProcess, dict[str, str]]) -> None:
    server, secrets = served
    with httpx.Client(base_url=server.url, timeout=60, headers=bearer(secrets["admin"])) as http:
        failures = []
        for path, body, field, maximum in OVER_THE_BOUND:
            r = http.post(path, json=body)
            error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/") else {}
            message = str(error.get("message", ""))
            if r.status_code != 400 or field not in message or str(maximum) not in message:
                failures.append(f"{path} {field} (max {maximum}): {r.status_code} {r.text[:200]}")
        assert not failures, "\n".join(failures)
        deep = '{"messages": [{"role": "user", "content": "hi"}], "x": ' + "[" * 2000 + "]" * 2000 + "}"
        r = http.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nested too deeply" in r.text and "900" in r.text, r.text
        # At the bound, the same fields are accepted.
        at_bound = chat(stop_token_ids=[5] * B.MAX_STOP_TOKEN_IDS, stop=["x"] * B.MAX_STOP_STRINGS)
        assert http.post("/v1/chat/completions", json=at_bound).status_code == 200


def test_body_over_the_limit_is_413_before_parsing_and_a_slow_body_408(
    served: tuple[ServerProcess, dict[str, str]],
) -> None:
    server, secrets = served
    too_big = b"{" * (BODY_LIMIT + 1)  # not JSON: a 400 would mean it was parsed
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", content=too_big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["message"] == f"request body exceeds {BODY_LIMIT} bytes"

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it comes
            for _ in range(3):
                yield b"{" * (BODY_LIMIT // 2)

        r = http.post(
            "/v1/chat/completions",
            content=chunks(),
            headers={**bearer(secrets["admin"]), "content-type": "application/json"},
        )
        assert r.status_code == 413, r.text

    # A body that never finishes: 408 after --body-read-timeout (1 s here), not a connection held forever.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {secrets['admin']}\r\nContent-Length: 100\r\n\r\n".encode()
            + b'{"messages":'
        )
        answer = _read_until_closed(sock, 10)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"body-read-timeout" in answer
        assert time.monotonic() - start < 5


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and b"content-length:" in data.lower():
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(rest) >= length:
                    break
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def test_slow_and_oversized_headers_are_cut_off(served: tuple[ServerProcess, dict[str, str]]) -> None:
    """A client dribbling its headers a byte at a time is answered 408 and closed
    within --header-read-timeout (1 s here) while /health stays fast; headers over
    --max-header-bytes (8 KiB here) get 431."""
    server, _ = served
    closed_after: list[float] = []

    def dribble() -> None:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            start = time.monotonic()
            request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
            try:
                for byte in request:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.05)
                    sock.settimeout(0.001)
                    try:
                        sock.recv(65536)  # the 408, or b"" once closed: the server cut the client off
                        break
                    except TimeoutError:
                        pass
            except (BrokenPipeError, ConnectionResetError):
                pass
            closed_after.append(time.monotonic() - start)

    slow = threading.Thread(target=dribble)
    slow.start()
    worst = 0.0
    with httpx.Client(base_url=server.url, timeout=10) as http:
        while slow.is_alive():
            t0 = time.monotonic()
            assert http.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.05)
    slow.join()
    assert closed_after and closed_after[0] < 3.0, closed_after  # 200 bytes at 20/s would take 10 s
    assert worst < 0.2, f"/health took {worst:.3f} s while a slow client held a connection"

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n")
        answer = _read_until_closed(sock, 10)
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]


def test_connections_are_bounded(served: tuple[ServerProcess, dict[str, str]]) -> None:
    """Past --max-connections (8 here) a request is a 503 in the server's error shape, with Retry-After."""
    server, _ = served
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)  # accepted by the server
        r = httpx.get(f"{server.url}/health", timeout=10)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "too_many_connections" and r.headers["retry-after"] == "1"
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.5)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


TOKENIZER_ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/tokenize", {"model": "fake-model", "prompt": "hello"}),
    ("/tokenize", {"model": "fake-model", "messages": CHAT}),
    ("/detokenize", {"model": "fake-model", "tokens": [70, 71]}),
    ("/v1/chat/completions/render", {"model": "fake-model", "messages": CHAT, "max_tokens": 2}),
    ("/v1/completions/render", {"model": "fake-model", "prompt": "hi", "max_tokens": 2}),
    ("/v1/messages/count_tokens", {"model": "fake-model", "messages": CHAT}),
]


def test_tokenizer_routes_check_the_keys_model_allow_list(served: tuple[ServerProcess, dict[str, str]]) -> None:
    server, secrets = served
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, body in TOKENIZER_ROUTES:
            assert http.post(path, json=body, headers=bearer(secrets["admin"])).status_code == 200, path
            r = http.post(path, json=body, headers=bearer(secrets["other"]))
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"]["code"] == "model_not_allowed", (path, r.text)


def test_rpm_counts_tokenizer_routes(served: tuple[ServerProcess, dict[str, str]]) -> None:
    server, secrets = served
    with httpx.Client(base_url=server.url, timeout=30, headers=bearer(secrets["rpm"])) as http:
        statuses = [http.post(path, json=body).status_code for path, body in TOKENIZER_ROUTES[:4]]
        assert statuses == [200, 200, 200, 200]
        r = http.post("/v1/messages/count_tokens", json=TOKENIZER_ROUTES[-1][1])
        assert r.status_code == 429, r.text
        r = http.post("/tokenize", json=TOKENIZER_ROUTES[0][1])
        assert r.status_code == 429 and "retry-after" in r.headers, r.text


def test_health_answers_while_a_big_tokenize_runs(real_server: ServerProcess) -> None:
    """A multi-megabyte prompt through the real tokenizer (seconds of work) while
    /health is polled: every answer within 0.2 s. The big request goes over a raw
    socket and its answer is read only afterwards, so this process's own JSON
    work never sits between two polls."""
    prompt = "The quick brown fox jumps over the lazy dog; " * 50_000  # 2.2 MB
    payload = json.dumps({"prompt": prompt}).encode()
    head = f"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    done: dict[str, Any] = {}

    def big() -> None:
        with socket.create_connection(("127.0.0.1", real_server.port), timeout=120) as sock:
            start = time.monotonic()
            sock.sendall(head.encode() + b"Connection: close\r\n\r\n" + payload)
            chunks = []
            while chunk := sock.recv(1 << 20):
                chunks.append(chunk)
            done["seconds"] = time.monotonic() - start
            done["answer"] = b"".join(chunks)

    worker = threading.Thread(target=big)
    latencies: list[float] = []
    at: list[float] = []
    with httpx.Client(base_url=real_server.url, timeout=30) as http:
        http.get("/health")
        started = time.monotonic()
        worker.start()
        while worker.is_alive():
            t0 = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            at.append(round(t0 - started, 2))
            time.sleep(0.02)
    worker.join()
    status, _, body = done["answer"].partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200"), done["answer"][:300]
    assert json.loads(body)["count"] > 400_000
    assert done["seconds"] > 0.3, f"the tokenize took {done['seconds']:.2f} s: too little to tell"
    slowest = sorted(zip((round(x, 3) for x in latencies), at), reverse=True)[:4]
    assert max(latencies) < 0.2, (
        f"/health took up to {max(latencies):.3f} s ({len(latencies)} polls) during a {done['seconds']:.1f} s "
        f"/tokenize; slowest (seconds, when): {slowest}"
    )


def test_docs_list_every_bound() -> None:
    """docs/server.md's "Request bounds" table names every constant of stoker/server/bounds.py
    with its value, and the values this test holds the server to are those."""
    from stoker.server import bounds

    with open(os.path.join(REPO, "docs", "server.md")) as f:
        docs = f.read()
    section = docs.split("## Request bounds", 1)[1].split("\n## ", 1)[0]
    constants = {name: value for name, value in vars(bounds).items() if name.startswith("MAX_")}
    assert constants == vars(B)
    for name, value in constants.items():
        row = re.search(rf"^\|[^\n]*`{name}`[^\n]*$", section, re.MULTILINE)
        assert row is not None, f"{name} is not in the Request bounds table"
        assert re.search(rf"\b{value:,}\b|\b{value}\b", row.group(0)), f"{name}: {value} not in {row.group(0)}"
