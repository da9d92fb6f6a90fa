"""The operator console in a real headless Chromium against a real server: keys
created, edited and revoked through the page; live charts that move under load;
models and recent requests shown; a non-admin, wrong or revoked key gets a
clear message (and the server refuses it, checked with httpx too)."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

import httpx
import openai
from playwright.sync_api import Page, expect

if TYPE_CHECKING:
    from browser import ConsoleServer, Screenshot

pytest_plugins = ["browser"]  # its fixtures: console_server, browser, page, screenshot


def _chat(server: ConsoleServer, key: str, n: int) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    for i in range(n):
        client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": f"say {i}"}], max_tokens=8, temperature=0
        )


def _open(page: Page, server: ConsoleServer, route: str, key: str | None = None) -> None:
    page.goto(f"{server.url}/ui/#/ops/{route}")
    server.log_in(page, key)


def test_create_edit_and_revoke_a_key(console_server: ConsoleServer, page: Page, screenshot: Screenshot) -> None:
    _open(page, console_server, "keys")
    form = page.get_by_role("form", name="Create a key")
    form.get_by_label("Name").fill("made-in-browser")
    form.get_by_label("Requests per minute").fill("60")
    form.get_by_role("button", name="Create key").click()
    secret = page.locator("[data-secret]")
    expect(secret).to_have_text(re.compile(r"^sk-"))
    screenshot(page, "keys-created")
    made = secret.inner_text()
    row = page.locator("tr", has=page.get_by_role("cell", name="made-in-browser", exact=True))
    expect(row).to_contain_text("rpm 60")
    expect(row).to_contain_text("active")
    assert httpx.get(console_server.url + "/v1/models", headers={"Authorization": f"Bearer {made}"}).status_code == 200

    row.get_by_role("button", name="Edit made-in-browser").click()
    edit = page.get_by_role("form", name="Edit key made-in-browser")
    edit.get_by_label("Token budget").fill("4000")
    edit.get_by_label("Budget period").select_option("day")
    edit.get_by_role("button", name="Save").click()
    expect(row).to_contain_text("0 / 4000 tokens this day")
    key_id = row.get_attribute("data-key-id")
    shown = httpx.get(f"{console_server.url}/admin/keys/{key_id}", headers=console_server.admin_headers()).json()
    assert shown["budget_tokens"] == 4000 and shown["budget_period"] == "day" and shown["rpm"] == 60

    row.get_by_role("button", name="Revoke made-in-browser").click()
    row.get_by_role("button", name="Confirm: revoke made-in-browser").click()
    expect(row).to_contain_text("revoked")
    refused = httpx.get(console_server.url + "/v1/models", headers={"Authorization": f"Bearer {made}"})
    assert refused.status_code == 401


def test_live_charts_move_under_load(console_server: ConsoleServer, page: Page, screenshot: Screenshot) -> None:
    _open(page, console_server, "live")
    finished = page.locator('[data-model="tiny-llama"] [data-total="requests"]')
    expect(finished).to_be_visible()
    before = int(finished.inner_text())
    user = console_server.make_key("live-load")
    _chat(console_server, user["secret"], 2)
    expect(finished).not_to_have_text(str(before), timeout=15_000)
    deadline = time.monotonic() + 10
    while int(finished.inner_text()) < before + 2 and time.monotonic() < deadline:
        page.wait_for_timeout(500)
    assert int(finished.inner_text()) >= before + 2
    tokens = page.locator('[data-chart="Output tokens/s"]').first
    expect(tokens.get_by_role("img")).to_have_attribute("aria-label", re.compile("Output tokens/s, latest"))
    expect(page.locator('[data-chart="Time to first token"] li[data-series="p50"]').first).not_to_contain_text("–")
    screenshot(page, "live", full_page=True)


def test_models_and_recent_requests(console_server: ConsoleServer, page: Page, screenshot: Screenshot) -> None:
    user = console_server.make_key("table-user")
    _chat(console_server, user["secret"], 1)
    _open(page, console_server, "models")
    card = page.locator('[data-model="tiny-llama"]')
    expect(card).to_contain_text("serving")
    expect(card).to_contain_text("sha256:")
    screenshot(page, "models")
    page.get_by_role("link", name="Requests").click()
    table = page.get_by_role("table", name="Recent requests")
    expect(table.locator("tr", has_text="table-user").first).to_contain_text("/v1/chat/completions")
    expect(table.locator("tr", has_text="table-user").first).to_contain_text("200")
    screenshot(page, "requests")
    page.get_by_role("link", name="Keys").click()
    page.get_by_label("Key", exact=True).select_option(label="table-user")
    usage = page.locator('[data-chart="Tokens per hour (prompt + completion)"]')
    expect(usage.locator('li[data-series="table-user"]')).not_to_contain_text("–")
    expect(page.get_by_text("table-user: 1 request", exact=True)).to_be_visible()
    screenshot(page, "keys-usage", full_page=True)


def test_non_admin_wrong_and_revoked_keys_get_a_clear_message(console_server: ConsoleServer, page: Page) -> None:
    user = console_server.make_key("not-an-admin")
    for route in ("live", "keys", "models", "requests"):
        _open(page, console_server, route, user["secret"])
        expect(page.get_by_role("alert")).to_contain_text("need an admin key")
    _open(page, console_server, "keys", "sk-0123456789abcdef-not-a-real-secret-at-all")
    expect(page.get_by_role("alert")).to_contain_text("refused this API key")
    revoked = console_server.make_key("soon-revoked", admin=True)
    httpx.delete(f"{console_server.url}/admin/keys/{revoked['id']}", headers=console_server.admin_headers())
    _open(page, console_server, "live", revoked["secret"])
    expect(page.get_by_role("alert")).to_contain_text("revoked")
    # The server refuses the page's calls, not only the page: the same key over HTTP.
    for path in ("/console/live", "/admin/keys", "/admin/models"):
        assert (
            httpx.get(console_server.url + path, headers={"Authorization": f"Bearer {user['secret']}"}).status_code
            == 403
        )


def test_canary_loaded_resized_and_rolled_back(console_server: ConsoleServer, page: Page) -> None:
    listing = httpx.get(console_server.url + "/admin/models", headers=console_server.admin_headers()).json()
    path = listing["data"][0]["stable"]["path"]
    _open(page, console_server, "models")
    form = page.get_by_role("form", name="Load a model")
    form.get_by_label("Name").fill("tiny-llama")
    form.get_by_label("Path on the server").fill(path)
    form.get_by_label("Canary % (optional)").fill("50")
    form.get_by_role("button", name="Load").click()
    card = page.locator('[data-model="tiny-llama"]')
    expect(card).to_contain_text("canary at 50%", timeout=120_000)
    expect(card.locator("tr", has_text="canary")).to_contain_text("v2")
    share = page.get_by_role("form", name="Canary share of tiny-llama")
    share.get_by_label("Canary %").fill("20")
    share.get_by_role("button", name="Set share").click()
    expect(card).to_contain_text("canary at 20%")
    shown = httpx.get(console_server.url + "/admin/models", headers=console_server.admin_headers()).json()
    assert shown["data"][0]["canary_percent"] == 20
    card.get_by_role("button", name="Roll back canary").click()
    expect(page.get_by_role("status").filter(has_text="Rolling back")).to_contain_text("done")
    expect(card).not_to_contain_text("canary at")
    after = httpx.get(console_server.url + "/admin/models", headers=console_server.admin_headers()).json()
    assert after["data"][0]["canary"] is None and after["data"][0]["stable"]["version"] == "v1"
