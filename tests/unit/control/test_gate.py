"""RequestGate.finish: metering of cut-off, dropped and failed requests; budgets with requests in flight."""

from __future__ import annotations

from typing import Any

import pytest

from stoker.control.admission import AdmissionController
from stoker.control.db import open_db
from stoker.control.gate import Admission, RequestGate
from stoker.control.keys import KeyStore
from stoker.control.ledger import UsageLedger
from stoker.control.limits import RateLimiter
from stoker.engine.params import RequestTimes
from stoker.errors import APIError
from stoker.observe.metrics import Metrics
from stoker.server.hooks import FinishedRecord


@pytest.fixture
def env(tmp_path):
    engine = open_db(str(tmp_path / "g.db"))
    keys, ledger = KeyStore(engine), UsageLedger(engine)
    gate = RequestGate(RateLimiter(), AdmissionController(max_queued_requests=10), ledger, Metrics("m"))
    return gate, keys, ledger


async def admit(gate, key, rid="r", prompt=10, max_tokens=20):
    return await gate.admit(request_id=rid, key=key, model="m", prompt_tokens=prompt, max_tokens=max_tokens)


def ended(adm: Admission, **fields: Any) -> FinishedRecord:
    """The server's record of adm's end: its prompt, and what the test sets."""
    return FinishedRecord(
        request_id=adm.request_id, endpoint="completion", model=adm.model, prompt_tokens=adm.prompt_tokens, **fields
    )


async def test_disconnect_is_metered_for_what_it_used(env):
    gate, keys, ledger = env
    key, _ = keys.create("k", tpm=1000)
    adm = await admit(gate, key)
    gate.finish(adm, ended(adm, status=499, completion_tokens=4, finish_reasons=["abort"]))
    gate.finish(adm, ended(adm, status=200, completion_tokens=99))  # second call ignored
    ledger.flush()
    assert ledger.summary(key.id)["total_tokens"] == 14
    assert gate.limiter.headers(key)["x-ratelimit-remaining-tokens"] == "986"
    assert gate.in_flight == 0 and gate.admission.queue().requests == 0


async def test_dropped_while_waiting_is_refunded(env):
    gate, keys, ledger = env
    key, _ = keys.create("k", rpm=10, tpm=1000)
    adm = await admit(gate, key, "r1")
    gate.finish(
        adm,
        ended(
            adm,
            status=504,
            times=[RequestTimes(arrival=adm.arrival, finished=adm.arrival + 1)],
            finish_reasons=["abort"],
            error="deadline",
        ),
    )
    adm = await admit(gate, key, "r2")
    gate.finish(adm, ended(adm, status=500, times=[RequestTimes(arrival=adm.arrival)], error="engine_error"))
    ledger.flush()
    assert ledger.summary(key.id) == {
        "requests": 2,
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 0,
    }
    headers = gate.limiter.headers(key)
    assert headers["x-ratelimit-remaining-requests"] == "10" and headers["x-ratelimit-remaining-tokens"] == "1000"


async def test_budget_counts_requests_in_flight(env):
    gate, keys, _ = env
    key, _ = keys.create("k", budget_tokens=50)
    first = await admit(gate, key, "r1", prompt=10, max_tokens=40)  # reserves 50
    with pytest.raises(APIError) as err:
        await admit(gate, key, "r2")
    assert err.value.code == "insufficient_quota" and err.value.headers["Retry-After"] == "1"
    gate.finish(first, ended(first, status=200, completion_tokens=5, times=[RequestTimes(1, 1, 1, 1, 1)]))  # used 15
    second = await admit(gate, key, "r3")
    gate.finish(second, ended(second, status=200, completion_tokens=20, times=[RequestTimes(1, 1, 1, 1, 1)]))  # 45 used
    with pytest.raises(APIError) as err:
        await admit(gate, key, "r4")  # its 30 would pass 50 whatever settles: only the next period helps
    assert int(err.value.headers["Retry-After"]) > 1


async def test_capacity_refusal_refunds_the_rate_limiter(env):
    gate, keys, _ = env
    gate.admission.max_queued_requests = 1
    key, _ = keys.create("k", rpm=3)
    await admit(gate, key, "r1")
    with pytest.raises(APIError) as err:
        await admit(gate, key, "r2")
    assert err.value.status == 503
    assert gate.limiter.headers(key)["x-ratelimit-remaining-requests"] == "2"
