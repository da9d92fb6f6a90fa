"""The console's chat playground in a real headless Chromium against a real
server with two models (a tiny random-weight Qwen3, and the same with a thinking
template, deepseek_r1 style): streamed replies with their figures, the token view,
reasoning apart, structured output and tool calls, stop, regenerate / edit / branch, conversations exported and
imported, a refused key, and model output that must never run as script."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from conftest import start_server
from playwright.sync_api import Page, Route, expect
from tiny_models import make_thinking_model

if TYPE_CHECKING:
    from browser import ConsoleServer, Screenshot

pytest_plugins = ["browser"]  # its fixtures: browser, page, screenshot (console_server is replaced below)

CHAT_MODEL = "tiny-qwen3"
THINKING_MODEL = "tiny-r1"
REPLY_TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def console_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsoleServer]:
    """As browser.py's, with a second model to switch to: one that thinks (deepseek_r1 parser)."""
    from browser import ConsoleServer, create_admin_key  # after pytest_plugins loaded it

    tmp = tmp_path_factory.mktemp("playground")
    thinking = make_thinking_model("deepseek_r1", tmp / "models")
    plain = next((tmp / "models" / "base").glob("tiny-qwen3-*"))  # the thinking model's base, without the markers
    db_path = str(tmp / "keys.db")
    key = create_admin_key(db_path)
    args = [
        *("--model", f"{CHAT_MODEL}={plain}", "--model", f"{THINKING_MODEL}={thinking}"),
        *("--no-embedding-model", "--max-model-len", "512", "--max-num-seqs", "8"),
    ]
    process = start_server(args, str(tmp), env={"STOKER_DB": db_path}, ready_timeout=300)
    server = ConsoleServer(process, key, db_path, args)
    try:
        yield server
    finally:
        process.stop()


def log_in(server: ConsoleServer, page: Page, key: str | None = None) -> None:
    page.goto(server.url + "/ui/#/chat")
    # The shell fills its key field when its module runs: a key typed before then would be wiped.
    expect(page.get_by_label("Message", exact=True)).to_be_visible()
    server.log_in(page, key)


def open_chat(server: ConsoleServer, page: Page) -> None:
    log_in(server, page)
    # Anything the page tries that its CSP refuses (an inline style, a script) is collected here.
    page.evaluate(
        "window.violations = [];"
        "document.addEventListener('securitypolicyviolation', (e) => window.violations.push(e.violatedDirective))"
    )
    try:
        expect(page.locator("#pg-model option")).to_have_count(2, timeout=15_000)
    except AssertionError:
        said = page.evaluate(
            "() => [document.getElementById('pg-model-note')?.textContent, document.getElementById('key-status')?.textContent,"
            " document.getElementById('banner')?.textContent, sessionStorage.getItem('stoker.apiKey')]"
        )
        raise AssertionError(f"no models listed; model note, key status, banner, key: {said}") from None
    page.get_by_role("button", name="New chat").click()


def send(page: Page, text: str, max_tokens: int = 12) -> Any:
    """Type text, press Enter, and wait for the reply's figures; the reply's <article>."""
    page.get_by_label("Max tokens").fill(str(max_tokens))
    replies = page.locator(".msg-assistant")
    before = replies.count()
    page.get_by_label("Message", exact=True).fill(text)
    page.get_by_label("Message", exact=True).press("Enter")
    reply = replies.nth(before)
    expect(reply.locator(".msg-stats")).to_contain_text("usage:", timeout=REPLY_TIMEOUT_MS)
    return reply


