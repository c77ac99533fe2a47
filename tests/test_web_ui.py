"""The chat page at / of `optimum-qwen36 serve`, in a real browser: headless Chromium (Debian's) driven by
Playwright against the real server and the tiny model trained to write reasoning and tool calls
(tests/chat_model.py). Each test opens the page in a fresh browser context (empty local and session
storage) and waits on page conditions, never on time."""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from chat_model import CONVERSATIONS, WEATHER_ARGUMENTS, WEATHER_TOOL, cached_chat_checkpoint
from helpers import serve_tiny_vision_model
from PIL import Image
from running_server import API_KEY, RunningServer
from web_page import EXPECT_TIMEOUT_MS, ChatPage, launch_chromium, missing_browser

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.cli import build_parser, serve_app
from optimum_qwen36.server import ServerSettings, build_app, served_model
from optimum_qwen36.server.web_ui import CONTENT_SECURITY_POLICY

MODEL = "tiny-chat"
GREETING_REASONING = "The user greets me."
GREETING_ANSWER = "Hello! How can I help you today?"
NO_THINKING_ANSWER = CONVERSATIONS["no_thinking"].answer
API_KEY_STORAGE = "optimum-qwen36.api-key"  # app.js's sessionStorage key
# An untrained prompt: the tiny model writes (reasoning) tokens until max tokens.
ENDLESS_PROMPT = "Write a poem"


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    reason = missing_browser()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def model() -> NeuronQwen36ForCausalLM:
    settings = dict(batch_size=2, sequence_length=1024, prefill_chunk_size=64, prefix_caching=True)
    return NeuronQwen36ForCausalLM.from_pretrained(
        cached_chat_checkpoint(), export=True, backend="eager", **settings
    )


def start_server(model: NeuronQwen36ForCausalLM, **settings: Any) -> RunningServer:
    running = RunningServer(build_app(lambda: served_model(model), ServerSettings(MODEL, **settings)))
    running.wait_healthy()
    return running


@pytest.fixture(scope="module")
def server(model) -> Iterator[RunningServer]:
    running = start_server(model)
    yield running
    running.stop()


@contextmanager
def opened_page(chromium: Any, running: RunningServer, api_key: str | None = None) -> Iterator[ChatPage]:
    """The page of `running` in a fresh browser context (with `api_key` already in its session storage, as
    if given earlier in the tab); on leaving, checked clean (ChatPage.check_clean)."""
    context = chromium.new_context(viewport={"width": 1280, "height": 860})
    if api_key is not None:
        arguments = f"{json.dumps(API_KEY_STORAGE)}, {json.dumps(api_key)}"
        context.add_init_script(f"sessionStorage.setItem({arguments})")
    chat_page = ChatPage(context.new_page(), running.url)
    try:
        yield chat_page.open()
    finally:
        context.close()
    chat_page.check_clean()


@pytest.fixture
def chat_page(chromium, server) -> Iterator[ChatPage]:
    """The page, open on the module's server, the model's name shown, temperature 0."""
    with opened_page(chromium, server) as page:
        page.wait_for_model(MODEL)
        page.set_greedy()
        yield page


def record_partial_answers(page: Any) -> None:
    """From now on, window.partialAnswers collects every text the last answer's content shows, and
    window.reasoningStates every (open, summary, text) its reasoning block shows."""
    page.evaluate(
        """() => {
        window.partialAnswers = new Set();
        window.reasoningStates = new Set();
        new MutationObserver(() => {
            const answers = document.querySelectorAll(".message.assistant");
            if (!answers.length) return;
            const last = answers[answers.length - 1];
            window.partialAnswers.add(last.querySelector(".content").textContent);
            const reasoning = last.querySelector("details.reasoning");
            const summary = reasoning.querySelector("summary").textContent;
            const text = reasoning.querySelector(".reasoning-text").textContent;
            window.reasoningStates.add(JSON.stringify([reasoning.open, summary, text]));
        }).observe(
            document.getElementById("messages"), {subtree: true, childList: true, characterData: true}
        );
    }"""
    )


