"""What an outside fuzzer needs from /openapi.json (issue 34 item 11), against
a live server (fake engine core): links from every answer that creates
something to the operations that read, change or delete it, followed here
as a stateful fuzzer follows them; a documented POST /admin/models body
(its example) that the server takes; and a deadline too short to be met at
all refused with a 400 naming the minimum, while one that passes in the
queue stays a 504.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import FAKE_CORE, ServerProcess, auth, start_server

from stoker.control.db import open_db
from stoker.control.keys import KeyStore

pytestmark = pytest.mark.timeout(180)

STEP_S = 0.02  # fake engine: 50 tokens/s, one sequence at a time


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    tmp = tmp_path_factory.mktemp("security-fuzz")
    db = str(tmp / "stoker.db")
    _, secret = KeyStore(open_db(db)).create("operator", admin=True)
    server = start_server(
        [
            "--engine-core",
            FAKE_CORE,
            "--no-embedding-model",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "1",
            "--db",
            db,
            "--require-auth",
        ],
        str(tmp),
        env={"STOKER_FAKE_STEP_S": str(STEP_S)},
    )
    try:
        yield server, secret
    finally:
        server.stop()


@pytest.fixture(scope="module")
def schema(served: tuple[ServerProcess, str]) -> dict[str, Any]:
    server, secret = served
    answer = httpx.get(f"{server.url}/openapi.json", headers=auth(secret))
    assert answer.status_code == 200, answer.text
    return answer.json()


def operation_by_id(schema: dict[str, Any], operation_id: str) -> tuple[str, str]:
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if operation.get("operationId") == operation_id:
                return method, path
    raise AssertionError(f"no operation {operation_id}")


def links_of(schema: dict[str, Any], method: str, path: str, status: str) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """A response's links as name -> (method, path, link), the target resolved by operationId."""
    answer = schema["paths"][path][method]["responses"][status]
    return {name: (*operation_by_id(schema, link["operationId"]), link) for name, link in answer["links"].items()}


def evaluate(expression: str, body: dict[str, Any]) -> Any:
    """An OpenAPI runtime expression of the form $response.body#/pointer."""
    prefix = "$response.body#"
    assert expression.startswith(prefix), expression
    value: Any = body
    for part in expression[len(prefix) :].split("/")[1:]:
        value = value[part.replace("~1", "/").replace("~0", "~")]
    return value


def follow(
    http: httpx.Client, link: tuple[str, str, dict[str, Any]], created: dict[str, Any], body: dict[str, Any] | None
) -> httpx.Response:
    method, path, declared = link
    for name, expression in declared.get("parameters", {}).items():
        path = path.replace("{" + name + "}", str(evaluate(expression, created)))
    merged = dict(body or {})
    for name, expression in declared.get("requestBody", {}).items():
        merged[name] = evaluate(expression, created)
    return http.request(method.upper(), path, json=merged if merged else None)


def test_every_created_thing_links_to_its_readers_and_deleters(schema: dict[str, Any]) -> None:
    expected = {
        ("post", "/admin/keys", "201"): {
            ("get", "/admin/keys/{key_id}"),
            ("delete", "/admin/keys/{key_id}"),
        },
        ("post", "/v1/responses", "200"): {
            ("get", "/v1/responses/{response_id}"),
            ("delete", "/v1/responses/{response_id}"),
            ("post", "/v1/responses"),
        },
        ("post", "/admin/models", "200"): {
            ("get", "/admin/models"),
            ("get", "/v1/models/{model_id}"),
            ("post", "/admin/models/{name}/promote"),
            ("post", "/admin/models/{name}/rollback"),
            ("put", "/admin/models/{name}/canary"),
            ("delete", "/admin/models/{name}"),
        },
    }
    for (method, path, status), targets in expected.items():
        links = links_of(schema, method, path, status)
        assert {(m, p) for m, p, _ in links.values()} == targets, (path, links)
        for target_method, target_path, link in links.values():
            # Every path parameter of the target is filled from the answer.
            parameters = [
                p["name"]
                for p in schema["paths"][target_path][target_method].get("parameters", [])
                if p["in"] == "path"
            ]
            assert sorted(link.get("parameters", {})) == sorted(parameters), (target_path, link)
    continued = links_of(schema, "post", "/v1/responses", "200")["ContinueResponse"][2]
    assert continued["requestBody"] == {"previous_response_id": "$response.body#/id"}


def test_a_stateful_sequence_along_the_links(served: tuple[ServerProcess, str], schema: dict[str, Any]) -> None:
    server, secret = served
    with httpx.Client(base_url=server.url, headers=auth(secret), timeout=30) as http:
        # A key: created, read, revoked; revoked, it no longer authenticates.
        created = http.post("/admin/keys", json={"name": "linked"})
        assert created.status_code == 201, created.text
        key = created.json()
        links = links_of(schema, "post", "/admin/keys", "201")
        shown = follow(http, links["ShowKey"], key, None)
        assert shown.status_code == 200 and shown.json()["status"] == "active", shown.text
        assert http.get("/v1/models", headers=auth(key["secret"])).status_code == 200
        assert follow(http, links["RevokeKey"], key, None).status_code == 200
        assert follow(http, links["ShowKey"], key, None).json()["status"] == "revoked"
        assert http.get("/v1/models", headers=auth(key["secret"])).status_code == 401

        # A stored response: created, read, continued, deleted, then gone.
        first = http.post("/v1/responses", json={"input": "hello", "max_output_tokens": 3})
        assert first.status_code == 200, first.text
        stored = first.json()
        links = links_of(schema, "post", "/v1/responses", "200")
        read = follow(http, links["RetrieveResponse"], stored, None)
        assert read.status_code == 200 and read.json()["id"] == stored["id"], read.text
        second = follow(http, links["ContinueResponse"], stored, {"input": "again", "max_output_tokens": 3})
        assert second.status_code == 200, second.text
        assert second.json()["previous_response_id"] == stored["id"]
        deleted = follow(http, links["DeleteResponse"], stored, None)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True, deleted.text
        assert follow(http, links["RetrieveResponse"], stored, None).status_code == 404
        assert follow(http, links["DeleteResponse"], stored, None).status_code == 404
        gone = follow(http, links["ContinueResponse"], stored, {"input": "again", "max_output_tokens": 3})
        assert gone.status_code in (400, 404) and gone.json()["error"]["param"] == "previous_response_id", gone.text