def test_chat_streams_shows_figures_and_switches_model(
    console_server: ConsoleServer, page: Page, screenshot: Screenshot
) -> None:
    # The picker offers /v1/models' entries of kind generate (and adapters), never a reranker.
    listed = httpx.get(console_server.url + "/v1/models", headers=console_server.admin_headers()).json()["data"]
    assert {m["id"]: m["kind"] for m in listed} == {CHAT_MODEL: "generate", THINKING_MODEL: "generate"}
    open_chat(console_server, page)
    page.get_by_label("Logprobs (token view)").check()
    page.get_by_label("Top logprobs (0–20)").fill("3")
    # Every distinct text the reply shows while it streams.
    page.evaluate(
        """() => {
            window.seen = [];
            new MutationObserver(() => {
                const text = document.querySelector('.msg-assistant .markdown')?.textContent ?? '';
                if (text && text !== window.seen.at(-1)) window.seen.push(text);
            }).observe(document.querySelector('.pg-log'), {subtree: true, childList: true, characterData: true});
        }"""
    )
    reply = send(page, "Tell me a story", max_tokens=16)
    assert len(page.evaluate("window.seen")) > 1, "the reply arrived in one piece, not streamed"
    stats = reply.locator(".msg-stats").inner_text()
    figures = re.search(
        r"TTFT (\d+) ms · ([\d.]+) tokens/s · finish: (length|stop) · usage: (\d+) prompt \+ (\d+) completion = (\d+) tokens",
        stats,
    )
    assert figures, stats
    prompt, completion, total = (int(figures.group(i)) for i in (4, 5, 6))
    assert prompt > 0 and 0 < completion <= 16 and total == prompt + completion
    expect(reply.locator(".msg-who")).to_have_text(f"Assistant · {CHAT_MODEL}")
    screenshot(page, "playground-chat")

    reply.get_by_role("button", name="Tokens").click()
    tokens = reply.locator(".tokens .tok")
    expect(tokens).to_have_count(completion)
    tokens.first.focus()
    page.keyboard.press("ArrowRight")  # one tab stop; the arrows walk the tokens
    expect(tokens.nth(1)).to_be_focused()
    tip = page.get_by_role("tooltip")
    expect(tip).to_be_visible()
    expect(tokens.nth(1)).to_have_attribute("aria-describedby", "tok-tip")
    expect(tip.locator("tbody tr")).to_have_count(3)
    screenshot(page, "playground-tokens")

    page.get_by_label("Model", exact=True).select_option(THINKING_MODEL)
    thought = send(page, "Why is the sky blue?", max_tokens=16)
    expect(thought.locator(".msg-who")).to_have_text(f"Assistant · {THINKING_MODEL}")
    reasoning = thought.locator("details.reasoning")
    expect(reasoning).to_have_count(1)
    assert reasoning.get_attribute("open") is None, "the reasoning is shown collapsed"
    reasoning.locator("summary").click()
    expect(reasoning.locator(".reasoning-text")).not_to_be_empty()
    screenshot(page, "playground-reasoning")
    assert page.evaluate("window.violations") == []


def test_enter_sends_shift_enter_breaks_escape_stops(console_server: ConsoleServer, page: Page) -> None:
    open_chat(console_server, page)
    box = page.get_by_label("Message", exact=True)
    box.fill("first line")
    box.press("Shift+Enter")
    assert box.input_value() == "first line\n" and page.locator(".msg").count() == 0
    page.get_by_label("Max tokens").fill("400")
    box.press("Enter")
    reply = page.locator(".msg-assistant")
    expect(reply.locator(".markdown")).not_to_be_empty(timeout=REPLY_TIMEOUT_MS)
    page.keyboard.press("Escape")
    expect(reply.locator(".msg-stats")).to_contain_text("finish: stopped by you")
    expect(page.get_by_role("button", name="Stop")).to_be_disabled()
    # The server dropped the request with the connection (400 tokens would take many seconds more).
    deadline = time.monotonic() + 5
    while httpx.get(console_server.url + "/ready", headers=console_server.admin_headers()).json()["in_flight"]:
        assert time.monotonic() < deadline, "the stopped reply is still being generated"
        time.sleep(0.1)


def test_structured_output_tools_and_bad_settings(console_server: ConsoleServer, page: Page) -> None:
    open_chat(console_server, page)
    page.get_by_text("Structured output and tools").click()
    schema = page.get_by_label("JSON schema (structured output)")
    schema.fill('{"type": "object", "properties": ')
    page.get_by_label("Message", exact=True).fill("a number")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#pg-schema-error")).to_contain_text("JSON schema: is not valid JSON")
    expect(schema).to_have_attribute("aria-invalid", "true")
    assert page.locator(".msg").count() == 0, "a request went out with a broken schema"
    page.get_by_label("Temperature (0–2)").fill("3")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#pg-temperature-error")).to_contain_text("must be at most 2")
    page.get_by_label("Temperature (0–2)").fill("0")

    number = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}}
    schema.fill(json.dumps({**number, "required": ["n"], "additionalProperties": False}))
    reply = send(page, "a number", max_tokens=32)
    assert set(json.loads(reply.locator(".markdown").inner_text())) == {"n"}

    schema.fill("")
    tools = page.get_by_label("Tools (JSON list of function definitions)")
    tools.fill('[{"name": "bad name!"}]')
    page.get_by_label("Message", exact=True).fill("weather?")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#pg-tools-error")).to_contain_text("name must be 1 to 64 letters")
    city = {"type": "string", "enum": ["Paris", "Oslo"]}
    weather = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": city}}}
    weather["parameters"] |= {"required": ["city"], "additionalProperties": False}
    tools.fill(json.dumps([weather]))  # a bare function: the console wraps it as {"type": "function", ...}
    page.get_by_label("Tool choice").select_option("required")
    called = send(page, "weather?", max_tokens=32)
    expect(called.locator(".tool-call")).to_contain_text(re.compile(r'get_weather\(\{"city": "(Paris|Oslo)"\}\)'))
    expect(called.locator(".msg-stats")).to_contain_text("finish: tool_calls")


