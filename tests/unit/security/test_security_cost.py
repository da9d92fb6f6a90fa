"""Issue 34 item 2: a request's whole cost (its prompts x n x (prompt + max_tokens),
control/cost.py) is what admission, tpm and budgets see, against real servers
over the fake engine core: one with its limits in process and its ledger in
SQLite, one sharing Redis (rate limits, Lua scripts) and PostgreSQL (budget
reservations). A prompt list too large for the key's tpm is refused where one
prompt passes; a budget is never overshot, not even by requests racing each
other; the per-request caps (prompts, n, context, KV capacity) are 400s naming
their maximum."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from conftest import FAKE_CORE, ServerProcess, auth, start_server
from postgres_server import PostgresServer
from redis_server import RedisServer, redis_server_binary

from stoker.control.admission import AdmissionController
from stoker.control.db import make_engine, open_db
from stoker.control.gate import RequestGate
from stoker.control.keys import KeyStore
from stoker.control.ledger import UsageLedger
from stoker.control.limits import RateLimiter
from stoker.errors import APIError

pytestmark = pytest.mark.timeout(180)

MAX_PROMPTS = 8
MAX_N = 4
CONTEXT = 256
KV_TOKENS = 64 * 16  # the fake core's default cache: 64 blocks of 16 tokens
PROMPT = [100] * 10  # ten tokens (the fake tokenizer's ids)


@dataclass
class Served:
    server: ServerProcess
    db_url: str
    secrets: dict[str, str]
    key_ids: dict[str, str]


# Each test spends its own key, so the order of the tests does not matter.
KEYS = {
    "tpm": {"tpm": 300},
    "budget": {"budget_tokens": 1000, "budget_period": "day"},
    "race": {"budget_tokens": 900, "budget_period": "day"},
    "caps": {"rpm": 2},
    "concurrent": {"max_concurrent": 2},
}


def _serve(tmp: str, db_url: str, extra: list[str], env: dict[str, str]) -> Served:
    store = KeyStore(open_db(db_url))
    made = {name: store.create(name, **limits) for name, limits in KEYS.items()}
    args = ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", str(CONTEXT)]
    args += ["--max-prompts-per-request", str(MAX_PROMPTS), "--max-n", str(MAX_N)]
    args += ["--require-auth", "--ledger-flush-interval", "0.1", *extra]
    server = start_server(args, tmp, env={"STOKER_FAKE_STEP_S": "0.002", **env})
    return Served(
        server,
        db_url,
        {name: secret for name, (_, secret) in made.items()},
        {name: key.id for name, (key, _) in made.items()},
    )


@pytest.fixture(scope="module", params=["sqlite", "redis+postgres"])
def served(request, tmp_path_factory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("cost")
    if request.param == "sqlite":
        db = str(tmp / "stoker.db")
        s = _serve(str(tmp), db, [], {"STOKER_DB": db})
        try:
            yield s
        finally:
            s.server.stop()
        return
    if redis_server_binary() is None:
        pytest.skip("no redis-server binary")
    redis = RedisServer(str(tmp))
    redis.start()
    pg = PostgresServer()
    try:
        pg.start()
        url = pg.create_database("cost" + uuid.uuid4().hex[:10])
        s = _serve(str(tmp), url, ["--redis-url", redis.url, "--db", url], {})
        try:
            yield s
        finally:
            s.server.stop()
    finally:
        pg.remove()
        redis.stop()


def complete(s: Served, key: str, prompts: int, max_tokens: int, n: int = 1) -> httpx.Response:
    return httpx.post(
        f"{s.server.url}/v1/completions",
        json={"prompt": [PROMPT] * prompts, "max_tokens": max_tokens, "n": n},
        headers=auth(s.secrets[key]),
        timeout=60,
    )


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]


def settled(s: Served, key: str, expected: int) -> int:
    """The key's usage in the ledger, once the server has written `expected` tokens (or 10 s passed)."""
    engine = make_engine(s.db_url)
    try:
        deadline = time.monotonic() + 10
        while True:
            total = UsageLedger(engine).summary(s.key_ids[key])["total_tokens"]
            if total >= expected or time.monotonic() > deadline:
                return total
            time.sleep(0.1)
    finally:
        engine.dispose()


def test_prompt_list_too_large_for_tpm_is_refused_where_one_prompt_passes(served: Served) -> None:
    # 4 prompts x (max_tokens 80) + their 40 prompt tokens: 360 > tpm 300. Once admitted
    # as one prompt's cost (40 + 80), it could spend past the key's tpm without bound.
    err = error_of(complete(served, "tpm", 4, 80), 429)
    assert err["code"] == "rate_limit_exceeded"
    assert "Limit 300, Requested 360" in err["message"] and "tokens per minute" in err["message"]
    refused = complete(served, "tpm", 4, 80)
    assert refused.status_code == 429 and "retry-after" not in refused.headers  # no wait would ever admit it
    # Nothing was taken: one prompt of the same size fits.
    one = complete(served, "tpm", 1, 190)  # 10 + 190 = 200
    assert one.status_code == 200, one.text
    assert one.json()["usage"]["total_tokens"] == 200
    # Now 100 (plus the refill) are left: two prompts (20 + 2 x 90 = 200) must wait, and the
    # Retry-After is when the bucket (5 tokens/s) holds all 200 of them.
    wait = complete(served, "tpm", 2, 90)
    err = error_of(wait, 429)
    remaining = int(wait.headers["x-ratelimit-remaining-tokens"])
    honest = math.ceil((200 - remaining) / 5)
    assert honest - 1 <= int(wait.headers["retry-after"]) <= honest, (wait.headers, remaining)


