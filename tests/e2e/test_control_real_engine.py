"""Control behaviours that need the real engine (default model): its own
priority queue and deadline drops, and metrics fed by its timestamps. One
server for the module, --max-num-seqs 1 so requests really wait; small
max_tokens keep it to seconds of compute."""

from __future__ import annotations

import asyncio
import json
import re
import signal

import httpx
import pytest
from conftest import auth, engine_stats, start_server, wait_for
from sqlalchemy import select

from stoker.control.db import open_db, usage
from stoker.control.keys import KeyStore

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
PROMPT = "Count from one to one hundred:"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("control-real")
    db = str(tmp / "stoker.db")
    store = KeyStore(open_db(db))
    secrets = {"interactive": store.create("fg")[1], "batch": store.create("bg", priority="batch")[1]}
    ops = store.create("ops", scopes=["metrics"])[1]  # /ready's details and /metrics need a key here
    server = start_server(
        [
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "1",
            "--no-embedding-model",
            "--db",
            db,
            "--ledger-flush-interval",
            "0.2",
        ],
        str(tmp),
        ready_timeout=600,
    )
    server.key = ops
    try:
        yield server, secrets, db
    finally:
        server.stop()


def body(max_tokens: int) -> dict:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def sample(metrics: str, name: str) -> float:
    """Sum of a metric's samples (all label sets)."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.MULTILINE))


async def test_priority_and_deadline_in_the_real_engine(served) -> None:
    server, secrets, _ = served
    finished: list[str] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:

        async def call(name: str, key: str, max_tokens: int, **headers: str) -> httpx.Response:
            r = await http.post(
                "/v1/completions",
                json=body(max_tokens),
                headers=auth(secrets[key], **{"x-request-id": name, **headers}),
            )
            finished.append(name)
            return r

        # Long enough to outlast the deadline below even at speculative speed (counting is easy to guess).
        blocker = asyncio.create_task(call("blocker", "interactive", 256))
        await wait_for(lambda: engine_stats(server)["num_running"] == 1, 30, "blocker running")
        tasks = [asyncio.create_task(call(f"batch-{i}", "batch", 3)) for i in range(2)]
        await asyncio.sleep(0.1)
        tasks += [asyncio.create_task(call(f"interactive-{i}", "interactive", 3)) for i in range(2)]
        await wait_for(lambda: engine_stats(server)["num_waiting"] == 4, 10, "four requests waiting behind the blocker")
        # Waits behind the blocker and is dropped before it computes anything.
        dropped = await call("too-late", "interactive", 3, **{"x-stoker-deadline-ms": "200"})
        results = await asyncio.gather(blocker, *tasks)
    assert dropped.status_code == 504 and dropped.json()["error"]["type"] == "timeout", dropped.text
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    order = [n for n in finished if n != "too-late"]
    assert order[0] == "blocker" and set(order[1:3]) == {"interactive-0", "interactive-1"}, finished


async def test_metrics_move_with_the_real_engine(served) -> None:
    server, secrets, _ = served
    names = [
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:request_success_total",
        "vllm:iteration_tokens_total_count",
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        before = (await http.get("/metrics", headers=server.headers())).text
        for _ in range(2):
            r = await http.post("/v1/completions", json=body(6), headers=auth(secrets["interactive"]))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        await asyncio.sleep(0.6)  # engine counters arrive with its next stats push
        after = (await http.get("/metrics", headers=server.headers())).text
    delta = {n: sample(after, n) - sample(before, n) for n in names}
    assert delta["vllm:time_to_first_token_seconds_count"] == 2, delta
    assert delta["vllm:inter_token_latency_seconds_count"] == 2 * 5, delta
    assert delta["vllm:e2e_request_latency_seconds_count"] == 2 and delta["vllm:request_queue_time_seconds_count"] == 2
    assert delta["vllm:generation_tokens_total"] >= 12 and delta["vllm:prompt_tokens_total"] > 0, delta
    assert delta["vllm:request_success_total"] == 2 and delta["vllm:iteration_tokens_total_count"] > 0, delta
    ttft_sum = sample(after, "vllm:time_to_first_token_seconds_sum") - sample(
        before, "vllm:time_to_first_token_seconds_sum"
    )
    assert ttft_sum > 0
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert re.search(rf"^{gauge}{{", after, re.MULTILINE), gauge


async def test_speculation_counters_and_log_line(served) -> None:
    """A copy request speculates (auto, one stream): vLLM's spec_decode counters
    move, and the request's log line carries its acceptance."""
    server, secrets, _ = served
    passage = "The captain repaired the copper lantern near the harbour. " * 6
    request = {"prompt": passage + "\nRepeat the sentence above:\n", "max_tokens": 40, "temperature": 0}
    names = ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total"]
    names += ["vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        before = (await http.get("/metrics", headers=server.headers())).text
        r = await http.post(
            "/v1/completions", json=request, headers={**auth(secrets["interactive"]), "X-Request-Id": "spec-1"}
        )
        assert r.status_code == 200, r.text
        await asyncio.sleep(0.6)
        after = (await http.get("/metrics", headers=server.headers())).text
    delta = {n: sample(after, n) - sample(before, n) for n in names}
    assert delta["vllm:spec_decode_num_drafts_total"] > 0, delta
    assert 0 < delta["vllm:spec_decode_num_accepted_tokens_total"] <= delta["vllm:spec_decode_num_draft_tokens_total"]
    assert (
        delta["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
        == delta["vllm:spec_decode_num_accepted_tokens_total"]
    )
    log = server.log()
    # The engine process logs its start-up choices into the server's log.
    for said in ("quantized matmul:", "attention backend:", "speculative decoding: step ms by rows"):
        assert said in log, said
    line = next(line for line in log.splitlines() if '"client_request_id":"spec-1"' in line)
    assert '"spec_draft_tokens":' in line and '"spec_acceptance":' in line, line


def test_usage_rows_after_sigterm(served) -> None:
    """Runs last in the module: SIGTERM while a request is in flight; it
    finishes (drain), and every admitted request has its row once the process exits."""
    server, secrets, db = served
    headers = auth(secrets["batch"], **{"x-request-id": "in-flight-at-sigterm"})
    with (
        httpx.Client(base_url=server.url, timeout=120) as http,
        http.stream("POST", "/v1/completions", json={**body(24), "stream": True}, headers=headers) as response,
    ):
        lines = response.iter_lines()
        next(lines)
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert server.proc.wait(60) == 0
    with open_db(db).connect() as conn:
        by_id = {r.request_id: r for r in conn.execute(select(usage)).fetchall()}
    # Rows are under the server's request ids; the log line pairs each with the X-Request-Id sent.
    lines = [json.loads(x) for x in server.log().splitlines() if x.startswith('{"ts"')]
    rows = {
        x["client_request_id"]: by_id[x["request_id"]]
        for x in lines
        if x.get("client_request_id") and x["request_id"] in by_id
    }
    assert rows["in-flight-at-sigterm"].completion_tokens == 24 and rows["in-flight-at-sigterm"].status == 200
    assert rows["too-late"].status == 504 and rows["too-late"].prompt_tokens == 0
    assert {"blocker", "batch-0", "interactive-1"} <= set(rows)