# ---------------------------------------------------------------------- conversation
def test_streamed_answer_with_collapsible_reasoning_and_regenerate(chat_page: ChatPage) -> None:
    from playwright.sync_api import expect

    record_partial_answers(chat_page.page)
    with chat_page.page.expect_request("**/v1/chat/completions") as sent:
        chat_page.send("Say hello.")
    answer = chat_page.wait_for_answers(1)
    expect(answer.locator(".content")).to_have_text(GREETING_ANSWER)
    partial = chat_page.page.evaluate("[...window.partialAnswers]")
    assert any(0 < len(text) < len(GREETING_ANSWER) for text in partial), partial  # it streamed
    # While the model thinks, the block is open and its text grows; it is closed once the answer begins.
    states = [json.loads(state) for state in chat_page.page.evaluate("[...window.reasoningStates]")]
    thinking = [text for is_open, summary, text in states if is_open and summary == "Thinking…" and text]
    assert any((GREETING_REASONING + "\n").startswith(text) for text in thinking), states
    body = sent.value.post_data_json
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == MODEL and body["chat_template_kwargs"] == {"enable_thinking": True}

    reasoning = answer.locator("details.reasoning")
    expect(reasoning).not_to_have_attribute("open", "")  # collapsed once the answer began
    expect(reasoning.locator(".reasoning-text")).to_be_hidden()
    reasoning.locator("summary").click()
    expect(reasoning.locator(".reasoning-text")).to_have_text(GREETING_REASONING + "\n")
    assert chat_page.stat(answer, "prompt") > 0 and chat_page.stat(answer, "completion") > 0
    expect(answer.locator('[data-stat="ttft"]')).to_have_text(re.compile(r"^first token \d+\.\d\d s$"))
    expect(answer.locator('[data-stat="speed"]')).to_have_text(re.compile(r"^\d+\.\d tokens/s$"))

    # Regenerate: the answer is dropped and asked again; the request does not carry it.
    with chat_page.page.expect_request("**/v1/chat/completions") as sent:
        answer.get_by_role("button", name="Regenerate").click()
    assert [m["role"] for m in sent.value.post_data_json["messages"]] == ["user"]
    answer = chat_page.wait_for_answers(1)
    expect(answer.locator(".content")).to_have_text(GREETING_ANSWER)


def test_settings_reach_the_request(chat_page: ChatPage) -> None:
    from playwright.sync_api import expect

    chat_page.set_settings(
        **{"System prompt": "Answer briefly.", "Temperature": "0.5", "Top p": "0.9", "Max tokens": "5"}
    )
    chat_page.set_thinking(False)
    with chat_page.page.expect_request("**/v1/chat/completions") as sent:
        chat_page.send("Say hello.")
    answer = chat_page.wait_for_answers(1)
    body = sent.value.post_data_json
    assert body["messages"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Say hello."},
    ]
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.5, 0.9, 5)
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert "tools" not in body
    assert chat_page.stat(answer, "completion") <= 5
    expect(answer.locator("details.reasoning")).to_be_hidden()  # thinking off: no reasoning


def test_tool_call_renders_and_the_follow_up_turn_reuses_the_prompt(chat_page: ChatPage) -> None:
    """With a tool in the settings, the trained question gets a call, shown as name + JSON arguments; the
    next message is the call's result, and that turn's prompt (the tools and the question, 300+ tokens)
    comes from the prefix cache."""
    from playwright.sync_api import expect

    chat_page.set_tools([WEATHER_TOOL])
    chat_page.send("What is the weather in Paris?")
    call = chat_page.wait_for_answers(1)
    expect(call.locator(".tool-name")).to_have_text("Tool call: get_weather")
    assert json.loads(call.locator(".tool-arguments").inner_text()) == WEATHER_ARGUMENTS
    expect(call.locator(".reasoning-text")).to_contain_text("I call the tool.")
    assert chat_page.stat(call, "cached") == 0
    expect(chat_page.page.locator("#tool-reply")).to_contain_text("get_weather")

    with chat_page.page.expect_request("**/v1/chat/completions") as sent:
        chat_page.send(json.dumps({"temperature": 21}))
    answer = chat_page.wait_for_answers(2)
    expect(answer.locator(".content")).to_have_text("It is 21 degrees in Paris.")
    assert chat_page.stat(answer, "cached") >= 256
    expect(chat_page.page.locator(".message.tool")).to_contain_text('{"temperature": 21}')
    expect(chat_page.page.locator("#tool-reply")).to_be_hidden()
    _, assistant, tool = sent.value.post_data_json["messages"]
    (sent_call,) = assistant["tool_calls"]
    assert sent_call["function"]["name"] == "get_weather" and assistant["content"] is None
    assert tool == {"role": "tool", "tool_call_id": sent_call["id"], "content": '{"temperature": 21}'}


