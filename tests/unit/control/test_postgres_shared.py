"""Several replicas on one real PostgreSQL (started by the test, tests/postgres_server.py):
migrations safe when replicas start at once on a fresh database, budget
reservations shared so a key's spend never passes its budget however
many replicas serve it, keys made by `stoker keys --db`
seen by two real `stoker serve` replicas writing one ledger, the database
stopped mid-test (503 for budget checks, usage rows buffered and written when
it is back), and a bad --db refused at start in one line."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest
from conftest import FAKE_CORE, REPO, TESTS_DIR, start_server, store_failures
from postgres_server import PostgresServer
from sqlalchemy import func, select

from stoker.control.admission import AdmissionController
from stoker.control.budgets import BudgetExceeded, SharedBudgets
from stoker.control.db import SCHEMA_VERSION, budget_reservations, make_engine, metadata, migrate, open_db, schema_table
from stoker.control.gate import Admission, RequestGate
from stoker.control.keys import KeyStore
from stoker.control.ledger import UsageLedger
from stoker.control.limits import RateLimiter
from stoker.errors import APIError
from stoker.observe.logs import RequestRecord
from stoker.observe.metrics import Metrics
from stoker.server.hooks import FinishedRecord

pytestmark = pytest.mark.timeout(120)
CHAT = [{"role": "user", "content": "hi"}]


def ended(adm: Admission, completion_tokens: int) -> FinishedRecord:
    """The server's record of adm's end: its prompt and completion_tokens."""
    return FinishedRecord(
        request_id=adm.request_id,
        endpoint="completion",
        model=adm.model,
        status=200,
        prompt_tokens=adm.prompt_tokens,
        completion_tokens=completion_tokens,
    )


@pytest.fixture(scope="module")
def pg():
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.remove()


def fresh_db(pg: PostgresServer) -> str:
    return pg.create_database("t" + uuid.uuid4().hex[:12])


def cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO])}


# -- schema -------------------------------------------------------------------------


def test_replicas_migrating_a_fresh_database_at_once(pg) -> None:
    url = fresh_db(pg)
    engines = [make_engine(url) for _ in range(4)]
    results: list[object] = []
    barrier = threading.Barrier(len(engines))

    def start(engine) -> None:
        barrier.wait()
        try:
            results.append(migrate(engine))
        except Exception as exc:  # a crash here is the failure this test looks for
            results.append(exc)

    threads = [threading.Thread(target=start, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [SCHEMA_VERSION] * 4, results
    with engines[0].connect() as conn:
        assert conn.execute(select(func.count()).select_from(schema_table)).scalar_one() == 1
    for e in engines:
        e.dispose()


def test_version_1_database_gains_the_reservations_table(pg) -> None:
    url = fresh_db(pg)
    engine = make_engine(url)
    with engine.begin() as conn:
        metadata.create_all(conn, tables=[t for t in metadata.sorted_tables if t is not budget_reservations])
        conn.execute(schema_table.insert().values(version=1, applied_at=time.time()))
    assert migrate(engine) == SCHEMA_VERSION
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(budget_reservations)).scalar_one() == 0
        versions = conn.execute(select(schema_table.c.version).order_by(schema_table.c.version)).scalars().all()
    assert versions == list(range(1, SCHEMA_VERSION + 1))  # every later step, in order
    engine.dispose()


# -- reservations, two "replicas" in this process -------------------------------------


def test_concurrent_reservations_from_two_replicas_never_pass_the_budget(pg) -> None:
    url = fresh_db(pg)
    keys = KeyStore(open_db(url))
    key, _ = keys.create("b", budget_tokens=1000)
    replicas = [SharedBudgets(make_engine(url)) for _ in range(2)]
    estimate = 150
    admitted: list[str] = []
    refused: list[BudgetExceeded] = []
    barrier = threading.Barrier(16)

    def one(i: int) -> None:
        barrier.wait()
        try:
            admitted.append(replicas[i % 2].reserve(key.id, 1000, "month", estimate)[0])
        except BudgetExceeded as exc:
            refused.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # Admitted while used + reserved + estimate <= 1000: 1000 // 150 = 6, spending 900.
    assert len(admitted) == 1000 // estimate == 6 and len(refused) == 10
    assert all(r.used + r.reserved + estimate > 1000 for r in refused)


def test_ledger_row_settles_its_reservation_and_dead_replica_rows_lapse(pg) -> None:
    url = fresh_db(pg)
    engine = open_db(url)
    key, _ = KeyStore(engine).create("b", budget_tokens=500)
    live = SharedBudgets(engine, ttl=30)
    rid, used = live.reserve(key.id, 500, "day", 400)
    assert used == 0
    with pytest.raises(BudgetExceeded):
        live.reserve(key.id, 500, "day", 200)  # 400 + 200 > 500: it could settle past the budget
    last, _ = live.reserve(key.id, 500, "day", 100)  # 400 + 100 = 500: admitted, no overshoot possible
    with pytest.raises(BudgetExceeded):
        live.reserve(key.id, 500, "day", 1)
    live.release(last)
    ledger = UsageLedger(engine)
    ledger.record(
        RequestRecord(
            "r1", 200, "m", key.id, prompt_tokens=100, cached_tokens=0, completion_tokens=50, reservation_id=rid
        )
    )
    ledger.flush()
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(budget_reservations)).scalar_one() == 0
    # 150 used, nothing reserved: admitted again.
    rid2, used = live.reserve(key.id, 500, "day", 350)
    assert used == 150
    # A replica that dies holding reservations: after its TTL they no longer count.
    dead = SharedBudgets(engine, ttl=0.5)
    live.release(rid2)
    dead.reserve(key.id, 500, "day", 300)
    with pytest.raises(BudgetExceeded):
        live.reserve(key.id, 500, "day", 100)
    time.sleep(0.6)
    kept, _ = live.reserve(key.id, 500, "day", 10)
    # A live replica's renewal keeps its rows counting past the TTL they were made with.
    live.release(kept)
    renewing = SharedBudgets(engine, ttl=0.5)
    renewing.reserve(key.id, 500, "day", 300)
    for _ in range(3):
        time.sleep(0.25)
        renewing.renew()
    with pytest.raises(BudgetExceeded):
        live.reserve(key.id, 500, "day", 100)


async def test_gate_releases_a_reservation_refused_later_and_fails_closed_or_open(pg) -> None:
    url = fresh_db(pg)
    engine = open_db(url)
    key, _ = KeyStore(engine).create("b", budget_tokens=10_000, rpm=1)
    ledger = UsageLedger(engine)
    gate = RequestGate(RateLimiter(), AdmissionController(max_queued_requests=10), ledger, Metrics("m"))
    gate.budgets = SharedBudgets(engine)

    def reserved() -> int:
        with engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(budget_reservations)).scalar_one()

    first = await gate.admit(request_id="r1", key=key, model="m", prompt_tokens=10, max_tokens=20)
    assert first.reservation is not None and reserved() == 1
    with pytest.raises(APIError) as refused:  # rpm=1: refused after its budget reservation was made
        await gate.admit(request_id="r2", key=key, model="m", prompt_tokens=10, max_tokens=20)
    assert refused.value.status == 429 and refused.value.reason != "budget"
    assert reserved() == 1  # the refused request's reservation is gone
    gate.finish(first, ended(first, completion_tokens=20))
    ledger.flush()
    assert reserved() == 0 and ledger.summary(key.id)["total_tokens"] == 30

    # Nothing listens on port 1: the budget cannot be checked.
    unbudgeted, _ = KeyStore(engine).create("u", budget_tokens=10_000)
    metrics = Metrics("m")
    failed = metrics.store_failure_counter("db")
    gate.budgets = SharedBudgets(make_engine(pg.url().replace(f":{pg.port}/", ":1/")), count_failure=failed)
    with pytest.raises(APIError) as down:
        await gate.admit(request_id="r3", key=unbudgeted, model="m", prompt_tokens=1, max_tokens=1)
    assert down.value.status == 503 and down.value.code == "store_unavailable" and down.value.retry_after == 2
    gate.on_store_failure = "open"
    adm = await gate.admit(request_id="r4", key=unbudgeted, model="m", prompt_tokens=1, max_tokens=1)
    assert adm.reservation is None
    gate.finish(adm, ended(adm, completion_tokens=1))
    # Both counted, the 503 and the admission without a budget check alike.
    reserve = {"store": "db", "operation": "budget_reserve"}
    assert metrics.registry.get_sample_value("stoker:store_failures_total", reserve) == 2
    engine.dispose()


# -- two real replicas ------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(pg, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pg-replicas")
    url = fresh_db(pg)
    secrets = {}
    for name, extra in (("budget", ["--budget-tokens", "1000"]), ("plain", []), ("metrics", ["--scope", "metrics"])):
        out = subprocess.run(
            [sys.executable, "-m", "stoker.cli", "keys", "create", "--db", url, "--name", name, *extra],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env=cli_env(),
        )
        assert out.returncode == 0, out.stderr
        secrets[name] = next(w for w in out.stdout.split() if w.startswith("sk-"))
    args = ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256", "--db", url]
    # Keys cached for the whole module: the outage test needs the plain key known without the database.
    args += ["--require-auth", "--key-cache-ttl", "600", "--ledger-flush-interval", "0.2"]
    env = {"STOKER_FAKE_STEP_S": "0.02"}
    servers = []
    try:
        for _ in range(2):
            servers.append(start_server(args, str(tmp), env=env))
            servers[-1].key = secrets["metrics"]  # /metrics takes a metrics-scope key
        yield servers, url, secrets
    finally:
        for server in servers:
            server.stop()


async def test_budget_holds_across_two_replicas(replicas) -> None:
    servers, url, secrets = replicas
    async with httpx.AsyncClient(timeout=30) as http:
        responses = await asyncio.gather(
            *(
                http.post(
                    f"{servers[i % 2].url}/v1/chat/completions",
                    json={"messages": CHAT, "max_tokens": 60},
                    headers={"Authorization": f"Bearer {secrets['budget']}"},
                )
                for i in range(30)
            )
        )
    assert {r.status_code for r in responses} <= {200, 429}, [r.text for r in responses if r.status_code >= 500]
    used = [r.json()["usage"]["total_tokens"] for r in responses if r.status_code == 200]
    cost = used[0]  # each request costs its estimate, fully used (the fake core generates max_tokens)
    assert set(used) == {cost}
    # One budget for both replicas: admitted while used + reserved + estimate <= 1000, so the
    # spend never passes the budget. Two unshared replicas would each admit this many.
    assert len(used) == 1000 // cost, (len(used), cost)
    assert all(r.json()["error"]["code"] == "insufficient_quota" for r in responses if r.status_code == 429)
    # Both replicas wrote the ledger; no reservation is left once the rows are written.
    engine = make_engine(url)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        report = UsageLedger(engine).summary()
        with engine.connect() as conn:
            left = conn.execute(select(func.count()).select_from(budget_reservations)).scalar_one()
        if report["total_tokens"] == cost * len(used) and left == 0:
            break
        time.sleep(0.2)
    assert report["total_tokens"] == cost * len(used) <= 1000 and left == 0, (report, left)
    engine.dispose()


def chat(server, secret: str) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 2},
        headers={"Authorization": f"Bearer {secret}"},
        timeout=30,
    )


def test_database_stopped_budget_503_usage_buffered_then_written(pg, replicas) -> None:
    servers, url, secrets = replicas
    plain_id = secrets["plain"].split("-")[2]  # sk-stoker-<key id>-<secret>
    # The plain key is known to (cached by) one replica only.
    assert chat(servers[0], secrets["plain"]).status_code == 200
    engine = make_engine(url)
    deadline = time.monotonic() + 10
    while UsageLedger(engine).summary(plain_id)["requests"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    engine.dispose()
    # Both replicas know the budget key (200, or 429 once its budget is spent), so
    # during the outage it fails at the budget check, not at the key lookup.
    assert {chat(server, secrets["budget"]).status_code for server in servers} <= {200, 429}
    before = [store_failures(server, "db") for server in servers]
    pg.stop()
    try:
        for server in servers:
            r = chat(server, secrets["budget"])
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "store_unavailable" and r.headers["retry-after"] == "2"
        # A cached key without a budget needs no query at admission: served, its usage row waits.
        assert chat(servers[0], secrets["plain"]).status_code == 200
        assert chat(servers[0], secrets["plain"]).status_code == 200
        # A key this replica never saw cannot be checked: 503, not 500, and not served.
        r = chat(servers[1], secrets["plain"])
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", r.text
        # Keep the database away until the ledger has tried (and failed) to write those rows.
        deadline = time.monotonic() + 10
        while "ledger: writing" not in servers[0].log() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # several more retries (every 0.2 s), which must not log again
        during = [store_failures(server, "db") for server in servers]
    finally:
        pg.start()
    # The outage in numbers, per replica: each budget check that got its 503, the key
    # lookup that could not be made, and every failed ledger write (retried, so several).
    grown = [{op: during[i][op] - before[i][op] for op in before[i]} for i in range(2)]
    assert grown[0]["budget_reserve"] == 1 and grown[1]["budget_reserve"] == 1, grown
    assert grown[0]["key_lookup"] == 0 and grown[1]["key_lookup"] == 1, grown
    assert grown[0]["ledger_write"] >= 2, grown
    # The two plain requests' rows were buffered and land once the database is back.
    engine = make_engine(url)
    deadline = time.monotonic() + 15
    while UsageLedger(engine).summary(plain_id)["requests"] < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert UsageLedger(engine).summary(plain_id)["requests"] == 3
    engine.dispose()
    # Budget checks work again without a restart: an answer from the database (200, or
    # 429 once test_budget_holds_across_two_replicas has spent the budget), not a 503.
    assert {chat(server, secrets["budget"]).status_code for server in servers} <= {200, 429}
    for server in servers:
        assert "unreachable" in server.log() and "answers again" in server.log()
    # The outage is one ledger error line, however many retries it took, then one line when it ends.
    log = servers[0].log()
    assert log.count("ledger: writing") == 1 and "usage rows written again" in log


@pytest.mark.parametrize("command", [["serve", "--engine-core", FAKE_CORE, "--no-embedding-model"], ["keys", "list"]])
def test_unreachable_db_refuses_to_start_in_one_line(command) -> None:
    url = "postgresql+psycopg://stoker:hunter2@127.0.0.1:1/stoker"  # nothing listens on port 1
    proc = subprocess.run(
        [sys.executable, "-m", "stoker.cli", *command, "--db", url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=cli_env(),
    )
    err = proc.stderr.strip()
    assert proc.returncode == 2, proc.stderr
    assert (
        len(err.splitlines()) == 1 and f"stoker {command[0]}: --db postgresql+psycopg://stoker:***@127.0.0.1:1" in err
    )
    assert "cannot open the database" in err and "Traceback" not in err and "hunter2" not in err
