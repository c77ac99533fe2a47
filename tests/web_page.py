"""Driving the chat page (optimum_qwen36/server/web/) in headless Chromium with Playwright: launching
Debian's chromium, and `ChatPage`, what a user does on the page, by its labels. tests/test_web_ui.py and
tests/web_ui_screenshot.py use it."""

from __future__ import annotations

import base64
import importlib.util
import json
import shutil
from typing import Any

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# A closed network refuses the connections Chromium opens on its own (updates, sync, QUIC probes), and
# headless in a container has no GPU and no sandbox.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Seconds a page condition may take: an answer of the tiny model on a busy 2-core machine takes a few.
EXPECT_TIMEOUT_MS = 60_000


def missing_browser() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is missing (pip install -e '.[dev]')"
    if not shutil.which(CHROMIUM):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium)"
    return None


def launch_chromium(playwright: Any) -> Any:
    """Debian's Chromium, headless, with a fresh profile (Playwright makes one per launch)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


class ChatPage:
    """The chat page at `url`, driven as a user would: through the labelled controls. It records every URL
    the page requests and its script errors and Content Security Policy violations (`check_clean`)."""

    def __init__(self, page: Any, url: str) -> None:
        from playwright.sync_api import expect

        self.page, self.url, self.expect = page, url, expect
        self.requested: list[str] = []
        self.errors: list[str] = []
        page.on("request", lambda request: self.requested.append(request.url))
        page.on("pageerror", lambda error: self.errors.append(str(error)))
        page.on("console", self._console)

    def _console(self, message: Any) -> None:
        if "Content Security Policy" in message.text:
            self.errors.append(message.text)

    def check_clean(self) -> None:
        """No script error, no policy violation, and every request went to this server."""
        assert not self.errors, self.errors
        others = [url for url in self.requested if not url.startswith(self.url + "/")]
        assert self.requested and not others, others

    def open(self) -> ChatPage:
        self.page.goto(self.url + "/")
        return self

    def wait_for_model(self, name: str) -> None:
        self.expect(self.page.locator("#model-name")).to_have_text(name)

    def set_settings(self, **values: str) -> None:
        """Fill settings by their labels: set_settings(**{"Temperature": "0", "Max tokens": "8"})."""
        toggle = self.page.get_by_role("button", name="Settings")
        if toggle.get_attribute("aria-expanded") != "true":
            toggle.click()
        for label, value in values.items():
            self.page.get_by_label(label, exact=True).fill(value)

    def set_greedy(self) -> None:
        """Temperature 0: the tiny model writes its trained answers."""
        self.set_settings(Temperature="0")

    def set_tools(self, tools: list[dict[str, Any]]) -> None:
        self.set_settings(**{"Tools (JSON: OpenAI function tools)": json.dumps(tools, indent=2)})

    def set_thinking(self, on: bool) -> None:
        self.page.get_by_label("Thinking").set_checked(on)

    def send(self, text: str) -> None:
        self.page.get_by_label("Message").fill(text)
        self.page.get_by_label("Message").press("Enter")

    def attach_file(self, name: str, mime_type: str, data: bytes) -> None:
        """Choose a file with the page's file input (behind the "Attach images" button)."""
        file = {"name": name, "mimeType": mime_type, "buffer": data}
        self.page.get_by_label("Attach images").set_input_files(file)

    def give_file(self, event: str, name: str, mime_type: str, data: bytes) -> None:
        """Paste (event "paste", into the message box) or drop (event "drop", onto the composer) a file, as
        the browser delivers one from the clipboard or a drag."""
        self.page.evaluate(
            """([event, name, mimeType, base64]) => {
            const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], name, {type: mimeType}));
            const init = {bubbles: true, cancelable: true};
            if (event === "paste") {
                document.getElementById("prompt").dispatchEvent(
                    new ClipboardEvent("paste", {...init, clipboardData: transfer})
                );
            } else {
                const target = document.getElementById("prompt");
                target.dispatchEvent(new DragEvent("dragover", {...init, dataTransfer: transfer}));
                target.dispatchEvent(new DragEvent("drop", {...init, dataTransfer: transfer}));
            }
        }""",
            [event, name, mime_type, base64.b64encode(data).decode()],
        )

    def answers(self) -> Any:
        return self.page.locator(".message.assistant")

    def wait_for_answers(self, count: int) -> Any:
        """Until `count` answers are complete (their stats, which the last chunk brings, are shown): the
        last of them."""
        self.expect(self.page.locator(".message.assistant .stats")).to_have_count(count)
        self.expect(self.page.get_by_role("button", name="Send")).to_be_enabled()
        return self.answers().nth(count - 1)

    def stat(self, answer: Any, name: str) -> int:
        """A whole-number stat of an answer: prompt, cached or completion tokens."""
        return int(answer.locator(f'[data-stat="{name}"]').inner_text().split()[0])