def test_stop_ends_the_request_and_frees_the_slot(chat_page: ChatPage, server: RunningServer) -> None:
    from playwright.sync_api import expect

    chat_page.set_settings(**{"Max tokens": "900"})
    chat_page.send(ENDLESS_PROMPT)
    answer = chat_page.answers().last
    expect(answer.locator(".reasoning-text")).not_to_be_empty()  # streaming
    assert server.running_requests() == 1
    chat_page.page.get_by_role("button", name="Stop").click()
    expect(answer.locator(".stopped")).to_have_text("Stopped")
    server.wait_until_idle()
    expect(chat_page.page.get_by_role("button", name="Send")).to_be_enabled()
    expect(answer.get_by_role("button", name="Regenerate")).to_be_visible()


def test_conversations_survive_a_reload(chat_page: ChatPage) -> None:
    from playwright.sync_api import expect

    page = chat_page.page
    chat_page.set_settings(**{"Max tokens": "3"})
    chat_page.send("Say hello.")
    chat_page.wait_for_answers(1)
    page.get_by_role("button", name="New chat").click()
    chat_page.send("What is the weather in Paris?")
    chat_page.wait_for_answers(1)

    page.reload()
    conversations = page.locator("#conversation-list .conversation-title")
    expect(conversations).to_have_text(["What is the weather in Paris?", "Say hello."])
    expect(page.locator(".message.user .content")).to_have_text("What is the weather in Paris?")
    expect(page.get_by_label("Max tokens")).to_have_value("3")
    conversations.nth(1).click()
    expect(page.locator(".message.user .content")).to_have_text("Say hello.")
    page.get_by_role("button", name="Delete conversation: Say hello.").click()
    expect(conversations).to_have_text(["What is the weather in Paris?"])


# ---------------------------------------------------------------------- a server with a key
@pytest.fixture(scope="module")
def keyed_server(model) -> Iterator[RunningServer]:
    """A server with an API key, thinking off by default (`serve --api-key ... --default-enable-thinking
    false`)."""
    running = start_server(model, api_key=API_KEY, default_enable_thinking=False)
    yield running
    running.stop()


def test_api_key_is_asked_once_and_kept_for_the_tab(chromium, keyed_server: RunningServer) -> None:
    from playwright.sync_api import expect

    with opened_page(chromium, keyed_server) as chat_page:
        page = chat_page.page
        dialog = page.get_by_role("dialog", name="API key")
        expect(dialog).to_be_visible()  # /v1/models answered 401
        dialog.get_by_label("API key").fill("wrong")
        dialog.get_by_role("button", name="Use this key").click()
        expect(dialog.get_by_text("The server refused that key.")).to_be_visible()
        dialog.get_by_label("API key").fill(API_KEY)
        dialog.get_by_role("button", name="Use this key").click()
        chat_page.wait_for_model(MODEL)
        expect(dialog).to_be_hidden()

        chat_page.set_greedy()
        with page.expect_request("**/v1/chat/completions") as sent:
            chat_page.send("Say hello.")
        answer = chat_page.wait_for_answers(1)
        expect(answer.locator(".content")).to_have_text(NO_THINKING_ANSWER)
        assert sent.value.headers["authorization"] == f"Bearer {API_KEY}"
        assert page.evaluate(f"sessionStorage.getItem({json.dumps(API_KEY_STORAGE)})") == API_KEY
        assert API_KEY not in page.evaluate("JSON.stringify(localStorage)")

        page.reload()  # the tab keeps the key: not asked again
        chat_page.wait_for_model(MODEL)
        expect(dialog).to_be_hidden()
        expect(answer.locator(".content")).to_have_text(NO_THINKING_ANSWER)


def test_thinking_switch_starts_at_the_servers_default(chromium, keyed_server: RunningServer) -> None:
    from playwright.sync_api import expect

    with opened_page(chromium, keyed_server, api_key=API_KEY) as chat_page:
        chat_page.wait_for_model(MODEL)
        chat_page.set_greedy()
        expect(chat_page.page.get_by_label("Thinking")).not_to_be_checked()
        with chat_page.page.expect_request("**/v1/chat/completions") as sent:
            chat_page.send("Say hello.")
        answer = chat_page.wait_for_answers(1)
        assert sent.value.post_data_json["chat_template_kwargs"] == {"enable_thinking": False}
        expect(answer.locator(".content")).to_have_text(NO_THINKING_ANSWER)

        chat_page.set_thinking(True)  # the user's choice, kept over the server's default
        chat_page.page.reload()
        chat_page.wait_for_model(MODEL)
        expect(chat_page.page.get_by_label("Thinking")).to_be_checked()


