"""The browser chat page in a real headless Chromium, against real edges, Kafka, workers and routers.

Needs Debian's chromium (/usr/bin/chromium) and Playwright for Python, which `make test` installs.
`DRIVETRAIN_DOCS_SCREENSHOT=1` also writes the screenshot test's picture to docs/chat-page.png.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from playwright.async_api import async_playwright, expect

from services.launcher.fleet import Fleet
from tests.conftest import start_fleet

CHROMIUM = os.environ.get("DRIVETRAIN_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "chat-page.png"
STREAM_TIMEOUT_MS = 30_000
MARKUP = "<script>alert(1)</script><b>bold</b>"
# The echo model sends this back: a reply with a code block, a list, a table, inline code and a
# link whose target is script.
MARKDOWN = """Here is `hello.py`:

```python
print("<hi>")
```

- one
- two

| a | b |
|---|---|
| 1 | 2 |

[click me](javascript:alert(document.domain))"""
# The last reply's text while it is still streaming (checked in one go, in the page).
MID_STREAM_TEXT = """() => {
  const reply = [...document.querySelectorAll(".message.assistant")].pop();
  return reply?.dataset.status === "streaming" && reply.querySelector(".body").textContent;
}"""
# Keeps the page's sockets where a test can reach them (window.testSockets), to drop one.
KEEP_SOCKETS = """(() => {
  const Native = window.WebSocket;
  window.testSockets = [];
  window.WebSocket = class extends Native {
    constructor(...args) {
      super(...args);
      window.testSockets.push(this);
    }
  };
})()"""
# Closes the page's open socket; the page sees it drop as it would a lost network.
DROP_SOCKET = "() => window.testSockets.filter((ws) => ws.readyState === WebSocket.OPEN).forEach((ws) => ws.close())"
# The last reply's text and meta the moment it shows as reconnecting (checked in one go, in the page).
RECONNECTING = """() => {
  const reply = [...document.querySelectorAll(".message.assistant")].pop();
  return reply?.dataset.status === "reconnecting" &&
    [reply.querySelector(".body").textContent, reply.querySelector(".meta").textContent];
}"""


@pytest.fixture(scope="module", autouse=True)
def browser_installed() -> None:
    assert shutil.which(CHROMIUM), f"no browser at {CHROMIUM}: `apt-get install chromium` (make test does)"


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@pytest.fixture(scope="module")
def page_fleet(topics, fleet_logs) -> Iterator[Fleet]:
    """One edge, router and worker; 30 ms echo steps so a reply streams long enough to stop."""
    fleet = start_fleet(topics, fleet_logs, edges=1, routers=1, workers=1, model="echo", echo_delay_ms=30)
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
async def browser():
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        await chromium.close()


class ChatPage:
    """One browser tab on the chat page, with what it sent on its sockets and any script errors."""

    def __init__(self, page, base_url: str) -> None:
        self.page = page
        self.base_url = base_url
        self.sent: list[dict] = []
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        page.on("websocket", lambda ws: ws.on("framesent", self._record_sent))
        page.on("dialog", self._record_dialog)
        page.on("pageerror", lambda error: self.errors.append(str(error)))

    def _record_sent(self, payload: str | bytes) -> None:
        self.sent.append(json.loads(payload))

    async def _record_dialog(self, dialog) -> None:
        self.dialogs.append(dialog.message)
        await dialog.dismiss()

    async def open(self, key: str | None = "dev-key") -> None:
        await self.page.goto(self.base_url)
        if key is not None:
            await self.sign_in(key)
            await expect(self.page.locator("#connection")).to_have_attribute("data-state", "open")

    async def sign_in(self, key: str) -> None:
        await self.page.get_by_label("API key").fill(key)
        await self.page.get_by_role("button", name="Connect").click()

    async def ask(self, text: str) -> None:
        prompt = self.page.get_by_role("textbox", name="Message", exact=True)
        await prompt.fill(text)
        await prompt.press("Enter")

    def reply(self, index: int = -1):
        replies = self.page.locator(".message.assistant")
        return replies.nth(index) if index >= 0 else replies.last

    async def wait_finished(self, reply, status: str = "stop") -> str:
        await expect(reply).to_have_attribute("data-status", status, timeout=STREAM_TIMEOUT_MS)
        return await reply.locator(".body").text_content()

    def chat_frames(self) -> list[dict]:
        return [f for f in self.sent if f["type"] == "chat"]


@pytest.fixture
async def chat(browser, page_fleet) -> AsyncIterator[ChatPage]:
    context = await browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light")
    tab = ChatPage(await context.new_page(), f"http://127.0.0.1:{page_fleet.spec.base_port}/")
    yield tab
    await context.close()
    assert tab.errors == [], f"script errors on the page: {tab.errors}"


async def test_reply_streams_in_and_the_next_question_carries_the_conversation(chat):
    await chat.open()
    first = words(60, "alpha")
    await chat.ask(first)
    partial = await chat.page.wait_for_function(MID_STREAM_TEXT, timeout=STREAM_TIMEOUT_MS)
    assert 0 < len((await partial.json_value()).split()) < 60
    assert await chat.wait_finished(chat.reply()) == first
    await expect(chat.page.locator(".conversation[aria-current='true']")).to_contain_text("alpha0 alpha1")

    await chat.ask("and a second question")
    assert await chat.wait_finished(chat.reply(1)) == "and a second question"
    frames = chat.chat_frames()
    assert len(frames) == 2 and frames[0]["id"] != frames[1]["id"]
    assert frames[1]["messages"] == [
        {"role": "user", "content": first},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "and a second question"},
    ]


async def test_stop_ends_the_reply_as_cancelled_midway(chat):
    await chat.open()
    await chat.ask(words(300))
    reply = chat.reply()
    await expect(reply.locator(".body")).to_contain_text("w3 ", timeout=STREAM_TIMEOUT_MS)
    stop = chat.page.get_by_role("button", name="Stop")
    await stop.click()
    text = await chat.wait_finished(reply, "cancelled")
    await expect(reply.locator(".meta")).to_have_text("Stopped")
    assert 4 <= len(text.split()) < 300
    cancels = [f for f in chat.sent if f["type"] == "cancel"]
    assert cancels == [{"type": "cancel", "id": chat.chat_frames()[0]["id"]}]
    await expect(stop).to_be_hidden()
    await expect(chat.page.get_by_role("button", name="Send")).to_be_visible()


async def test_refused_key_is_shown_and_asked_for_again(chat):
    await chat.open(key=None)
    await chat.sign_in("not-a-key")
    dialog = chat.page.locator("#key-dialog")
    await expect(dialog.get_by_role("alert")).to_have_text("refused: check your API key")
    await expect(dialog).to_be_visible()
    await expect(chat.page.locator("#connection")).to_have_attribute("data-state", "refused")
    assert await chat.page.evaluate("sessionStorage.getItem('drivetrain.apiKey')") is None

    await chat.sign_in("dev-key")
    await expect(chat.page.locator("#connection")).to_have_attribute("data-state", "open")
    await expect(dialog).to_be_hidden()
    await chat.ask("hello again")
    assert await chat.wait_finished(chat.reply()) == "hello again"
    await chat.page.reload()  # the key is kept for the tab: no second prompt
    await expect(chat.page.locator("#connection")).to_have_attribute("data-state", "open")
    await expect(dialog).to_be_hidden()


async def test_markup_in_messages_and_replies_stays_literal_text(chat):
    await chat.open()
    await chat.ask(MARKUP)
    assert await chat.wait_finished(chat.reply()) == MARKUP
    await expect(chat.page.locator(".message.user .body")).to_have_text(MARKUP)
    await expect(chat.page.locator(".conversation").first).to_have_text(MARKUP)
    for tag in ("b", "script"):
        assert await chat.page.locator(f".messages {tag}, .sidebar {tag}").count() == 0
    assert chat.dialogs == []


async def test_conversations_stream_side_by_side_and_keep_their_history(chat):
    await chat.open()
    long = words(200, "long")
    await chat.ask(long)
    await expect(chat.reply()).to_have_attribute("data-status", "streaming", timeout=STREAM_TIMEOUT_MS)

    await chat.page.get_by_role("button", name="New conversation").click()
    await expect(chat.page.locator(".message")).to_have_count(0)
    await chat.ask("short one")
    assert await chat.wait_finished(chat.reply()) == "short one"

    conversations = chat.page.locator(".conversation")
    await expect(conversations).to_have_count(2)
    first = conversations.filter(has_text="long0 long1")
    await expect(first.get_by_role("img", name="replying")).to_have_count(1)  # still streaming meanwhile
    await first.click()
    await expect(chat.page.locator(".message.user .body")).to_have_text([long])
    assert await chat.wait_finished(chat.reply()) == long
    await conversations.filter(has_text="short one").click()
    await expect(chat.page.locator(".message .body")).to_have_text(["short one", "short one"])
    frames = chat.chat_frames()
    assert [len(f["messages"]) for f in frames] == [1, 1] and frames[0]["id"] != frames[1]["id"]


async def test_phone_width_and_dark_theme(browser, page_fleet):
    context = await browser.new_context(viewport={"width": 390, "height": 844}, color_scheme="dark", is_mobile=True)
    try:
        tab = ChatPage(await context.new_page(), f"http://127.0.0.1:{page_fleet.spec.base_port}/")
        await tab.open()
        page = tab.page
        background = await page.evaluate("getComputedStyle(document.body).backgroundColor")
        red, green, blue = (int(c) for c in background[background.index("(") + 1 : -1].split(",")[:3])
        assert red + green + blue < 150, background
        assert await page.evaluate("document.documentElement.scrollWidth") <= 390

        sidebar = page.get_by_role("navigation", name="Conversations")
        await expect(sidebar).to_be_hidden()
        await page.get_by_role("button", name="Chats").click()
        await expect(sidebar).to_be_visible()
        await sidebar.get_by_role("button", name="New conversation").click()
        await expect(sidebar).to_be_hidden()
        await tab.ask("small screen")
        assert await tab.wait_finished(tab.reply()) == "small screen"
        assert tab.errors == []
    finally:
        await context.close()


async def test_reply_renders_as_markdown_with_script_links_neutralised(chat):
    await chat.page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    await chat.open()
    await chat.ask(MARKDOWN)
    reply = chat.reply()
    await chat.wait_finished(reply)
    body = reply.locator(".body")
    code = body.locator("pre > code")
    await expect(code).to_have_text('print("<hi>")\n')
    await expect(code).to_have_class("language-python")
    await expect(body.locator(":not(pre) > code")).to_have_text("hello.py")
    await expect(body.locator("li")).to_have_text(["one", "two"])
    await expect(body.locator("table td")).to_have_text(["1", "2"])
    link = body.get_by_text("click me")
    await expect(link).to_have_count(1)
    href = await link.get_attribute("href")
    assert href is None or not href.strip().lower().startswith("javascript:"), href
    await link.click()
    assert chat.dialogs == []
    await expect(chat.page.locator(".message.user .body")).to_have_text(MARKDOWN)  # the question stays as typed

    await reply.get_by_role("button", name="Copy code").click()
    await expect(reply.locator(".copy")).to_have_text("Copied")
    assert await chat.page.evaluate("navigator.clipboard.readText()") == 'print("<hi>")\n'

    stats = reply.locator(".stats")
    await expect(stats.locator(".ttft")).to_have_text(re.compile(r"^\d+ ms to first token$"))
    await expect(stats.locator(".rate")).to_have_text(re.compile(r"^[\d.]+ tokens/s$"))
    await expect(stats.locator(".cached")).to_have_text(re.compile(r"^0 of \d+ prompt tokens cached$"))


async def test_settings_panel_sets_temperature_max_tokens_and_system_prompt(chat):
    await chat.open()
    await chat.page.get_by_role("button", name="Settings").click()
    dialog = chat.page.get_by_role("dialog", name="Settings")
    await dialog.get_by_label("Temperature").fill("0")
    await dialog.get_by_label("Max tokens").fill("3")
    await dialog.get_by_label("System prompt").fill("Answer briefly.")
    await dialog.get_by_role("button", name="Save").click()
    await expect(dialog).to_be_hidden()

    await chat.ask("one two three four five")
    assert (await chat.wait_finished(chat.reply(), "length")).strip() == "one two three"
    (frame,) = chat.chat_frames()
    assert frame["temperature"] == 0 and frame["max_tokens"] == 3
    assert frame["messages"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "one two three four five"},
    ]
    await chat.page.reload()  # kept in the browser
    await chat.page.get_by_role("button", name="Settings").click()
    await expect(dialog.get_by_label("Max tokens")).to_have_value("3")
    await expect(dialog.get_by_label("System prompt")).to_have_value("Answer briefly.")


async def test_without_the_markdown_libraries_replies_are_plain_text(chat):
    await chat.page.route("**/vendor/*", lambda route: route.abort())
    await chat.open()
    await chat.ask("**not bold** and `not code`")
    assert await chat.wait_finished(chat.reply()) == "**not bold** and `not code`"
    assert await chat.page.locator(".messages strong, .messages code").count() == 0


async def test_screenshot_of_a_conversation(chat, tmp_path):
    await chat.open()
    await chat.ask("Plan a three day trip to Lisbon")
    await chat.wait_finished(chat.reply())
    await chat.page.get_by_role("button", name="New conversation").click()
    await chat.ask("Hello! Replies stream back word by word, in order, over one WebSocket.")
    await chat.wait_finished(chat.reply())
    await chat.ask(
        "Replies render as **Markdown**, with `inline code`, lists and code:\n\n"
        "- several chats share the socket\n- each is told apart by its `id`\n\n"
        '```python\nsock = await ChatSocket.open(url)\nawait sock.chat("c1", "Hello")\n```'
    )
    await chat.wait_finished(chat.reply(1))
    await chat.ask(
        "Stop cuts a reply short: the words already shown stay on the page, the worker frees its "
        "place in the batch, and the reply ends as cancelled. " * 3
    )
    await expect(chat.reply(2).locator(".body")).to_contain_text("stay ", timeout=STREAM_TIMEOUT_MS)
    await chat.page.get_by_role("button", name="Stop").click()
    await chat.wait_finished(chat.reply(2), "cancelled")

    target = DOCS_SCREENSHOT if os.environ.get("DRIVETRAIN_DOCS_SCREENSHOT") == "1" else tmp_path / "chat-page.png"
    png = await chat.page.screenshot(path=str(target))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (1280, 800)


async def test_dropped_socket_resumes_the_reply_in_place(chat):
    await chat.page.add_init_script(KEEP_SOCKETS)
    await chat.open()
    sent = words(200, "resume")
    await chat.ask(sent)
    reply = chat.reply()
    await expect(reply.locator(".body")).to_contain_text("resume3 ", timeout=STREAM_TIMEOUT_MS)

    await chat.page.evaluate(DROP_SOCKET)
    shown, meta = await (await chat.page.wait_for_function(RECONNECTING, timeout=STREAM_TIMEOUT_MS)).json_value()
    assert meta == "Reconnecting…" and sent.startswith(shown) and len(shown.split()) >= 4
    await expect(chat.page.locator("#connection")).to_have_attribute("data-state", "open", timeout=STREAM_TIMEOUT_MS)
    assert await chat.wait_finished(reply) == sent  # nothing lost, nothing twice
    await expect(reply.locator(".meta")).to_be_empty()
    assert await chat.page.evaluate("window.testSockets.length") == 2

    (chat_frame,) = chat.chat_frames()
    (resume,) = [f for f in chat.sent if f["type"] == "resume"]
    assert resume["id"] == chat_frame["id"] and resume["request_id"] and resume["resume_token"]
    assert 0 <= resume["last_seq"] < 200


async def test_dropped_socket_fails_the_reply_then_reconnects_and_retries(chat, page_fleet):
    """Last in this file: it kills the edge and restarts it only after the page gave the reply up."""
    await chat.open()
    await chat.ask(words(300, "drop"))
    reply = chat.reply()
    await expect(reply.locator(".body")).to_contain_text("drop2 ", timeout=STREAM_TIMEOUT_MS)

    await asyncio.to_thread(page_fleet.kill, "edge-0")
    await chat.wait_finished(reply, "error")
    await expect(reply.locator(".error-text")).to_contain_text("disconnected")
    await expect(chat.page.locator("#connection")).not_to_have_attribute("data-state", "open")

    await asyncio.to_thread(page_fleet.start_child, page_fleet.spec.edge(0))
    await asyncio.to_thread(page_fleet.wait_ready, 60)
    await expect(chat.page.locator("#connection")).to_have_attribute("data-state", "open", timeout=STREAM_TIMEOUT_MS)
    await reply.get_by_role("button", name="Retry").click()
    assert await chat.wait_finished(reply) == words(300, "drop")
    frames = chat.chat_frames()
    assert len(frames) == 2 and frames[0]["messages"] == frames[1]["messages"] and frames[0]["id"] != frames[1]["id"]