def test_regenerate_edit_and_branch(console_server: ConsoleServer, page: Page) -> None:
    open_chat(console_server, page)
    send(page, "one")
    page.get_by_role("button", name="Regenerate").click()
    versions = page.locator(".msg-assistant .versions")
    expect(versions).to_contain_text("2 / 2", timeout=REPLY_TIMEOUT_MS)
    expect(page.locator(".msg-assistant .msg-stats")).to_contain_text("usage:", timeout=REPLY_TIMEOUT_MS)
    page.get_by_role("button", name="Previous version of this turn").click()
    expect(versions).to_contain_text("1 / 2")

    page.get_by_role("button", name="Edit").click()
    page.get_by_label("Edit this message").fill("two")
    page.get_by_role("button", name="Send as new version").click()
    expect(page.locator(".msg-user .versions")).to_contain_text("2 / 2")
    expect(page.locator(".msg-user .user-text")).to_have_text("two")
    expect(page.locator(".msg-assistant .msg-stats")).to_contain_text("usage:", timeout=REPLY_TIMEOUT_MS)
    expect(page.locator(".msg-assistant .versions")).to_have_count(0)  # "two" has one reply so far

    page.locator(".msg-assistant").get_by_role("button", name="Branch").click()
    expect(page.locator(".pg-open[aria-current='true']")).to_have_text("one (branch)")
    expect(page.locator(".msg")).to_have_count(2)
    page.reload()  # kept in the browser
    expect(page.locator(".pg-open", has_text="one (branch)")).to_have_count(1)


def test_export_then_import(console_server: ConsoleServer, page: Page, tmp_path: Path) -> None:
    open_chat(console_server, page)
    page.get_by_label("Temperature (0–2)").fill("0")
    send(page, "Hello", max_tokens=12)
    with page.expect_download() as download:
        page.get_by_role("button", name="Export this").click()
    exported = tmp_path / "chat.json"
    download.value.save_as(exported)
    file = json.loads(exported.read_text())
    assert file["format"] == "stoker.conversations" and file["version"] == 1
    (conversation,) = file["conversations"]
    user, assistant = conversation["messages"]
    assert (user["role"], user["content"], assistant["parent"]) == ("user", "Hello", user["id"])
    # The playground's reply is the server's greedy reply to the same request, as the openai client gets it.
    client = openai.OpenAI(base_url=console_server.url + "/v1", api_key=console_server.key)
    same = client.chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "Hello"}], temperature=0, top_p=1, max_tokens=12
    )
    assert assistant["content"] == same.choices[0].message.content

    listed = page.locator(".pg-open")
    before = listed.count()
    page.locator("#pg-import").set_input_files(str(exported))
    expect(page.locator("#pg-io-note")).to_contain_text("Imported 1 conversation from chat.json")
    expect(listed).to_have_count(before + 1)  # its id is here already: kept beside, never over it
    expect(page.locator(".msg-user .user-text")).to_have_text("Hello")

    conversation["messages"][1]["role"] = "system"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(file))
    page.locator("#pg-import").set_input_files(str(bad))
    expect(page.locator("#pg-io-note")).to_contain_text(
        'bad.json was not imported: conversations[0].messages[1].role: must be "user" or "assistant"'
    )
    bad.write_text("{not json")
    page.locator("#pg-import").set_input_files(str(bad))
    expect(page.locator("#pg-io-note")).to_contain_text("bad.json was not imported: file: not JSON")
    expect(listed).to_have_count(before + 1)


HOSTILE = (
    "<script>window.pwned = 'script'</script>\n"
    "<img src=x onerror=\"window.pwned = 'img'\">\n"
    "[x](javascript:alert(1)) and [y](JaVaScRiPt:alert(2)) and [z](java\tscript:alert(3))\n"
    "![pic](javascript:alert(4)) ![tracker](https://example.com/t.png)\n"
    "[fine](https://example.com/ok) `<b>code</b>`\n"
    "```html\n<iframe src=javascript:alert(5)></iframe>\n```"
)


