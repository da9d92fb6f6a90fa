"""The console's shell in a real Chromium against a real server: served with its
security headers and nothing else, fast to paint, usable by keyboard, in a
narrow window and in dark mode, and it says when the server cannot be reached
and recovers by itself when it is back."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from conftest import REPO
from playwright.sync_api import BrowserContext, ConsoleMessage, Page, expect

if TYPE_CHECKING:
    from browser import ConsoleServer, Screenshot

pytest_plugins = ["browser"]  # its fixtures: console_server, browser, page, screenshot

OPERATOR_PAGES = ("live", "models", "keys", "requests")

UNLABELLED = """els => els.filter(el => !(
    (el.labels && el.labels.length) || el.getAttribute('aria-label') || el.getAttribute('aria-labelledby')
    || (el.tagName === 'BUTTON' && el.textContent.trim())
  )).map(el => el.outerHTML)"""

PAINT_AND_WEIGHT = """() => {
  const paint = Object.fromEntries(performance.getEntriesByType('paint').map(e => [e.name, e.startTime]));
  const nav = performance.getEntriesByType('navigation')[0];
  const files = [nav, ...performance.getEntriesByType('resource')]
    .filter(e => e.name.includes('/ui/')).map(e => [e.name, e.decodedBodySize]);
  return {paint, files};
}"""
PAINT_ROUNDS = 4
CONSOLE_FILES = {path.name for path in (Path(REPO) / "stoker" / "server" / "console").iterdir()} | {"index.html"}


def test_page_and_assets_carry_a_strict_csp(console_server: ConsoleServer) -> None:
    for path in ("/", "/ui/", "/ui/app.js", "/ui/style.css"):
        answer = httpx.get(console_server.url + path, timeout=10)
        assert answer.status_code == 200, path
        csp = answer.headers["content-security-policy"]
        for directive in ("default-src 'self'", "script-src 'self'", "connect-src 'self'", "frame-ancestors 'none'"):
            assert directive in csp
        assert "img-src 'self' data:" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["referrer-policy"] == "no-referrer"
    assert httpx.get(console_server.url + "/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(console_server.url + "/ui", follow_redirects=False).headers["location"] == "/ui/"


def test_console_files_only(console_server: ConsoleServer) -> None:
    for path in (
        "/ui/../app.py",
        "/ui/%2e%2e%2fapp.py",
        "/ui/nothing.js",
        "/ui/.hidden.js",
        "/ui/app.py",
        "/ui/a/b.js",
    ):
        answer = httpx.get(console_server.url + path, timeout=10)
        assert answer.status_code == 404, path


def test_first_paint_and_page_weight(console_server: ConsoleServer, browser: BrowserContext) -> None:
    """Each page loaded in a fresh tab, the two alternating: docs/console.md's figures (run with -s)."""
    runs: dict[str, list[dict[str, Any]]] = {"ops/live": [], "chat": []}
    for round in range(PAINT_ROUNDS):
        for route in sorted(runs, reverse=round % 2 == 1):
            tab = browser.new_page()
            try:
                tab.goto(f"{console_server.url}/ui/#/{route}", wait_until="networkidle")
                runs[route].append(tab.evaluate(PAINT_AND_WEIGHT))
            finally:
                tab.close()
    figures = {}
    for route, measured in runs.items():
        paints = [m["paint"]["first-contentful-paint"] for m in measured]
        files = {name.split("#")[0].rsplit("/", 1)[-1] or "index.html": size for name, size in measured[-1]["files"]}
        figures[route] = {
            "first_contentful_paint_ms": {"first": paints[0], "median": statistics.median(paints), "max": max(paints)},
            "bytes": sum(size for name, size in files.items() if name in CONSOLE_FILES),
        }
        assert max(paints) < 1000, (route, paints)
    print("console figures:", json.dumps(figures))


def test_no_csp_violations_and_every_control_labelled(console_server: ConsoleServer, page: Page) -> None:
    messages: list[str] = []

    def seen(message: ConsoleMessage) -> None:
        messages.append(message.text)

    page.on("console", seen)
    page.goto(console_server.url + "/ui/#/ops/live")
    console_server.log_in(page)
    for name in OPERATOR_PAGES:
        page.goto(f"{console_server.url}/ui/#/ops/{name}")
        page.wait_for_load_state("networkidle")
        expect(page.locator("main h1")).to_be_visible()
        unlabelled = page.locator("input, select, textarea, button").evaluate_all(UNLABELLED)
        assert unlabelled == [], (name, unlabelled)
    assert not [m for m in messages if "Content Security Policy" in m], messages


def test_keyboard_only_creates_a_key(console_server: ConsoleServer, page: Page) -> None:
    page.goto(console_server.url + "/ui/#/ops/live")
    console_server.log_in(page)
    page.locator("body").focus()
    for _ in range(12):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.textContent") == "Keys":
            break
    page.keyboard.press("Enter")
    expect(page).to_have_url(f"{console_server.url}/ui/#/ops/keys")
    form = page.get_by_role("form", name="Create a key")
    expect(form).to_be_visible()
    for _ in range(20):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.name") == "name":
            break
    page.keyboard.type("typed-by-keyboard")
    page.keyboard.press("Enter")
    expect(page.locator("[data-secret]")).to_be_visible()
    expect(page.get_by_role("cell", name="typed-by-keyboard", exact=True)).to_be_visible()


def test_narrow_window_and_dark_mode(console_server: ConsoleServer, page: Page, screenshot: Screenshot) -> None:
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(console_server.url + "/ui/#/ops/keys")
    console_server.log_in(page)
    for name in OPERATOR_PAGES:
        page.goto(f"{console_server.url}/ui/#/ops/{name}")
        page.wait_for_load_state("networkidle")
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"), name
    screenshot(page, "narrow-requests")
    page.goto(console_server.url + "/ui/#/ops/keys")
    expect(page.get_by_role("table", name="API keys")).to_be_visible()
    screenshot(page, "narrow-keys")
    background = "getComputedStyle(document.body).backgroundColor"
    page.emulate_media(color_scheme="light")
    assert page.evaluate(background) == "rgb(255, 255, 255)"
    page.emulate_media(color_scheme="dark")
    assert page.evaluate(background) == "rgb(21, 23, 27)"
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(console_server.url + "/ui/#/ops/live")
    expect(page.locator('[data-chart="Requests"]').first).to_be_visible()
    screenshot(page, "live-dark", full_page=True)


def test_unreachable_server_banner_recovers(console_server: ConsoleServer, page: Page, screenshot: Screenshot) -> None:
    page.goto(console_server.url + "/ui/#/ops/live")
    console_server.log_in(page)
    expect(page.locator('[data-chart="Requests"]').first).to_be_visible()
    banner = page.locator("#banner")
    expect(banner).to_be_hidden()
    console_server.stop()
    try:
        expect(banner).to_be_visible(timeout=10_000)
        expect(banner).to_contain_text("cannot be reached")
        screenshot(page, "banner")
    finally:
        console_server.start_again()
    expect(banner).to_be_hidden(timeout=30_000)
    expect(page.locator("#key-status")).to_contain_text("back")
    expect(page.get_by_role("status").filter(has_text="refreshed every")).to_be_visible()