def test_budget_refuses_what_is_left_cannot_cover_and_never_overshoots(served: Served) -> None:
    assert complete(served, "budget", 1, 240).status_code == 200  # 250 of 1000
    assert settled(served, "budget", 250) == 250  # written: no longer a reservation in flight
    # 4 x 10 + 4 x 190 = 800 > the 750 left: refused before it starts, not admitted to overshoot.
    err = error_of(over := complete(served, "budget", 4, 190), 429)
    assert err["code"] == "insufficient_quota" and "800" in err["message"] and "1000" in err["message"]
    assert int(over.headers["retry-after"]) > 1  # no request in flight: only the next period helps
    # More than the whole budget: no period can ever admit it, so no Retry-After.
    whole = complete(served, "budget", 4, 246)  # 40 + 984 = 1024 > 1000
    assert error_of(whole, 429)["code"] == "insufficient_quota" and "retry-after" not in whole.headers
    assert "Limit 1000, Requested 1024" in whole.json()["error"]["message"]
    fits = complete(served, "budget", 3, 230)  # 30 + 690 = 720 <= 750
    assert fits.status_code == 200, fits.text
    assert settled(served, "budget", 970) == 970  # the ledger: 250 + 720, within the budget


async def test_requests_racing_for_a_budget_never_take_it_past_its_end(served: Served) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        responses = await asyncio.gather(
            *(
                http.post(
                    f"{served.server.url}/v1/completions",
                    json={"prompt": [PROMPT], "max_tokens": 240},  # 250 each, fully used by the fake core
                    headers=auth(served.secrets["race"]),
                )
                for _ in range(10)
            )
        )
    statuses = sorted(r.status_code for r in responses)
    # 900 // 250 = 3 fit; a fourth would have been admitted while used + reserved < 900.
    assert statuses == [200] * 3 + [429] * 7, statuses
    assert settled(served, "race", 750) == 750


def test_caps_are_400s_naming_their_maximum_and_take_nothing(served: Served) -> None:
    err = error_of(complete(served, "caps", MAX_PROMPTS + 1, 1), 400)
    assert err["param"] == "prompt" and str(MAX_PROMPTS) in err["message"]
    assert "--max-prompts-per-request" in err["message"]
    err = error_of(complete(served, "caps", 1, 1, n=MAX_N + 1), 400)
    assert err["param"] == "n" and f"at most {MAX_N}" in err["message"]
    err = error_of(complete(served, "caps", 1, CONTEXT), 400)  # 10 + 256 > the context
    assert err["code"] == "context_length_exceeded" and str(CONTEXT) in err["message"]
    # 4 prompts x n 2 x (10 + 200) = 1680 KV tokens: more than the engine's whole cache.
    err = error_of(complete(served, "caps", 4, 200, n=2), 400)
    assert err["param"] == "max_tokens" and str(KV_TOKENS) in err["message"] and "1680" in err["message"]
    # None of the four took one of the key's 2 requests a minute.
    assert [complete(served, "caps", 1, 2).status_code for _ in range(3)] == [200, 200, 429]


def test_a_chat_without_max_tokens_gets_each_sample_its_share_of_the_cache(fake_server: ServerProcess) -> None:
    """8 samples of what the context leaves (256 - prompt each) would exceed the 1024-token cache and be
    refused by the KV cap for a budget the client never asked for: left out, max_tokens is each sample's
    share of the cache instead, and the samples end with "length" there."""
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 8}
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    prompt = answer["usage"]["prompt_tokens"]
    share = (KV_TOKENS - 8 * prompt) // 8
    assert share < CONTEXT - prompt
    assert answer["usage"]["completion_tokens"] <= 8 * share
    assert {choice["finish_reason"] for choice in answer["choices"]} <= {"length", "stop"}


def test_a_prompt_list_holds_one_concurrency_slot_per_prompt(served: Served) -> None:
    # Three prompts are three requests to the engine: more than the key's 2 in flight, ever.
    refused = complete(served, "concurrent", 3, 2)
    err = error_of(refused, 429)
    assert err["code"] == "rate_limit_exceeded" and "Limit 2, Requested 3" in err["message"]
    assert "retry-after" not in refused.headers
    assert complete(served, "concurrent", 2, 2).status_code == 200


async def test_the_queue_the_limits_and_the_budget_see_one_estimate(tmp_path) -> None:
    engine = open_db(str(tmp_path / "g.db"))
    key, _ = KeyStore(engine).create("k", tpm=10_000, budget_tokens=2_000)
    gate = RequestGate(RateLimiter(), AdmissionController(max_queued_requests=10), UsageLedger(engine))
    adm = await gate.admit(request_id="r", key=key, model="m", prompt_tokens=40, max_tokens=50, n=2, prompts=4)
    assert adm.estimated_tokens == adm.lease.estimated_tokens == 40 + 4 * 2 * 50
    assert gate.queue().tokens == 2 * 40  # each of the n samples prefills its prompt
    # 440 taken; the bucket refills ~167 tokens a second, so a slow machine may show a few back
    remaining = int(gate.limiter.headers(key)["x-ratelimit-remaining-tokens"])
    assert 10_000 - 440 <= remaining < 10_000 - 440 + 300
    with pytest.raises(APIError) as err:  # 440 reserved + 1600 > 2000
        await gate.admit(request_id="r2", key=key, model="m", prompt_tokens=400, max_tokens=300, n=2, prompts=2)
    assert err.value.code == "insufficient_quota"
    after = int(gate.limiter.headers(key)["x-ratelimit-remaining-tokens"])
    assert remaining <= after < remaining + 300  # the refusal took none