def hostile_file() -> dict[str, Any]:
    token = {"token": "<img src=x onerror=alert(6)>", "logprob": -0.5, "top_logprobs": []}
    messages = [
        {"id": "u", "parent": None, "role": "user", "content": "<script>alert(7)</script>"},
        {
            "id": "a",
            "parent": "u",
            "role": "assistant",
            "content": HOSTILE,
            "reasoning": HOSTILE,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": HOSTILE}}],
            "logprobs": [token],
        },
    ]
    conversation = {
        "id": "hostile",
        "title": "<img src=x onerror=alert(8)>",
        "created": 1,
        "updated": 2,
        "settings": {},
        "messages": messages,
        "leaf": "a",
    }
    return {"format": "stoker.conversations", "version": 1, "conversations": [conversation]}


def test_model_output_cannot_run_script(
    console_server: ConsoleServer, page: Page, tmp_path: Path, screenshot: Screenshot
) -> None:
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    open_chat(console_server, page)
    crafted = tmp_path / "hostile.json"
    crafted.write_text(json.dumps(hostile_file()))
    page.locator("#pg-import").set_input_files(str(crafted))
    reply = page.locator(".msg-assistant")
    expect(reply.locator(".markdown")).to_contain_text("<script>window.pwned = 'script'</script>")
    reply.locator("details.reasoning summary").click()
    expect(page.locator(".pg-open[aria-current='true']")).to_have_text("<img src=x onerror=alert(8)>")
    screenshot(page, "playground-hostile", full_page=True)
    links = reply.locator(".markdown a").evaluate_all("(links) => links.map((a) => [a.textContent, a.href, a.rel])")
    assert links == [
        ["image: tracker", "https://example.com/t.png", "noopener noreferrer nofollow"],
        ["fine", "https://example.com/ok", "noopener noreferrer nofollow"],
    ]
    reply.get_by_role("button", name="Tokens").click()
    expect(reply.locator(".tokens .tok")).to_have_text("<img src=x onerror=alert(6)>")
    page.wait_for_timeout(300)  # time for an image's onerror, had one been made
    made = page.evaluate(
        """() => ({
            elements: document.querySelectorAll('main script, main img, main iframe, main object, main embed').length,
            scripted: [...document.querySelectorAll('main a')].filter((a) => !/^(https?|mailto):/.test(a.href)).length,
            pwned: window.pwned ?? null,
        })"""
    )
    assert made == {"elements": 0, "scripted": 0, "pwned": None}
    assert dialogs == [] and page.evaluate("window.violations") == []


MARKDOWN_CASES = {
    "plain <b>bold</b>": "p(plain <b>bold</b>)",
    "**bold _em_** ~~gone~~ `a<b`": "p(strong(bold em(em)) del(gone) code(a<b))",
    "# Title\ntext": "h3(Title)p(text)",
    "## Closed ##\n###### C# #": "h4(Closed)h6(C#)",
    "- one\n- two *x*\n  - nested\n\n1. first": "ul(li(one)li(two em(x)ul(li(nested))))ol(li(first))",
    "> quoted\n> more": "blockquote(p(quotedbr()more))",
    "```js\nlet a = '<x>';\n```": "pre(code(let a = '<x>';))",
    "| a | b |\n|---|:-:|\n| 1 | **2** |": "div(table(thead(tr(th(a)th(b)))tbody(tr(td(1)td(strong(2))))))",
    "[a](https://x.test/p?q=1) <mailto:me@x.test> https://x.test/b.": (
        "p(a[https://x.test/p?q=1](a) a[mailto:me@x.test](mailto:me@x.test) a[https://x.test/b](https://x.test/b).)"
    ),
    "[a](javascript:alert(1)) [b](data:text/html,x) [c](/relative) [d](vbscript:x)": (
        "p([a](javascript:alert(1)) [b](data:text/html,x) [c](/relative) [d](vbscript:x))"
    ),
    "![alt](https://x.test/i.png) ![bad](javascript:x)": "p(a[https://x.test/i.png](image: alt) ![bad](javascript:x))",
    "\\*not em\\* line\nnext": "p(*not em* linebr()next)",
}