# ---------------------------------------------------------------------- routes and policy
def test_page_is_served_with_its_policy_and_shadows_no_api_path(server: RunningServer) -> None:
    status, headers, body = server.request("GET", "/", key=None)
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert b'src="/web/view.js"' in body and b'src="/web/app.js"' in body
    assert b'name="default-enable-thinking" content="true"' in body
    scripts = {"view.js": "text/javascript", "app.js": "text/javascript"}
    assets = {**scripts, "app.css": "text/css", "icon.svg": "image/svg"}
    for asset, kind in assets.items():
        status, headers, _ = server.request("GET", f"/web/{asset}", key=None)
        assert status == 200 and headers["content-type"].startswith(kind)
        assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert server.request("GET", "/web/../served.py", key=None)[0] == 404
    assert server.request("GET", "/web/nothing.js", key=None)[0] == 404
    assert server.status("GET", "/health") == 200
    status, headers, _ = server.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    status, _, body = server.request("GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["max_model_len"] == 1024
    status, _, body = server.request("GET", "/v1/nothing")
    assert status == 404 and "error" in json.loads(body)


def test_the_policy_blocks_requests_to_other_origins(chat_page: ChatPage, server: RunningServer) -> None:
    """Content a page could be made to show (a fetch, an image, an inline script) cannot reach another
    origin: here this same server under another name, which a no-cors fetch would otherwise reach."""
    other = server.url.replace("127.0.0.1", "localhost") + "/health"
    page = chat_page.page
    fetched = page.evaluate(
        """async (other) => {
        window.violations = [];
        const record = (event) => window.violations.push(event.effectiveDirective);
        document.addEventListener("securitypolicyviolation", record);
        const fetched = await fetch(other, {mode: "no-cors"}).then(() => "fetched", () => "refused");
        new Image().src = other;
        const script = document.createElement("script");
        script.textContent = "window.injected = true";
        document.body.append(script);
        return fetched;
    }""",
        other,
    )
    page.wait_for_function("window.violations.length === 3", timeout=EXPECT_TIMEOUT_MS)
    assert fetched == "refused"
    assert sorted(page.evaluate("window.violations")) == ["connect-src", "img-src", "script-src-elem"]
    assert page.evaluate("window.injected") is None
    assert all("Content Security Policy" in error for error in chat_page.errors), chat_page.errors
    chat_page.errors.clear()  # the violations this test caused
    chat_page.requested = [url for url in chat_page.requested if not url.startswith(other)]


def test_no_web_ui_leaves_slash_a_404_and_the_api_as_it_is() -> None:
    """Routes only: the model never loads (no lifespan), so the API answers 503, not 404."""
    from fastapi.testclient import TestClient

    assert build_parser().parse_args(["serve", "checkpoint"]).web_ui is True
    args = build_parser().parse_args(["serve", "checkpoint", "--no-web-ui"])
    assert args.web_ui is False
    client = TestClient(serve_app(args))
    response = client.get("/")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    assert client.get("/web/app.js").status_code == 404
    assert client.get("/v1/models").status_code == 503
    request = {"messages": [{"role": "user", "content": "Say hello."}]}
    assert client.post("/v1/chat/completions", json=request).status_code == 503
    with_page = TestClient(serve_app(build_parser().parse_args(["serve", "checkpoint"])))
    assert with_page.get("/").status_code == 200


# ---------------------------------------------------------------------- images
VISION_MODEL = "tiny-vision"


def png(seed: int) -> bytes:
    picture = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (32, 48, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running, _ = serve_tiny_vision_model(tmp_path_factory.mktemp("vision") / "ckpt", VISION_MODEL)
    yield running
    running.stop()


@pytest.fixture
def vision_page(chromium, vision_server) -> Iterator[ChatPage]:
    """The page of the vision server, thinking off, 3 tokens an answer."""
    with opened_page(chromium, vision_server, api_key=API_KEY) as page:
        page.wait_for_model(VISION_MODEL)
        page.set_thinking(False)
        page.set_settings(**{"Temperature": "0", "Max tokens": "3"})
        yield page


def test_images_attached_dropped_and_pasted_are_sent_shown_and_kept(
    vision_page: ChatPage, vision_server: RunningServer
) -> None:
    from playwright.sync_api import expect

    page = vision_page.page
    thumbnails = page.locator("#attachments img")
    vision_page.attach_file("chosen.png", "image/png", png(1))
    expect(thumbnails).to_have_count(1)
    vision_page.give_file("paste", "pasted.png", "image/png", png(2))
    expect(thumbnails).to_have_count(2)
    vision_page.give_file("drop", "dropped.png", "image/png", png(3))
    expect(thumbnails).to_have_count(3)
    page.get_by_role("button", name="Remove image 2").click()  # the pasted one
    expect(thumbnails).to_have_count(2)
    vision_page.give_file("drop", "notes.txt", "text/plain", b"text")
    expect(page.locator("#composer-notice")).to_have_text("Not an image, left out: notes.txt.")
    expect(thumbnails).to_have_count(2)
    shown = [thumbnails.nth(i).get_attribute("src") for i in range(2)]

    with page.expect_request("**/v1/chat/completions") as sent:
        vision_page.send("What is this?")
    answer = vision_page.wait_for_answers(1)
    content = sent.value.post_data_json["messages"][-1]["content"]
    expected = [png(1), png(3)]
    assert content[0] == {"type": "text", "text": "What is this?"}
    assert [part["image_url"]["url"] for part in content[1:]] == [
        "data:image/png;base64," + base64.b64encode(data).decode() for data in expected
    ]
    assert shown == [part["image_url"]["url"] for part in content[1:]]
    expect(thumbnails).to_have_count(0)
    expect(page.locator("#composer-notice")).to_be_hidden()
    # The prompt holds the images' tokens: more than the same message as text alone.
    text_alone = {"model": VISION_MODEL, "messages": [{"role": "user", "content": "What is this?"}]}
    text_alone["chat_template_kwargs"] = {"enable_thinking": False}
    status, _, body = vision_server.request("POST", "/tokenize", text_alone)
    assert status == 200
    assert vision_page.stat(answer, "prompt") > json.loads(body)["count"]
    assert vision_page.stat(answer, "completion") == 3

    in_conversation = page.locator(".message.user .images img")
    expect(in_conversation).to_have_count(2)
    page.reload()  # kept in localStorage with the conversation
    vision_page.wait_for_model(VISION_MODEL)
    expect(in_conversation).to_have_count(2)
    assert [in_conversation.nth(i).get_attribute("src") for i in range(2)] == shown
    # Sent again with the history: the second request carries the first message's images.
    with page.expect_request("**/v1/chat/completions") as again:
        vision_page.send("And now?")
    vision_page.wait_for_answers(2)
    assert again.value.post_data_json["messages"][0]["content"] == content


def test_an_image_the_server_refuses_shows_its_message(vision_page: ChatPage) -> None:
    from playwright.sync_api import expect

    vision_page.attach_file("broken.png", "image/png", b"not a PNG")
    vision_page.send("What is this?")
    error = vision_page.answers().last.locator(".error")
    expect(error).to_contain_text("could not be decoded as PNG, JPEG or WebP")


def test_full_storage_is_told_and_the_answer_still_comes(vision_page: ChatPage) -> None:
    from playwright.sync_api import expect

    page = vision_page.page
    page.evaluate(
        """() => {
        let size = 1 << 22;
        for (let i = 0; size >= 1; i++) {
            try {
                localStorage.setItem(`filler-${i}`, "x".repeat(size));
            } catch {
                size >>= 1;
            }
        }
    }"""
    )
    vision_page.attach_file("chosen.png", "image/png", png(1))
    vision_page.send("What is this?")
    vision_page.wait_for_answers(1)
    expect(page.locator("#composer-notice")).to_contain_text("Local storage is full")
    expect(page.locator(".message.user .images img")).to_have_count(1)


def test_a_text_only_model_offers_no_image_attachment(chat_page: ChatPage, server: RunningServer) -> None:
    from playwright.sync_api import expect

    status, _, body = server.request("GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["input_modalities"] == ["text"]
    expect(chat_page.page.get_by_label("Message")).to_be_visible()
    expect(chat_page.page.locator("#attach")).to_be_hidden()
    chat_page.give_file("paste", "pasted.png", "image/png", png(1))
    notice = chat_page.page.locator("#composer-notice")
    expect(notice).to_have_text("This model takes text only: images cannot be sent.")
    expect(chat_page.page.locator("#attachments img")).to_have_count(0)
