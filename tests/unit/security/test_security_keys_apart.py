"""Keys kept apart (issue 34, item 3), against a real `stoker serve` over the
fake engine core with several API keys: a client's X-Request-Id is only a
correlation field, so nothing one key sends can read, overwrite, delete or
fail another key's stored responses or requests in flight; stored responses
have a per-key bound (evicting the key's own oldest) and an entry size bound;
/v1/responses and /v1/messages metadata have OpenAI's and Anthropic's limits."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from conftest import FAKE_CORE, start_server

from stoker.control.db import open_db
from stoker.control.keys import KeyStore

pytestmark = pytest.mark.timeout(180)
PER_KEY = 3
ENTRY_BYTES = 4096


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys-apart")
    db = str(tmp / "stoker.db")
    store = KeyStore(open_db(db))
    keys = {name: store.create(name) for name in ("alice", "bob", "carol", "dave", "erin")}
    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "8192", "--num-kv-blocks", "1024"],
        str(tmp),
        env={
            "STOKER_DB": db,
            "STOKER_REQUIRE_AUTH": "true",
            "STOKER_FAKE_STEP_S": "0.02",  # 50 tokens/s: a long request is easy to hold in flight
            # Set through the environment so that a server without these options still starts
            # (and these tests fail on their assertions, not at startup).
            "STOKER_RESPONSES_STORE_PER_KEY": str(PER_KEY),
            "STOKER_RESPONSES_STORE_ENTRY_BYTES": str(ENTRY_BYTES),
        },
    )
    try:
        yield server, {name: (key.id, secret) for name, (key, secret) in keys.items()}
    finally:
        server.stop()


def auth(secret: str, request_id: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {secret}"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return headers


def create(http: httpx.Client, secret: str, request_id: str | None = None, **body: Any) -> httpx.Response:
    return http.post(
        "/v1/responses",
        json={"model": "fake-model", "input": "hi", "max_output_tokens": 2, **body},
        headers=auth(secret, request_id),
    )


def log_lines(server) -> list[dict[str, Any]]:
    return [json.loads(x) for x in server.log().splitlines() if x.startswith('{"ts"')]


def test_reusing_another_keys_request_id_cannot_overwrite_read_or_delete_its_response(served) -> None:
    server, keys = served
    (_, alice), (_, bob) = keys["alice"], keys["bob"]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        mine = create(http, alice, "shared-id", input="alice's question", max_output_tokens=5)
        theirs = create(http, bob, "shared-id", input="bob", max_output_tokens=2)
        assert mine.status_code == theirs.status_code == 200, (mine.text, theirs.text)
        # The client's id is echoed, never used as the response id.
        assert mine.headers["x-request-id"] == theirs.headers["x-request-id"] == "shared-id"
        mine_id, theirs_id = mine.json()["id"], theirs.json()["id"]
        assert mine_id != theirs_id and "shared-id" not in mine_id + theirs_id

        # Alice's response is intact after Bob's request.
        kept = http.get(f"/v1/responses/{mine_id}", headers=auth(alice))
        assert kept.status_code == 200 and kept.json() == mine.json()
        # Bob can neither read, continue nor delete it: answered exactly as an unknown id.
        assert http.get(f"/v1/responses/{mine_id}", headers=auth(bob)).status_code == 404
        assert http.delete(f"/v1/responses/{mine_id}", headers=auth(bob)).status_code == 404
        unknown = "resp_req-" + "0" * 32
        foreign = create(http, bob, previous_response_id=mine_id)
        missing = create(http, bob, previous_response_id=unknown)
        assert foreign.status_code == missing.status_code
        assert foreign.json()["error"] == {
            **missing.json()["error"],
            "message": missing.json()["error"]["message"].replace(unknown, mine_id),
        }
        assert http.get(f"/v1/responses/{mine_id}", headers=auth(alice)).json() == mine.json()
        # Continuing it is Alice's alone: her conversation, not Bob's.
        follow = create(http, alice, "shared-id", input="more", previous_response_id=mine_id)
        assert follow.status_code == 200
        assert follow.json()["usage"]["input_tokens"] > len("alice's question") + 5
        assert http.delete(f"/v1/responses/{theirs_id}", headers=auth(bob)).json()["deleted"] is True
        assert http.get(f"/v1/responses/{mine_id}", headers=auth(alice)).status_code == 200


async def stream_response(http: httpx.AsyncClient, secret: str, started: asyncio.Event, **body: Any) -> dict:
    """Stream a /v1/responses request with X-Request-Id "same-id"; its final Response."""
    events: list[dict] = []
    request = {"model": "fake-model", "input": "hi", "stream": True, **body}
    async with http.stream("POST", "/v1/responses", json=request, headers=auth(secret, "same-id")) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["x-request-id"] == "same-id"
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                started.set()
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    return events[-1]["response"]


async def test_same_request_id_at_once_from_two_keys_both_succeed(served) -> None:
    server, keys = served
    (carol_id, carol), (dave_id, dave) = keys["carol"], keys["dave"]
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        carol_started, dave_started = asyncio.Event(), asyncio.Event()
        slow = asyncio.create_task(stream_response(http, carol, carol_started, max_output_tokens=100))
        await asyncio.wait_for(carol_started.wait(), 10)
        # Dave's request runs and ends while Carol's, with the same X-Request-Id, is still generating.
        fast = await stream_response(http, dave, dave_started, max_output_tokens=3)
        assert not slow.done()
        chat = await http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            headers=auth(dave, "same-id"),
        )
        done = await slow
        assert len(done["output"][0]["content"][0]["text"]) == 100 and len(fast["output"][0]["content"][0]["text"]) == 3
        # Each key reads its own, whichever finished first; neither reads the other's.
        for owner, other, response in ((dave, carol, fast), (carol, dave, done)):
            got = await http.get(f"/v1/responses/{response['id']}", headers=auth(owner))
            assert got.status_code == 200 and got.json()["output"] == response["output"]
            assert (await http.get(f"/v1/responses/{response['id']}", headers=auth(other))).status_code == 404
        assert done["id"] != fast["id"]
        assert chat.status_code == 200 and chat.headers["x-request-id"] == "same-id"
        assert "same-id" not in chat.json()["id"]

    # The log: each request under its own server id (its engine id too, unsuffixed),
    # the client's id beside it as client_request_id.
    lines = [
        x for x in log_lines(server) if x.get("client_request_id") == "same-id" and x["key_id"] in (carol_id, dave_id)
    ]
    assert len(lines) == 3 and len({x["request_id"] for x in lines}) == 3
    assert all(x["status"] == 200 and x["engine_request_id"] == x["request_id"] for x in lines)
    assert {x["request_id"] for x in lines} >= {done["id"].removeprefix("resp_"), fast["id"].removeprefix("resp_")}


def test_per_key_bound_evicts_the_keys_own_oldest(served) -> None:
    server, keys = served
    (_, alice), (_, erin) = keys["alice"], keys["erin"]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        alices = create(http, alice, "bound").json()["id"]
        erins = [create(http, erin, "bound").json()["id"] for _ in range(PER_KEY + 2)]

        def kept(secret: str, response_id: str) -> bool:
            return http.get(f"/v1/responses/{response_id}", headers=auth(secret)).status_code == 200

        # Erin over her bound lost her own two oldest, and only hers.
        assert [kept(erin, rid) for rid in erins] == [False, False, True, True, True]
        assert kept(alice, alices)
        # A read counts as a use: the one read last is the last of hers to go.
        assert kept(erin, erins[2])
        create(http, erin)
        assert [kept(erin, rid) for rid in erins[2:]] == [True, False, True]
        assert kept(alice, alices)


def test_entry_size_bound(served) -> None:
    server, keys = served
    _, bob = keys["bob"]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        big = "x" * ENTRY_BYTES
        # Over the bound with its input alone: answered, not stored, and it says so.
        r = create(http, bob, input=big)
        assert r.status_code == 200 and r.json()["store"] is False
        assert http.get(f"/v1/responses/{r.json()['id']}", headers=auth(bob)).status_code == 404
        # Asked to store it explicitly: refused before it runs, naming the field and the bound.
        refused = create(http, bob, input=big, store=True)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "store" and str(ENTRY_BYTES) in error["message"]
        # An input that fits, with an output that pushes the entry over: "store" false at the end,
        # streamed or not. Each output token (one byte here) weighs two bytes, in the response and
        # in the conversation: with this input the entry is over from ~66 tokens on, so 100 tokens
        # (2 s at the fake's 50 tokens/s) are over by a margin, and one token is well under.
        near = "y" * (ENTRY_BYTES - 1050)
        r = create(http, bob, input=near, max_output_tokens=100)
        assert r.status_code == 200 and r.json()["store"] is False
        assert http.get(f"/v1/responses/{r.json()['id']}", headers=auth(bob)).status_code == 404
        body = {"model": "fake-model", "input": near, "max_output_tokens": 100, "stream": True}
        with http.stream("POST", "/v1/responses", json=body, headers=auth(bob)) as streamed:
            events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[0]["response"]["store"] is True and events[-1]["response"]["store"] is False
        assert http.get(f"/v1/responses/{events[-1]['response']['id']}", headers=auth(bob)).status_code == 404
        small = create(http, bob, input=near, max_output_tokens=1)
        assert small.json()["store"] is True
        assert http.get(f"/v1/responses/{small.json()['id']}", headers=auth(bob)).status_code == 200


@pytest.mark.parametrize(
    ("metadata", "fragment"),
    [
        ({f"k{i}": "v" for i in range(17)}, "16"),
        ({"k" * 65: "v"}, "64"),
        ({"k": "v" * 513}, "512"),
    ],
)
def test_responses_metadata_bounds(served, metadata: dict[str, str], fragment: str) -> None:
    server, keys = served
    _, alice = keys["alice"]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = create(http, alice, metadata=metadata)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "metadata" and fragment in error["message"], error
        at_limit = {f"{i:0>64}": "v" * 512 for i in range(16)}
        ok = create(http, alice, metadata=at_limit)
        assert ok.status_code == 200 and ok.json()["metadata"] == at_limit


def test_messages_metadata_bounds(served) -> None:
    server, keys = served
    _, alice = keys["alice"]
    body = {"model": "fake-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/messages", json={**body, "metadata": {"user_id": "u" * 257}}, headers=auth(alice))
        assert r.status_code == 400 and r.json()["error"]["param"] == "metadata.user_id"
        assert "256" in r.json()["error"]["message"]
        r = http.post("/v1/messages", json={**body, "metadata": {"other": "x" * 10_000}}, headers=auth(alice))
        assert r.status_code == 400 and r.json()["error"]["param"] == "metadata.other"
        ok = http.post("/v1/messages", json={**body, "metadata": {"user_id": "u" * 256}}, headers=auth(alice))
        assert ok.status_code == 200
