"""The screenshot of the chat page in docs/images/chat-page.png: the tiny trained chat model
(tests/chat_model.py) served for real, the page driven in headless Chromium as tests/test_web_ui.py drives
it: a greeting (reasoning shown), then in a new chat a tool call, its result and the answer to that,
whose prompt came from the prefix cache.

    .venv/bin/python tests/web_ui_screenshot.py [docs/images/chat-page.png]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]  # this checkout's package, not another installed one

from chat_model import TOOL_RESULT, WEATHER_TOOL, cached_chat_checkpoint  # noqa: E402
from running_server import RunningServer  # noqa: E402
from web_page import EXPECT_TIMEOUT_MS, ChatPage, launch_chromium, missing_browser  # noqa: E402

from optimum_qwen36 import NeuronQwen36ForCausalLM  # noqa: E402
from optimum_qwen36.server import ServerSettings, build_app, served_model  # noqa: E402

MODEL = "tiny-chat"
OUTPUT = ROOT / "docs" / "images" / "chat-page.png"


def take_screenshot(output: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    settings = dict(batch_size=2, sequence_length=1024, prefill_chunk_size=64, prefix_caching=True)
    model = NeuronQwen36ForCausalLM.from_pretrained(
        cached_chat_checkpoint(), export=True, backend="eager", **settings
    )
    running = RunningServer(build_app(lambda: served_model(model), ServerSettings(MODEL)))
    running.wait_healthy()
    try:
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            context = browser.new_context(viewport={"width": 1280, "height": 860}, color_scheme="light")
            chat_page = ChatPage(context.new_page(), running.url).open()
            chat_page.wait_for_model(MODEL)
            chat_page.set_greedy()
            chat_page.send("Say hello.")
            chat_page.wait_for_answers(1)

            chat_page.page.get_by_role("button", name="New chat").click()
            chat_page.set_tools([WEATHER_TOOL])
            chat_page.send("What is the weather in Paris?")
            chat_page.wait_for_answers(1)
            chat_page.send(TOOL_RESULT)
            answer = chat_page.wait_for_answers(2)
            answer.locator("details.reasoning summary").click()
            expect(answer.locator(".reasoning-text")).to_be_visible()
            chat_page.page.locator("#tools").evaluate("(tools) => (tools.scrollTop = 0)")
            output.parent.mkdir(parents=True, exist_ok=True)
            chat_page.page.screenshot(path=str(output))
            chat_page.check_clean()
            browser.close()
    finally:
        running.stop()


if __name__ == "__main__":
    reason = missing_browser()
    if reason:
        sys.exit(f"Cannot take the screenshot: {reason}")
    take_screenshot(Path(sys.argv[1]) if len(sys.argv) > 1 else OUTPUT)
