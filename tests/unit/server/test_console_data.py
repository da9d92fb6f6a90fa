"""The console's read-only endpoints (/console/*) and PATCH /admin/keys/{id}, over
HTTP against a real server with the official openai client: admin scope only,
bounded inputs with 400s, figures that match what the requests did."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
from conftest import FAKE_CORE
from fastapi.testclient import TestClient
from postgres_server import PostgresServer

from stoker.control.db import open_db
from stoker.control.keys import KeyStore
from stoker.control.ledger import UsageLedger
from stoker.engine.params import EngineStats, RequestTimes
from stoker.observe.logs import RequestRecord
from stoker.observe.metrics import Metrics
from stoker.server import cli as serve_cli
from stoker.server.app import create_app
from stoker.server.console_data import RecentRequests, usage_report
from stoker.server.console_live import LiveSampler, ModelReading, Reading, bucket_growth, bucket_quantile, describe

if TYPE_CHECKING:
    from browser import ConsoleServer

pytest_plugins = ["browser"]  # its fixtures: console_server, browser, page, screenshot

CONSOLE_PATHS = ("/console/live", "/console/requests", "/console/usage")


def _chat(
    server: ConsoleServer, key: str, content: str = "hello", max_tokens: int = 8
) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    return client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0
    )


def test_bucket_quantile_interpolates_as_prometheus_does() -> None:
    buckets = ((1.0, 10.0), (2.0, 20.0), (float("inf"), 20.0))
    assert bucket_quantile(0.5, buckets) == pytest.approx(1.0)
    assert bucket_quantile(0.99, buckets) == pytest.approx(1.98)
    assert bucket_quantile(0.5, ((1.0, 0.0), (float("inf"), 0.0))) is None
    assert bucket_quantile(0.99, ((1.0, 1.0), (float("inf"), 5.0))) == 1.0  # in +Inf: the last finite bound
    grown = bucket_growth(((1.0, 12.0), (float("inf"), 15.0)), ((1.0, 10.0), (float("inf"), 10.0)))
    assert grown == ((1.0, 2.0), (float("inf"), 5.0))


def test_sampler_turns_the_registry_into_rates_and_quantiles() -> None:
    metrics = Metrics()
    sampler = LiveSampler(metrics)
    stats = EngineStats(num_running=2, num_waiting=1, kv_blocks_total=10, kv_blocks_used=5, block_size=16)
    metrics.update_from_engine_stats(stats, model_name="a")
    first = sampler.sample(at=100.0)
    assert first.models["a"]["running"] == 2 and first.models["a"]["output_tokens_per_s"] is None
    metrics.update_from_engine_stats(
        EngineStats(num_running=1, kv_blocks_total=10, kv_blocks_used=2, block_size=16, generation_tokens=30, steps=3),
        model_name="a",
    )
    times = RequestTimes(arrival=0.0, scheduled=0.01, first_token=0.2, finished=0.5, token_times=[0.2, 0.3, 0.4])
    metrics.observe_sample(times, "stop", "a")
    metrics.admission_rejections.labels("queue_full").inc(4)
    metrics.rate_limit_rejections.labels("rpm").inc(2)
    second = sampler.sample(at=102.0)
    figures = second.models["a"]
    assert figures["output_tokens_per_s"] == 15 and figures["requests_per_s"] == 0.5
    assert figures["running"] == 1 and figures["waiting"] == 0 and figures["kv_usage"] == 0.2
    assert 0.15 < figures["ttft_p50"] <= 0.25  # the one TTFT, 0.2 s, lies in the (0.15, 0.25] bucket
    assert 0.075 < figures["itl_p50"] <= 0.1  # two gaps of 0.1 s
    assert second.refusals_per_s == {"queue_full": 2.0, "rate_limit:rpm": 1.0}
    assert [s.t for s in sampler.since(100.0)] == [102.0]


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def usage_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh database of each kind: the time buckets are SQL whose floor() differs between them."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('usage')}/usage.db"
        return
    server = PostgresServer()
    try:
        server.start()
        yield server.create_database("console_usage")
    finally:
        server.remove()


def test_usage_buckets_per_key_on_each_database(usage_db: str) -> None:
    engine = open_db(usage_db)
    try:
        keys = KeyStore(engine)
        spender, _ = keys.create("spender", budget_tokens=10_000, budget_period="day")
        idle, _ = keys.create("idle")
        ledger = UsageLedger(engine)
        now = 1_800_000_000.0 + 1800  # 08:30 UTC: fixed, so no row falls on the other side of an hour by chance
        # (seconds before now, completion tokens): two in this hour, one an hour back, one out of the window.
        for number, (ago, completion) in enumerate([(60, 1), (1700, 2), (3700, 4), (30 * 3600, 8)]):
            record = RequestRecord(
                request_id=f"r{number}",
                status=200,
                model="m",
                key_id=spender.id,
                prompt_tokens=10,
                completion_tokens=completion,
                created_at=now - ago,
            )
            ledger.record(record)
        report = usage_report(ledger, keys.list_keys(), "hour", 24, None, now)
        (entry,) = report["keys"]  # a key without rows in the window is not charted
        this_hour = int(now // 3600) * 3600
        assert entry["key_id"] == spender.id and entry["key_name"] == "spender"
        assert entry["series"] == [
            {"t": this_hour - 3600, "requests": 1, "prompt_tokens": 10, "completion_tokens": 4},
            {"t": this_hour, "requests": 2, "prompt_tokens": 20, "completion_tokens": 3},
        ]
        assert report["start"] == this_hour - 23 * 3600
        day_start = int(now // 86400) * 86400
        used_today = sum(10 + c for ago, c in [(60, 1), (1700, 2), (3700, 4), (30 * 3600, 8)] if now - ago >= day_start)
        assert report["budgets"] == [
            {"key_id": spender.id, "budget_tokens": 10_000, "budget_period": "day", "used_this_period": used_today}
        ]
        assert usage_report(ledger, keys.list_keys(), "day", 2, idle.id, now)["keys"] == []
    finally:
        engine.dispose()


def test_recent_requests_keep_the_newest() -> None:
    recent = RecentRequests(size=3)
    for i in range(5):
        recent({"request_id": f"r{i}", "status": 200, "prompt": "never kept"})
    assert [line["request_id"] for line in recent.newest(10)] == ["r4", "r3", "r2"]
    assert "prompt" not in recent.newest(1)[0]


def test_console_endpoints_need_an_admin_key(console_server: ConsoleServer) -> None:
    user = console_server.make_key("console-user")
    revoked = console_server.make_key("console-revoked")
    httpx.delete(f"{console_server.url}/admin/keys/{revoked['id']}", headers=console_server.admin_headers())
    for path in CONSOLE_PATHS:
        url = console_server.url + path
        assert httpx.get(url, timeout=10).status_code == 401
        refused = httpx.get(url, headers={"Authorization": f"Bearer {user['secret']}"}, timeout=10)
        assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
        gone = httpx.get(url, headers={"Authorization": f"Bearer {revoked['secret']}"}, timeout=10)
        assert gone.status_code == 401 and gone.json()["error"]["code"] == "api_key_revoked"
        assert httpx.get(url, headers=console_server.admin_headers(), timeout=10).status_code == 200
    # The operator APIs the console calls refuse the same key.
    for path in ("/admin/keys", "/admin/models"):
        answer = httpx.get(console_server.url + path, headers={"Authorization": f"Bearer {user['secret']}"})
        assert answer.status_code == 403


@pytest.mark.parametrize(
    "query",
    [
        "/console/live?since=-1",
        "/console/live?since=nan",
        "/console/live?since=abc",
        "/console/requests?limit=0",
        "/console/requests?limit=501",
        "/console/usage?bucket=week",
        "/console/usage?buckets=0",
        "/console/usage?bucket=hour&buckets=169",
        "/console/usage?bucket=day&buckets=91",
        "/console/usage?key_id=" + "a" * 65,
    ],
)
def test_bad_queries_are_400s(console_server: ConsoleServer, query: str) -> None:
    answer = httpx.get(console_server.url + query, headers=console_server.admin_headers(), timeout=10)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["message"]


def test_requests_live_figures_and_usage_follow_real_requests(console_server: ConsoleServer) -> None:
    admin = console_server.admin_headers()
    before = httpx.get(console_server.url + "/console/live", headers=admin).json()["now"]
    user = console_server.make_key("console-traffic")
    replies = [_chat(console_server, user["secret"], f"count to {i}") for i in range(2)]
    completion_tokens = sum(r.usage.completion_tokens for r in replies if r.usage)
    all_tokens = sum(r.usage.total_tokens for r in replies if r.usage)

    recent = httpx.get(console_server.url + "/console/requests?limit=10", headers=admin).json()
    mine = [r for r in recent["data"] if r["key_id"] == user["id"]]
    assert len(mine) == 2 and recent["size"] == 500
    for row in mine:
        assert row["status"] == 200 and row["model"] == "tiny-llama" and row["key_name"] == "console-traffic"
        assert row["finish_reason"] in ("stop", "length") and row["latency"] > 0
        assert row["path"] == "/v1/chat/completions"
    assert recent["data"][0]["ts"] >= recent["data"][-1]["ts"]  # newest first

    # The console's own polls are not requests the table shows (refused ones are: someone tried).
    assert not any(str(r["path"]).startswith("/console/") and r["status"] == 200 for r in recent["data"])

    deadline = time.monotonic() + 10
    generated = 0.0
    while time.monotonic() < deadline and generated < completion_tokens:
        time.sleep(1)
        live = httpx.get(f"{console_server.url}/console/live?since={before}", headers=admin).json()
        figures = [s["models"]["tiny-llama"] for s in live["samples"] if "tiny-llama" in s["models"]]
        generated = sum((f["output_tokens_per_s"] or 0) * live["interval"] for f in figures)
    assert generated == pytest.approx(completion_tokens, rel=0.35)  # rates times the ~1 s between samples
    latest = figures[-1]
    assert latest["ttft_p50"] is not None and 0 < latest["ttft_p50"] <= latest["ttft_p99"]
    assert latest["itl_p50"] is not None and latest["kv_usage"] >= 0
    assert all(s["t"] > before for s in live["samples"])

    report = httpx.get(f"{console_server.url}/console/usage?key_id={user['id']}", headers=admin).json()
    (entry,) = report["keys"]
    assert entry["key_name"] == "console-traffic"
    assert sum(p["prompt_tokens"] + p["completion_tokens"] for p in entry["series"]) == all_tokens
    assert sum(p["requests"] for p in entry["series"]) == 2
    assert entry["used_this_period"] == all_tokens
    assert report["bucket"] == "hour" and report["start"] % 3600 == 0


def test_edit_key_limits_and_budget(console_server: ConsoleServer) -> None:
    admin = console_server.admin_headers()
    key = console_server.make_key("console-edit", rpm=100)
    url = f"{console_server.url}/admin/keys/{key['id']}"
    edited = httpx.patch(url, json={"rpm": 1, "budget_tokens": 5000, "budget_period": "day"}, headers=admin)
    assert edited.status_code == 200, edited.text
    assert (
        edited.json()["rpm"] == 1 and edited.json()["budget_tokens"] == 5000 and edited.json()["name"] == "console-edit"
    )
    used = _chat(console_server, key["secret"]).usage
    with pytest.raises(openai.RateLimitError):  # the new rpm holds at once
        _chat(console_server, key["secret"])
    budgets = httpx.get(f"{console_server.url}/console/usage?key_id=0000", headers=admin).json()["budgets"]
    (budget,) = [b for b in budgets if b["key_id"] == key["id"]]  # every budget, whatever the chart shows
    assert used is not None and budget["used_this_period"] == used.total_tokens and budget["budget_tokens"] == 5000
    cleared = httpx.patch(url, json={"rpm": None, "models": ["tiny-llama"]}, headers=admin).json()
    assert cleared["rpm"] is None and cleared["models"] == ["tiny-llama"] and cleared["budget_tokens"] == 5000
    for body in (
        {"rpm": 0},
        {"rpm": 2**60},
        {"scopes": ["admin"]},
        {"admin": True},
        {"name": ""},
        {"name": None},
        {"priority": "urgent"},
        {"models": []},
        {"expires_at": 1.0},
        {"budget_tokens": "lots"},
    ):
        answer = httpx.patch(url, json=body, headers=admin)
        assert answer.status_code == 400, (body, answer.text)
    assert httpx.patch(f"{console_server.url}/admin/keys/0000", json={"rpm": 3}, headers=admin).status_code == 404
    user = console_server.make_key("console-not-admin")
    refused = httpx.patch(url, json={"rpm": 3}, headers={"Authorization": f"Bearer {user['secret']}"})
    assert refused.status_code == 403


def test_openapi_documents_the_console_endpoints(console_server: ConsoleServer) -> None:
    schema = httpx.get(console_server.url + "/openapi.json", headers=console_server.admin_headers()).json()
    for path in CONSOLE_PATHS:
        operation = schema["paths"][path]["get"]
        assert operation["tags"] == ["console"] and "403" in operation["responses"]
    assert "patch" in schema["paths"]["/admin/keys/{key_id}"]
    assert "/ui/" not in schema["paths"]  # the static files are not API


def _app_from_command_line(tmp_path: Path, *flags: str) -> TestClient:
    """The app `stoker serve MODEL FLAGS` builds, its engine never started (routes only)."""
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    model = tmp_path / "model.gguf"
    model.touch()
    args = parser.parse_args(["serve", str(model), "--engine-core", FAKE_CORE, "--no-embedding-model", *flags])
    engine_config, server_config = serve_cli.resolve_configs(args)
    app = create_app(server_config, engine_config, extras={"control_config": {"db": f"sqlite:///{tmp_path}/k.db"}})
    return TestClient(app)


def test_no_ui_leaves_the_console_out(tmp_path: Path) -> None:
    off = _app_from_command_line(tmp_path, "--no-ui")
    for path in ("/", "/ui/", "/ui/app.js", "/console/live", "/console/requests", "/console/usage"):
        assert off.get(path).status_code == 404, path
    assert off.get("/health").status_code == 200
    on = _app_from_command_line(tmp_path)
    assert on.get("/").status_code == 200
    # Open mode (no key was ever created): the console's figures stay shut, as every operator endpoint.
    refused = on.get("/console/live")
    assert refused.status_code == 403 and "admin key" in refused.json()["error"]["message"]


def test_a_model_s_first_burst_counts_from_zero() -> None:
    """Requests that begin and end between two samples, on a model the previous
    reading did not have yet (its series appear with their first values): the rate
    counts them from zero instead of showing nothing."""
    previous = Reading(at=10.0, models={}, refusals={})
    now = Reading(at=11.0, models={"m": ModelReading(generation_tokens=16.0, finished=2.0)}, refusals={})
    figures = describe(now, previous, None).models["m"]
    assert figures["output_tokens_per_s"] == 16.0 and figures["requests_per_s"] == 2.0
    assert describe(now, None, None).models["m"]["output_tokens_per_s"] is None  # no earlier reading at all