def test_markdown_renderer(console_server: ConsoleServer, page: Page) -> None:
    """markdown.js itself, in the browser: each case's DOM as tag(children), links as a[href]."""
    page.goto(console_server.url + "/ui/#/chat")
    rendered = page.evaluate(
        """async (cases) => {
            const { renderMarkdown } = await import('/ui/markdown.js');
            const shape = (node) => node.nodeType === Node.TEXT_NODE ? node.data
                : `${node.nodeName.toLowerCase()}${node.href ? `[${node.href}]` : ''}(${[...node.childNodes].map(shape).join('')})`;
            return Object.fromEntries(cases.map((text) => [text, [...renderMarkdown(text).childNodes].map(shape).join('')]));
        }""",
        list(MARKDOWN_CASES),
    )
    assert rendered == MARKDOWN_CASES

    # Lines built to make a backtracking pattern take quadratic (or worse) time: each must stay linear.
    hostile = "\n".join(
        ["# a" + " " * 20_000 + "#x", "[a](" * 5_000, " " * 20_000 + "x", "|a|", " " * 20_000, "**a" * 6_000]
    )
    spent = page.evaluate(
        """async (text) => {
            const { renderMarkdown } = await import('/ui/markdown.js');
            const start = performance.now();
            renderMarkdown(text);
            return performance.now() - start;
        }""",
        hostile,
    )
    assert spent < 2000, f"{spent:.0f} ms to render {len(hostile)} characters"


def test_a_busy_server_is_asked_for_the_models_again(console_server: ConsoleServer, page: Page) -> None:
    """A model listing refused as busy (503) is not the page's last word: it says so, asks again by itself,
    and the picker fills once the server answers."""
    asked: list[str] = []

    def busy_twice(route: Route) -> None:
        asked.append(route.request.url)
        if len(asked) <= 2:
            route.fulfill(status=503, json={"error": {"message": "engine busy", "type": "server_error", "code": None}})
        else:
            route.continue_()

    page.route("**/v1/models", busy_twice)
    log_in(console_server, page)
    expect(page.locator("#pg-model-note")).to_contain_text("The server is busy")
    expect(page.locator("#pg-model option")).to_have_count(2, timeout=15_000)
    expect(page.locator("#pg-model-note")).to_have_text("")
    assert len(asked) >= 3


def test_the_page_does_not_take_the_focus_from_a_key_being_typed(console_server: ConsoleServer, page: Page) -> None:
    """The chat focuses its message box when it has loaded; someone already typing a key when that
    happens goes on typing into the key field (before, the rest of the key went into the message box
    and 'Use key' saved an empty one: the CI flake 'No key: open mode')."""
    held: list[Route] = []
    page.route("**/v1/models", lambda route: held.append(route))
    page.goto(console_server.url + "/ui/#/chat")
    expect(page.get_by_label("Message", exact=True)).to_be_visible()
    key_field = page.get_by_label("API key")
    key_field.click()
    page.keyboard.type("sk-first-half-")
    for route in held:  # the listing answers now, while the key is half typed: the page's load ends
        route.continue_()
    expect(page.locator("#pg-model-note")).to_contain_text("needs an API key")
    page.wait_for_timeout(300)  # the mount's last step (where the focus moved) runs right after the listing
    page.keyboard.type("second-half")
    assert page.evaluate("document.activeElement.id") == "key-input"
    expect(key_field).to_have_value("sk-first-half-second-half")
    expect(page.get_by_label("Message", exact=True)).to_have_value("")


def test_wrong_key_says_so(console_server: ConsoleServer, page: Page, screenshot: Screenshot) -> None:
    log_in(console_server, page, key="sk-not-a-real-key")
    expect(page.locator("#pg-model-note")).to_contain_text(
        "The models could not be listed: The server refused this API key"
    )
    page.get_by_label("Message", exact=True).fill("hello")
    page.get_by_role("button", name="Send").click()
    expect(page.get_by_role("alert").filter(has_text="The server refused this API key")).to_have_count(
        2
    )  # and beside Send
    screenshot(page, "playground-wrong-key")


def test_narrow_window_and_named_controls(console_server: ConsoleServer, page: Page, screenshot: Screenshot) -> None:
    page.set_viewport_size({"width": 390, "height": 844})
    open_chat(console_server, page)
    page.get_by_label("Logprobs (token view)").check()
    send(page, "hi", max_tokens=8)
    overflow = page.evaluate("document.scrollingElement.scrollWidth - document.scrollingElement.clientWidth")
    assert overflow <= 0, f"the page scrolls sideways by {overflow}px at 390px wide"
    expect(page.get_by_role("button", name="Send")).to_be_visible()
    screenshot(page, "playground-narrow", full_page=True)

    page.get_by_role("button", name="Tokens").click()
    page.get_by_text("Structured output and tools").click()
    unnamed = page.evaluate(
        """() => [...document.querySelectorAll('main :is(input, select, textarea, button, [tabindex="0"])')]
            .filter((el) => !(el.labels?.length || el.getAttribute('aria-label') || el.textContent.trim()))
            .map((el) => el.outerHTML)"""
    )
    assert unnamed == [], "controls a screen reader cannot name"