def test_the_documented_load_model_body_is_accepted(served: tuple[ServerProcess, str], schema: dict[str, Any]) -> None:
    """POST /admin/models with its schema's example (on this machine's model
    file), then along its links: a name with "/" in it too, as the schema's
    pattern allows."""
    server, secret = served
    body_schema = schema["components"]["schemas"]["LoadModel"]
    example = body_schema["examples"][0]
    assert set(example) <= set(body_schema["properties"]) and set(body_schema["required"]) <= set(example)
    assert "pattern" in body_schema["properties"]["name"]
    digest_schema = body_schema["properties"]["digest"]["anyOf"][0]
    assert digest_schema["pattern"] == "^sha256:[0-9a-fA-F]{64}$"
    links = links_of(schema, "post", "/admin/models", "200")
    with httpx.Client(base_url=server.url, headers=auth(secret), timeout=120) as http:
        served_model = http.get("/admin/models").json()["data"][0]["stable"]
        for name in (example["name"], "org/" + example["name"]):
            body = {**example, "name": name, "path": served_model["path"]}
            loaded = http.post("/admin/models", json=body)
            assert loaded.status_code == 200, loaded.text
            answer = loaded.json()
            assert answer["name"] == name and answer["status"] == "serving"
            listed = follow(http, links["ListModels"], answer, None)
            assert name in {m["name"] for m in listed.json()["data"]}
            assert follow(http, links["RetrieveModel"], answer, None).json()["id"] == name
            # No canary: promote and roll back conflict with what is loaded (409, documented).
            for action in ("PromoteCanary", "RollBackCanary"):
                conflict = follow(http, links[action], answer, None)
                assert conflict.status_code == 409, conflict.text
                method, path, _ = links[action]
                assert "409" in schema["paths"][path][method]["responses"]
            # The actions' paths stay theirs: not an unload of a model named "<name>/canary".
            wrong = http.delete(f"/admin/models/{name}/canary")
            assert wrong.status_code == 405 and wrong.headers["allow"] == "PUT", (wrong.headers, wrong.text)
            unloaded = follow(http, links["UnloadModel"], answer, None)
            assert unloaded.status_code == 200 and unloaded.json()["name"] == name, unloaded.text
        # The digest's documented form is what is checked: an upper-case one is
        # taken (and matched against the file), another form is refused.
        upper = {
            **example,
            "path": served_model["path"],
            "digest": served_model["digest"].upper().replace("SHA", "sha"),
        }
        loaded = http.post("/admin/models", json={**upper, "name": "upper-digest"})
        assert loaded.status_code == 200, loaded.text
        assert http.delete("/admin/models/upper-digest").status_code == 200
        refused = http.post("/admin/models", json={**upper, "name": "bad-digest", "digest": "md5:00"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "digest", refused.text
        # A path no file can have (NUL) is refused by its documented pattern (it was a 500 in the path check).
        assert body_schema["properties"]["path"]["pattern"] == "^[^\\x00]+$"
        refused = http.post("/admin/models", json={**example, "path": "?\u0000"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "path", refused.text


async def test_a_deadline_too_short_to_be_met_is_400_one_that_passes_in_the_queue_504(
    served: tuple[ServerProcess, str], schema: dict[str, Any]
) -> None:
    server, secret = served
    async with httpx.AsyncClient(base_url=server.url, headers=auth(secret), timeout=30) as http:
        for too_short in (5e-324, 0.0005):
            refused = await http.post("/v1/completions", json={"prompt": "q", "max_tokens": 2, "timeout": too_short})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "timeout" and "0.001" in error["message"], error
        for too_short_ms in ("0.5", "1e-300", "0"):
            refused = await http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                headers={"x-stoker-deadline-ms": too_short_ms},
            )
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "x-stoker-deadline-ms" and "at least 1 " in error["message"], error

        # The minimum itself is taken; spent waiting behind a running request, it is a 504.
        blocker = asyncio.create_task(http.post("/v1/completions", json={"prompt": "q", "max_tokens": 40}))
        deadline = time.monotonic() + 10
        while (await http.get("/ready")).json()["engine_stats"]["num_running"] < 1:
            assert time.monotonic() < deadline, "the blocking request never ran"
            await asyncio.sleep(0.02)
        by_body = await http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2, "timeout": 0.001})
        by_header = await http.post(
            "/v1/completions", json={"prompt": "late", "max_tokens": 2}, headers={"x-stoker-deadline-ms": "1"}
        )
        assert (await blocker).status_code == 200
    for late in (by_body, by_header):
        assert late.status_code == 504, late.text
        assert late.json()["error"]["code"] == "deadline_exceeded"
    # The schema states the minimum the server checks.
    timeout_schema = schema["components"]["schemas"]["CompletionRequest"]["properties"]["timeout"]["anyOf"][0]
    assert timeout_schema["minimum"] == 0.001 and "exclusiveMinimum" not in timeout_schema
