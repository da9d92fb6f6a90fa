"""The web console's browser harness: a real stoker server and Debian's Chromium
driven by Playwright (no browser download; /usr/bin/chromium, headless).

A test module takes what it needs:

    if TYPE_CHECKING:
        from browser import ConsoleServer, Screenshot

    pytest_plugins = ["browser"]  # its fixtures: console_server, browser, page, screenshot

    def test_x(console_server: ConsoleServer, page: Page, screenshot: Screenshot) -> None:
        page.goto(console_server.url + "/ui/#/chat")
        console_server.log_in(page)            # the admin key, as a user would type it
        screenshot(page, "chat")               # under STOKER_CONSOLE_SCREENSHOTS or the session's tmp folder

(Imported only for types: pytest loads this module as a plugin, and one
imported before that could not have its asserts rewritten.)

console_server: one server for the whole session (every console test module
shares it: one start) on a tiny random-weight llama (the real engine, fast),
with keys on: `.key` is an admin key made before the start, `.make_key(...)`
creates more through the admin API; a test that stops it starts it again.
browser: one headless Chromium per session with a fresh user-data-dir; page: a
new tab per test (its own sessionStorage), closed after it.

Screenshots go to $STOKER_CONSOLE_SCREENSHOTS when set (docs/console/ to refresh
the ones docs/console.md shows), else to a temporary folder, so a test run never
changes tracked files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import REPO, TESTS_DIR, ServerProcess, start_server
from tiny_models import make_tiny_hf_model

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOTS_ENV = "STOKER_CONSOLE_SCREENSHOTS"
_default_shots = Path(tempfile.gettempdir()) / f"stoker-console-shots-{os.getpid()}"


def screenshot_folder() -> Path:
    folder = Path(os.environ.get(SCREENSHOTS_ENV) or _default_shots)
    if not folder.is_absolute():
        folder = Path(REPO) / folder
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_screenshot(page: Any, name: str, full_page: bool = False) -> Path:
    """Save the page as <folder>/<name>.png and return the path."""
    path = screenshot_folder() / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page, animations="disabled")
    return path


Screenshot = Callable[..., Path]


@pytest.fixture
def screenshot() -> Screenshot:
    """save_screenshot(page, name, full_page=False)."""
    return save_screenshot


@dataclass
class ConsoleServer:
    """A running `stoker serve` with keys on, and the admin key made before it started."""

    process: ServerProcess
    key: str
    db_path: str
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.process.url

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def make_key(self, name: str, **fields: Any) -> dict[str, Any]:
        """Create a key through POST /admin/keys; the answer holds its secret."""
        answer = httpx.post(
            f"{self.url}/admin/keys", json={"name": name, **fields}, headers=self.admin_headers(), timeout=10
        )
        answer.raise_for_status()
        created: dict[str, Any] = answer.json()
        return created

    def log_in(self, page: Any, key: str | None = None, remember: bool = False) -> None:
        """Type a key into the console's key form, as a person would (the admin key by default)."""
        page.get_by_label("API key").fill(self.key if key is None else key)
        if remember:
            page.get_by_label("Remember on this device").check()
        page.get_by_role("button", name="Use key").click()

    def stop(self) -> None:
        self.process.stop()

    def start_again(self, ready_timeout: float = 300) -> None:
        """Start the stopped server again on the same port and database (a restart, as a page sees it)."""
        old = self.process
        env = {
            **os.environ,
            "STOKER_DB": self.db_path,
            "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO]),
        }
        with open(old.log_path, "ab") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "stoker.cli",
                    "serve",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(old.port),
                    *self.args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            )
        self.process = ServerProcess(proc, old.port, old.log_path)
        self.process.wait_ready(ready_timeout)


def create_admin_key(db_path: str, name: str = "console-admin") -> str:
    """An admin key in the database at db_path, made before the server starts (so keys are on),
    as `stoker keys create --admin` makes it."""
    from stoker.control.db import open_db
    from stoker.control.keys import KeyStore

    engine = open_db(db_path)
    try:
        _, secret = KeyStore(engine).create(name, admin=True)
    finally:
        engine.dispose()
    return secret


def start_console_server(tmp: Path, extra_args: list[str] | None = None) -> ConsoleServer:
    model = make_tiny_hf_model("llama", tmp / "models")
    db_path = str(tmp / "keys.db")
    key = create_admin_key(db_path)
    args = [
        str(model),
        "--served-model-name",
        "tiny-llama",
        "--no-embedding-model",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        *(extra_args or []),
    ]
    process = start_server(args, str(tmp), env={"STOKER_DB": db_path}, ready_timeout=300)
    return ConsoleServer(process, key, db_path, args)


@pytest.fixture(scope="session")
def console_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsoleServer]:
    server = start_console_server(tmp_path_factory.mktemp("console"))
    try:
        yield server
    finally:
        server.process.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A headless Chromium with a fresh profile: a Playwright BrowserContext. Per module, never per
    session: Playwright's sync API keeps an event loop running in the main thread while it is open,
    and every later test that calls asyncio.run() would fail ("cannot be called from a running
    event loop")."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 800},
        )
        context.set_default_timeout(15_000)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A new tab; the console's errors in the browser's console fail no test but are printed."""
    tab = browser.new_page()
    tab.on("pageerror", lambda error: print(f"page error: {error}"))
    try:
        yield tab
    finally:
        tab.close()
