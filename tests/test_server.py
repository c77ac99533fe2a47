"""The OpenAI-compatible server, for real: uvicorn on 127.0.0.1 at a free port, the official `openai`
client, and a tiny model trained (tests/chat_model.py) to answer known prompts with reasoning, tool calls
and JSON, so every parsed field is compared with text the model is known to write."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Literal

import openai
import pydantic
import pytest
import torch
from chat_model import (
    CONVERSATIONS,
    GREETING,
    PERSON,
    TOOL_RESULT,
    WEATHER_ARGUMENTS,
    WEATHER_QUESTION,
    WEATHER_TOOL,
    cached_chat_checkpoint,
)
from helpers import free_port
from prometheus_client.parser import text_string_to_metric_families
from running_server import API_KEY, RunningServer
from transformers import AutoModelForCausalLM

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.server import ServerSettings, build_app, served_model
from optimum_qwen36.server.schemas import ChatCompletionChunk

MODEL = "tiny-chat"
SLOTS = 4
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return cached_chat_checkpoint()


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> NeuronQwen36ForCausalLM:
    settings = dict(batch_size=SLOTS, sequence_length=1024, prefill_chunk_size=64, prefix_caching=True)
    return NeuronQwen36ForCausalLM.from_pretrained(checkpoint, export=True, backend="eager", **settings)


@pytest.fixture(scope="module")
def server(model):
    settings = ServerSettings(MODEL, api_key=API_KEY, max_waiting_requests=32, max_stored_responses=4)
    running = RunningServer(build_app(lambda: served_model(model), settings))
    running.wait_healthy()
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def every_request_ends(request):
    """After each test, however its requests ended, none still runs or holds the server's capacity."""
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_until_idle()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def chat(client: openai.OpenAI, messages: list, **kwargs: Any):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def stream_chat(client: openai.OpenAI, messages: list, **kwargs: Any) -> tuple[dict, list]:
    """Deltas of a streamed chat, joined: {reasoning, content, finish_reason, tool_calls}; and the chunks."""
    chunks = list(chat(client, messages, stream=True, **kwargs))
    joined: dict[str, Any] = {"reasoning": "", "content": "", "finish_reason": None, "tool_calls": []}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            joined["reasoning"] += getattr(delta, "reasoning", None) or ""
            joined["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    joined["tool_calls"].append({"id": call.id, "name": call.function.name, "arguments": ""})
                joined["tool_calls"][call.index]["arguments"] += call.function.arguments or ""
            joined["finish_reason"] = choice.finish_reason or joined["finish_reason"]
    return joined, chunks


# ---------------------------------------------------------------------- chat
def test_chat_thinking_splits_reasoning_from_content(client) -> None:
    response = chat(client, GREETING)
    message = response.choices[0].message
    assert message.reasoning == message.reasoning_content == "The user greets me.\n"
    assert message.content == "Hello! How can I help you today?"
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == response.usage.total_tokens - response.usage.prompt_tokens


def test_chat_thinking_off(client) -> None:
    message = chat(client, GREETING, extra_body=NO_THINKING).choices[0].message
    assert message.content == CONVERSATIONS["no_thinking"].answer
    assert message.reasoning is None


def test_chat_stream_equals_non_streaming(client) -> None:
    whole = chat(client, GREETING)
    joined, chunks = stream_chat(client, GREETING, stream_options={"include_usage": True})
    assert joined["reasoning"] == whole.choices[0].message.reasoning == "The user greets me.\n"
    assert joined["content"] == whole.choices[0].message.content == "Hello! How can I help you today?"
    assert joined["finish_reason"] == whole.choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    # Reasoning deltas all come before the first content delta.
    kinds = [("r" if getattr(c.choices[0].delta, "reasoning", None) else "c") for c in chunks[1:-2]]
    assert "".join(kinds) == "".join(sorted(kinds, reverse=True))


def test_tool_round_trip(client) -> None:
    response = chat(client, WEATHER_QUESTION, tools=[WEATHER_TOOL])
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning == "The user wants the forecast: I call the tool.\n"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == WEATHER_ARGUMENTS
    history = [
        *WEATHER_QUESTION,
        choice.message.model_dump(include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    answer = chat(client, history, tools=[WEATHER_TOOL]).choices[0]
    assert answer.message.content == "It is 21 degrees in Paris."
    assert answer.finish_reason == "stop" and not answer.message.tool_calls


def test_streamed_tool_call_deltas(client) -> None:
    joined, chunks = stream_chat(client, WEATHER_QUESTION, tools=[WEATHER_TOOL])
    assert joined["finish_reason"] == "tool_calls" and joined["content"] == ""
    (call,) = joined["tool_calls"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == WEATHER_ARGUMENTS
    fragments = [c for chunk in chunks for ch in chunk.choices for c in ch.delta.tool_calls or []]
    assert len(fragments) >= 3  # the header, then one fragment per parameter (and the closing brace)


def test_tool_choice_none_and_named(client) -> None:
    # The trained answer is a call; with tool_choice none it stays text (and the tools are not shown).
    none = chat(client, WEATHER_QUESTION, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=16).choices[0]
    assert not none.message.tool_calls and none.finish_reason == "length"
    assert isinstance(none.message.content, str)
    named = {"type": "function", "function": {"name": "get_weather"}}
    same = chat(client, WEATHER_QUESTION, tools=[WEATHER_TOOL], tool_choice=named).choices[0]
    assert json.loads(same.message.tool_calls[0].function.arguments) == WEATHER_ARGUMENTS
    # The model answers the greeting with text: the named choice makes it call the function.
    forced = chat(
        client, GREETING, tools=[WEATHER_TOOL], tool_choice=named, max_tokens=48, extra_body=NO_THINKING
    ).choices[0]
    assert forced.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(forced.message.tool_calls[0].function.arguments), dict)


def test_tool_choice_required_forces_a_call(client) -> None:
    # The model answers this prompt with a greeting; the grammar makes it a call instead.
    choice = chat(
        client, GREETING, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=48, extra_body=NO_THINKING
    ).choices[0]
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments), dict)


MOOD_TOOL = {
    "type": "function",
    "function": {
        "name": "report_mood",
        "parameters": {
            "type": "object",
            "properties": {"mood": {"enum": ["happy", "sad"]}, "sure": {"type": "boolean"}},
            "required": ["mood", "sure"],
        },
    },
}


def forced(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_tool_calls_follow_the_schema(client, tool_choice: str) -> None:
    """The model answers the greeting with text; forced, it calls the tool with every required parameter
    typed as the schema says (a grammar over the template's <parameter=...> format)."""
    tools = [MOOD_TOOL] if tool_choice == "required" else [WEATHER_TOOL, MOOD_TOOL]
    choice = tool_choice if tool_choice == "required" else forced("report_mood")
    answer = chat(client, GREETING, tools=tools, tool_choice=choice, max_tokens=64, extra_body=NO_THINKING)
    assert answer.choices[0].finish_reason == "tool_calls"
    (call,) = answer.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "report_mood" and set(arguments) == {"mood", "sure"}
    assert arguments["mood"] in ("happy", "sad") and isinstance(arguments["sure"], bool)


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_tool_calls_come_after_the_reasoning(client, tool_choice: str) -> None:
    """With thinking on, the grammar starts after </think>: the reasoning is the model's own."""
    choice = tool_choice if tool_choice == "required" else forced("get_weather")
    answer = chat(client, WEATHER_QUESTION, tools=[WEATHER_TOOL], tool_choice=choice).choices[0]
    assert answer.message.reasoning == "The user wants the forecast: I call the tool.\n"
    (call,) = answer.message.tool_calls
    assert json.loads(call.function.arguments) == WEATHER_ARGUMENTS and answer.finish_reason == "tool_calls"


def test_a_forced_call_never_ends_inside_the_reasoning(client, model) -> None:
    """With thinking on, a forced call comes after the reasoning or the answer ends by length: the tokens
    that would end it (here pushed by logit_bias) are held back until </think>."""
    tokenizer = served_tokenizer(model)
    ends = {str(tokenizer.convert_tokens_to_ids(t)): 100 for t in ("<|im_end|>", "<|endoftext|>")}
    free = chat(client, GREETING, tools=[MOOD_TOOL], logit_bias=ends, max_tokens=8).choices[0]
    assert free.finish_reason == "stop" and free.message.reasoning is None  # it ends at once
    for choice in ("required", forced("report_mood")):
        answer = chat(client, GREETING, tools=[MOOD_TOOL], tool_choice=choice, logit_bias=ends, max_tokens=8)
        assert answer.choices[0].finish_reason == "length" and not answer.choices[0].message.tool_calls
    # response_format too: its JSON comes, or the answer ends by length
    json_object = chat(
        client, GREETING, response_format={"type": "json_object"}, logit_bias=ends, max_tokens=8
    )
    assert json_object.choices[0].finish_reason == "length"


def test_stop_string_spanning_tokens_is_never_emitted(client, model) -> None:
    stop = "nice to"
    assert len(served_tokenizer(model).encode(" " + stop, add_special_tokens=False)) > 1
    message = chat(client, GREETING, stop=[stop], extra_body=NO_THINKING).choices[0].message
    assert message.content == "Hello there, "
    joined, _ = stream_chat(client, GREETING, stop=[stop], extra_body=NO_THINKING)
    assert joined["content"] == "Hello there, " and joined["finish_reason"] == "stop"


def served_tokenizer(model):
    from optimum_qwen36.tokenizer import load_qwen36_tokenizer

    return load_qwen36_tokenizer(model.tokenizer_dir)


def test_json_schema_output_validates(client) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    message = chat(client, PERSON, response_format=response_format, extra_body=NO_THINKING).choices[0].message
    value = json.loads(message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int) and isinstance(value["name"], str)
    # An untrained prompt, forced into the schema too (thinking on: the grammar starts after </think>).
    forced = chat(client, GREETING, response_format={"type": "json_object"}, max_tokens=64).choices[0]
    assert forced.message.reasoning == "The user greets me.\n"
    if forced.finish_reason == "stop":
        assert isinstance(json.loads(forced.message.content), dict)
    else:
        assert forced.message.content.startswith("{")


def test_n_and_seed(client) -> None:
    def sample(n: int, seed: int) -> list[str]:
        response = client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=8, temperature=1.0, n=n, seed=seed
        )
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]

    two = sample(2, seed=11)
    assert len(two) == 2 and two == sample(2, seed=11)
    assert two[0] == sample(1, seed=11)[0] and two[1] == sample(1, seed=12)[0]  # choice i draws with seed + i
    assert sample(1, seed=13) != sample(1, seed=11) or sample(1, seed=14) != sample(1, seed=11)


def test_logit_bias_steers_the_tokens(client, model) -> None:
    # +100 on the ids of a few one-token words: the greedy completion is made of those words only.
    tokenizer = served_tokenizer(model)
    words = [w for w in ("hello", "weather", "the", "and", "is", "to", "of") if
             len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1][:3]  # fmt: skip
    assert len(words) >= 2
    bias = {str(tokenizer.encode(" " + w, add_special_tokens=False)[0]): 100 for w in words}
    response = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=6,
        temperature=0,
        logit_bias=bias,
        extra_body={"ignore_eos": True},
    )
    assert response.usage.completion_tokens == 6 and set(response.choices[0].text.split()) <= set(words)


def test_completions_logprobs_and_echo(client) -> None:
    response = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    choice = response.choices[0]
    # Every generated token (5, or fewer up to an <|im_end|>: this prompt's logits are nearly flat, so where
    # EOS comes can change with the thread count), the EOS too; its text is not part of the completion.
    generated = response.usage.completion_tokens
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == generated
    assert generated == 5 or (choice.finish_reason == "stop" and choice.logprobs.tokens[-1] == "<|im_end|>")
    text_tokens = choice.logprobs.tokens[:-1] if choice.finish_reason == "stop" else choice.logprobs.tokens
    assert "".join(text_tokens) == choice.text
    for token, logprob, top in zip(
        choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen token is the most likely
        assert top[token] == pytest.approx(logprob)
    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello" + choice.text


def test_completions_echo_scores_the_prompt(client, checkpoint: Path) -> None:
    """echo + logprobs (how lm-evaluation-harness asks for a text's log-likelihood): one entry per prompt
    token, the first without a log-probability, then the generated token's; streamed, the echo comes first
    with the same values. The model serves bf16: against transformers in float32, within bf16's error (the
    float32 engine is held to 1e-4 in tests/test_engine.py and tests/test_export_cpu.py)."""
    prompt = list(range(2100, 2190))  # two prefill chunks, tokens no other test sends
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=2, echo=True
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(prompt) + 1 and response.usage.prompt_tokens_details.cached_tokens == 0
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset[0] == 0 and response.choices[0].text.startswith(logprobs.tokens[0])
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    chosen = expected.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(
        torch.tensor(logprobs.token_logprobs[1 : len(prompt)]), chosen, atol=0.05, rtol=0.02
    )
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=2, echo=True, stream=True
        )
    )
    echoed = chunks[0].choices[0]
    assert echoed.logprobs.token_logprobs == logprobs.token_logprobs[: len(prompt)]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == response.choices[0].text


def test_chat_logprobs(client) -> None:
    response = chat(client, GREETING, logprobs=True, top_logprobs=2, extra_body=NO_THINKING)
    content = response.choices[0].logprobs.content
    # Every generated token, the <|im_end|> that ended the answer too (its text is not in the content).
    assert content[-1].token == "<|im_end|>"
    assert "".join(entry.token for entry in content[:-1]) == response.choices[0].message.content
    assert all(len(entry.top_logprobs) == 2 for entry in content)


def test_cached_tokens_on_a_repeated_prefix(client) -> None:
    prompt = list(range(1000, 1300))  # 300 tokens no other test sends
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 256
    assert second.choices[0].text == first.choices[0].text


def test_the_next_chat_turn_reuses_the_history_even_where_the_prompt_end_checkpoint_cannot(
    client, model
) -> None:
    """The next turn renders the history again but not this turn's generation prompt (its empty think block
    goes): with the first prompt sized so that its last multiple of 64 lies inside the generation prompt,
    only the checkpoint at the history's end (the server passes it as the prompt's reusable prefix) serves
    the next turn."""
    from optimum_qwen36.server.chat import encode_chat

    tokenizer = served_tokenizer(model)
    for words in range(40, 200):
        messages = [{"role": "user", "content": "quartz meadow " * words}]
        first = encode_chat(tokenizer, messages, [], {"enable_thinking": False})
        if (len(first.token_ids) - 1) // 64 * 64 > first.history + 3:  # the next turn diverges at +3
            break
    answer = chat(client, messages, max_tokens=4, extra_body=NO_THINKING)
    assert answer.usage.prompt_tokens == len(first.token_ids)
    messages += [{"role": "assistant", "content": answer.choices[0].message.content}]
    messages += [{"role": "user", "content": "And then?"}]
    follow_up = chat(client, messages, max_tokens=4, extra_body=NO_THINKING)
    assert follow_up.usage.prompt_tokens_details.cached_tokens == first.history // 64 * 64 > 0


def test_with_preserve_thinking_the_next_turn_reuses_the_answer(client, model) -> None:
    """Qwen3.6's preserve_thinking renders the history's (empty) think block as the generation prompt held
    it, so the next turn's prompt continues the tokens this turn computed: its cached tokens reach the
    answer's last fed token (the finished request left its partial last block and its state there), where
    the answer re-tokenizes to the tokens generated (digits here, forced by logit_bias; a real model's text
    does too)."""
    tokenizer = served_tokenizer(model)
    digits = {str(tokenizer.convert_tokens_to_ids(str(d))): 100 for d in range(10)}
    template = {"enable_thinking": False, "preserve_thinking": True}
    extra = {"chat_template_kwargs": template, "ignore_eos": True}
    messages = [{"role": "user", "content": "harbor violet " * 30}]
    answer = chat(client, messages, max_tokens=80, logit_bias=digits, extra_body=extra)
    content = answer.choices[0].message.content
    assert content.isdigit() and answer.usage.completion_tokens == 80
    computed = answer.usage.prompt_tokens + 80 - 1  # the last token is sampled, never fed
    messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "More?"}]
    follow_up = chat(client, messages, max_tokens=2, extra_body=extra)
    cached = follow_up.usage.prompt_tokens_details.cached_tokens
    assert cached == computed and computed % 64  # not a checkpoint position: only the tail ends there


def test_concurrent_streaming_clients_match_their_solo_outputs(client) -> None:
    prompts = [[3000 + 37 * i + j for j in range(5 + 23 * i)] for i in range(16)]

    def complete(prompt: list[int], stream: bool) -> str:
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        if not stream:
            return client.completions.create(**kwargs).choices[0].text
        return "".join(
            c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices
        )

    solo = [complete(p, stream=False) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: complete(p, stream=True), prompts))
    assert together == solo


def test_client_disconnect_frees_its_slot(server) -> None:
    body = json.dumps(
        {"model": MODEL, "prompt": "Hello", "max_tokens": 900, "stream": True, "ignore_eos": True}
    )
    connection = socket.create_connection(server.socket.getsockname())
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    )
    connection.sendall(request.encode())
    received = b""
    while received.count(b"data:") < 3:
        received += connection.recv(4096)
    assert server.running_requests() == 1
    connection.close()
    server.wait_until_idle()


def test_a_request_whose_first_output_is_its_last_frees_its_capacity(server, client) -> None:
    """One token: the engine's first output ends the request, collected or streamed, in every API."""
    state = server.app.state.server
    for stream in (False, True):
        answers = [
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, stream=stream),
            chat(client, GREETING, max_tokens=1, stream=stream, extra_body=NO_THINKING),
            client.responses.create(model=MODEL, input="Hello", max_output_tokens=1, stream=stream),
        ]
        if stream:
            answers = [list(events) for events in answers]
        deadline = time.monotonic() + 2  # the end is noted as the response is sent, not on a timer
        while state.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state.in_flight == 0, f"stream={stream}"


@pytest.mark.parametrize("stream", [False, True])
def test_client_that_leaves_early_frees_its_slots(server, stream: bool) -> None:
    """n=2, the client hangs up right after sending (before any token, or while the response is
    computed): both choices are aborted."""
    body = {"model": MODEL, "prompt": [5] * 600, "max_tokens": 300, "n": 2, "ignore_eos": True}
    payload = json.dumps({**body, "stream": stream})
    connection = socket.create_connection(server.socket.getsockname())
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n{payload}"
    )
    connection.sendall(request.encode())
    time.sleep(0.3)
    connection.close()
    server.wait_until_idle()


def test_metrics_parse(server, client) -> None:
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    status, headers, body = server.request("GET", "/metrics", key=None)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    families = {family.name: family for family in text_string_to_metric_families(body.decode())}
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "gdn_slots",
        "kv_cache_usage_perc",
        "num_preemptions",
        "prefix_cache_hit_tokens",
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
    ):
        assert "optimum_qwen36:" + name in families, name
    slots = families["optimum_qwen36:gdn_slots"].samples[0].value
    assert slots == SLOTS
    success = sum(
        s.value for s in families["optimum_qwen36:request_success"].samples if s.name.endswith("_total")
    )
    assert success >= 1


def test_metrics_under_vllm_names_agree_with_ours(server, client) -> None:
    """Routers and llm-d's endpoint picker read vLLM's metric names: the same values under both."""
    prompt = list(range(6000, 6130))
    for _ in range(2):  # the second is a prefix-cache hit
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    text = server.request("GET", "/metrics")[2].decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    values = {sample.name: sample.value for family in families.values() for sample in family.samples}
    ours, vllm = "optimum_qwen36:", "vllm:"
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert values[vllm + name] == values[ours + name], name
    assert values["vllm:prefix_cache_queries_total"] == values[ours + "prefix_cache_queried_tokens"]
    assert values["vllm:prefix_cache_hits_total"] == values[ours + "prefix_cache_hit_tokens"] >= 128
    for name in ("prompt_tokens_total", "generation_tokens_total", "e2e_request_latency_seconds_count"):
        assert values[vllm + name] == values[ours + name] > 0, name
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels["block_size"] == "64"
    assert int(info.labels["num_gpu_blocks"]) == values[ours + "kv_blocks"]
    assert families["vllm:prefix_cache_hits"].type == "counter"


def test_what_routers_read_of_a_replica(server) -> None:
    """SGLang's /model_info and /server_info (and their /get_ names: sglang-router learns the model's name
    from them), /get_load (its power_of_two policy), without the API key as /health."""
    for path in ("/model_info", "/get_model_info"):
        status, _, body = server.request("GET", path, key=None)
        info = json.loads(body)
        assert status == 200 and info["model_path"] == MODEL and info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        status, _, body = server.request("GET", path, key=None)
        info = json.loads(body)
        assert status == 200 and info["served_model_name"] == info["model_id"] == MODEL
        assert info["kv_block_size"] == 64 and info["max_running_requests"] == SLOTS and info["dp_size"] == 1
    status, _, body = server.request("GET", "/get_load", key=None)
    (load,) = json.loads(body)
    assert status == 200 and load["dp_rank"] == 0 and load["num_reqs"] == load["num_waiting_reqs"] == 0
    assert load["num_tokens"] == 0
    status, _, body = server.request("GET", "/kv_event_sources", key=None)
    assert status == 200 and json.loads(body) == {}  # this server publishes no KV events


def test_kv_events_announce_what_the_replica_can_reuse(model) -> None:
    """--kv-events-config: the prefix cache's stored prefixes go out in vLLM's wire format (ZMQ, msgpack
    array batches of "type"-tagged maps), as /kv_event_sources says, and a subscriber that missed some
    asks for them again."""
    import msgspec
    import zmq

    from optimum_qwen36.server.kv_events import KVEventsConfig

    publish, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=publish, replay_endpoint=replay, topic="kv"
    )
    settings = ServerSettings(MODEL, api_key=API_KEY)
    running = RunningServer(build_app(lambda: served_model(model, kv_events=config), settings))
    context = zmq.Context()
    try:
        running.wait_healthy()
        status, _, body = running.request("GET", "/kv_event_sources")
        assert status == 200 and json.loads(body)["0"]["endpoint"] == publish
        subscriber = context.socket(zmq.SUB)
        subscriber.connect(publish)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
        # A SUB socket gets what is sent once it has joined: prompts go until one's events arrive.
        prompts: list[tuple[int, ...]] = []
        while not subscriber.poll(200):
            assert len(prompts) < 50, "no KV event arrived"
            prompt = list(range(7000 + 200 * len(prompts), 7200 + 200 * len(prompts)))
            prompts.append(tuple(prompt[:192]))  # 200 tokens: the checkpoint at 192 makes 3 blocks reusable
            running.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})
        topic, sequence, payload = subscriber.recv_multipart()
        timestamp, events, rank = msgspec.msgpack.decode(payload)
        assert topic == b"kv" and rank == 0 and abs(timestamp - time.time()) < 60
        (stored,) = [event for event in events if event["type"] == "BlockStored"]
        assert tuple(stored["token_ids"]) in prompts and len(stored["block_hashes"]) == 3
        assert stored["parent_block_hash"] is None and stored["block_size"] == 64

        # A subscriber that missed batches asks for them from a sequence number: all of them, then -1.
        dealer = context.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000), "the replay did not end"
            _, number, batch = dealer.recv_multipart()
            if number == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append((number, batch))
        assert replayed[0][0] == (0).to_bytes(8, "big") and (sequence, payload) in replayed
        first = msgspec.msgpack.decode(replayed[0][1])[1][0]
        assert tuple(first["token_ids"]) == prompts[0]
    finally:
        context.destroy(linger=0)
        running.stop()


def metric_values(server) -> dict[str, float]:
    status, _, body = server.request("GET", "/metrics")
    assert status == 200
    families = text_string_to_metric_families(body.decode())
    return {sample.name: sample.value for family in families for sample in family.samples}


def test_idle_kv_usage_counts_cached_prefixes_as_free(server, client) -> None:
    """Cached prefix blocks no request holds are evicted on demand: kv_cache_usage_perc counts them as free
    (a router reading it sees an idle replica as empty, as with vLLM), kv_cache_cached_perc exports them."""
    prompt = list(range(5000, 5200))  # tokens no other test sends: three full blocks stay cached
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    server.wait_until_idle()
    values = metric_values(server)
    assert values["optimum_qwen36:kv_cache_usage_perc"] == 0.0
    cached = values["optimum_qwen36:kv_cache_cached_perc"]
    assert cached * values["optimum_qwen36:kv_blocks"] >= 3


def test_models_tokenize_detokenize(server, client) -> None:
    (card,) = client.models.list().data
    assert card.id == MODEL
    status, _, body = server.request("POST", "/tokenize", {"prompt": "Hello world"})
    tokens = json.loads(body)["tokens"]
    assert status == 200 and json.loads(body)["count"] == len(tokens) == 2
    status, _, body = server.request("POST", "/detokenize", {"tokens": tokens})
    assert json.loads(body) == {"prompt": "Hello world"}
    _, _, body = server.request("POST", "/tokenize", {"messages": GREETING})
    assert json.loads(body)["count"] > len(tokens)


def test_render_gives_the_prompt_the_request_would_run(server, client) -> None:
    """vLLM's render endpoints (vllm-router's cache-aware policies read them): the token ids a request
    would run, the same the chat runs, and its sampling parameters; nothing is generated."""
    body = {"model": MODEL, "messages": GREETING, "temperature": 0.5, "max_tokens": 7, **NO_THINKING}
    status, _, payload = server.request("POST", "/v1/chat/completions/render", body)
    rendered = json.loads(payload)
    assert status == 200 and rendered["model"] == MODEL
    params = rendered["sampling_params"]
    assert params["temperature"] == 0.5 and params["max_tokens"] == 7
    tokenized = server.request("POST", "/tokenize", {"messages": GREETING, **NO_THINKING})
    assert rendered["token_ids"] == json.loads(tokenized[2])["tokens"]
    ran = chat(client, GREETING, max_tokens=1, extra_body=NO_THINKING)
    assert ran.usage.prompt_tokens == len(rendered["token_ids"])

    status, _, payload = server.request(
        "POST", "/v1/completions/render", {"prompt": [[9707, 1879], [5, 6, 7]], "n": 2, "max_tokens": 3}
    )
    first, second = json.loads(payload)
    assert status == 200 and first["token_ids"] == [9707, 1879] and second["token_ids"] == [5, 6, 7]
    assert first["sampling_params"]["n"] == 2
    status, _, payload = server.request("POST", "/v1/completions/render", {"prompt": "Hello world"})
    tokenized = server.request("POST", "/tokenize", {"prompt": "Hello world"})
    assert json.loads(payload)[0]["token_ids"] == json.loads(tokenized[2])["tokens"]
    status, _, payload = server.request("POST", "/v1/completions/render", {"prompt": "x", "model": "gpt-9"})
    assert status == 404


def test_text_content_parts_render_as_their_text(server) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"text": "world"}]}]
    whole = [{"role": "user", "content": "Hello world"}]
    _, _, from_parts = server.request("POST", "/tokenize", {"messages": parts})
    _, _, from_string = server.request("POST", "/tokenize", {"messages": whole})
    assert json.loads(from_parts)["tokens"] == json.loads(from_string)["tokens"]


# ---------------------------------------------------------------------- errors
GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
BAD_REQUESTS = {
    "malformed JSON": ("/v1/completions", None, b'{"prompt": "x",'),
    "not UTF-8": ("/v1/completions", None, b'{"prompt": "\xff\xfe"}'),
    "token outside the vocabulary": ("/v1/completions", {**GOOD, "prompt": [5, 10**9]}, None),
    "negative token": ("/v1/completions", {**GOOD, "prompt": [-1]}, None),
    "huge n": ("/v1/completions", {**GOOD, "n": 10**6}, None),
    # A render describes a request the server would run: built for every choice, so refused first.
    "huge n to render": ("/v1/completions/render", {**GOOD, "n": 4_106_782}, None),
    "huge n to render a chat": ("/v1/chat/completions/render", {"messages": GREETING, "n": 10**7}, None),
    "huge max_tokens": ("/v1/completions", {**GOOD, "max_tokens": 10**12}, None),
    "prompt over the model length": ("/v1/completions", {**GOOD, "prompt": [7] * 1100}, None),
    "suffix": ("/v1/completions", {**GOOD, "suffix": "x"}, None),
    "temperature out of range": ("/v1/completions", {**GOOD, "temperature": -1}, None),
    "empty prompt": ("/v1/completions", {**GOOD, "prompt": []}, None),
    "missing messages": ("/v1/chat/completions", {"model": MODEL}, None),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
    "image content part": (
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ]
        },
        None,
    ),
    "content neither text nor parts": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": 3}]},
        None,
    ),
    "tool call arguments not JSON": (
        "/v1/chat/completions",
        {
            "messages": [
                *GREETING,
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]},
            ]
        },
        None,
    ),
    "tool_choice names no tool": (
        "/v1/chat/completions",
        {"messages": GREETING, "tools": [WEATHER_TOOL], "tool_choice": {"function": {"name": "other"}}},
        None,
    ),
    "bad stop token": ("/v1/completions", {**GOOD, "stop_token_ids": [10**9]}, None),
    "logit_bias key not a token id": ("/v1/completions", {**GOOD, "logit_bias": {"hello": 1}}, None),
    "logit_bias token outside the vocabulary": (
        "/v1/completions",
        {**GOOD, "logit_bias": {"999999": 1}},
        None,
    ),
    "logit_bias value over 100": (
        "/v1/chat/completions",
        {"messages": GREETING, "logit_bias": {"5": 101}},
        None,
    ),
    "bad json schema": (
        "/v1/chat/completions",
        {
            "messages": GREETING,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}},
        },
        None,
    ),
    # Text must be valid Unicode: a lone surrogate escape is valid JSON but no text.
    "lone surrogate in a prompt": ("/v1/completions", None, b'{"prompt": "\\ud800abc", "max_tokens": 2}'),
    "lone surrogate in a message": (
        "/v1/chat/completions",
        None,
        b'{"messages": [{"role": "user", "content": "\\udfffx"}]}',
    ),
    "lone surrogate to tokenize": ("/tokenize", None, b'{"prompt": "a\\ud800"}'),
    # Strict types: a bool is no token id, 2.0 is no count.
    "bool as a token id": ("/v1/completions", {**GOOD, "prompt": [[True, 5]]}, None),
    "bool to detokenize": ("/detokenize", {"tokens": [True, 5]}, None),
    "n as a float": ("/v1/completions", {**GOOD, "n": 2.0}, None),
    "chat_template_kwargs sets add_generation_prompt": (
        "/v1/chat/completions",
        {"messages": GREETING, "chat_template_kwargs": {"add_generation_prompt": False}},
        None,
    ),
    "prompt over the model length in a chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "lantern " * 1100}]},
        None,
    ),
    "developer message after the first": (
        "/v1/chat/completions",
        {"messages": [*GREETING, {"role": "developer", "content": "Be brief."}]},
        None,
    ),
}
# Messages that betray the server's Python instead of saying what to change.
PYTHON_INTERNALS = (
    "Traceback",
    "object has no attribute",
    "keyword argument",
    "NoneType",
    "Overflow",
    "Params",
)


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, case: str) -> None:
    path, body, raw = BAD_REQUESTS[case]
    status, _, payload = server.request("POST", path, body, raw=raw)
    assert status == 400, payload
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] and not any(telltale in error["message"] for telltale in PYTHON_INTERNALS)
    assert server.request("POST", "/v1/completions", GOOD)[0] == 200


@pytest.mark.parametrize(
    ("tool", "named"),
    [
        ({"type": "function", "function": {"name": "f", "parameters": "city"}}, "'f'"),
        ({"type": "function", "function": {"name": "f", "parameters": 3}}, "'f'"),
        ({"type": "function", "function": {"name": "f", "parameters": [{"type": "string"}]}}, "'f'"),
        ({"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}, "'f'"),
        ({"type": "function"}, "'function'"),
        ({"type": "function", "function": {"name": "a>b"}}, "'a>b'"),
        ({"type": "function", "function": {"name": 'say "hi"'}}, "'say \"hi\"'"),
        ({"type": "function", "function": {"name": "two\nlines"}}, "'two\\nlines'"),
        ({"type": "function", "function": {"name": "x" * 65}}, "x" * 65),
        ({"type": "function", "function": {"name": ""}}, "''"),
    ],
)
def test_malformed_tools_get_a_400_naming_the_tool(server, tool: dict, named: str) -> None:
    """OpenAI's rule for names (^[a-zA-Z0-9_-]{1,64}$), parameters a JSON Schema object, with tool_choice auto
    too: never a 500, never a call to a tool that is not there."""
    status, _, payload = server.request(
        "POST", "/v1/chat/completions", {"messages": GREETING, "tools": [tool]}
    )
    assert status == 400, payload
    error = json.loads(payload)["error"]
    assert error["param"].startswith("tools") and named in error["message"], error


def test_a_server_failure_is_a_500_whose_traceback_is_logged(
    server, caplog: pytest.LogCaptureFixture
) -> None:
    state = server.app.state.server

    def explode(_: Any) -> bytes:
        raise RuntimeError("the metrics registry exploded")

    caplog.set_level(logging.ERROR, logger="optimum_qwen36")
    original, state.metrics.render = state.metrics.render, explode
    try:
        status, _, payload = server.request("GET", "/metrics")
    finally:
        state.metrics.render = original
    assert status == 500 and "the metrics registry exploded" in json.loads(payload)["error"]["message"]
    logged = [r for r in caplog.records if r.name.startswith("optimum_qwen36") and r.exc_info]
    assert logged and logged[0].exc_info[1].args == ("the metrics registry exploded",)
    assert "explode" in caplog.text  # the traceback, down to the failing frame


def test_numbers_past_any_limit_are_no_limit_or_a_400(server) -> None:
    """top_k beyond the vocabulary keeps all of it (0 or -1 do too); counts past 64 bits are a 400."""
    answers = [
        server.request("POST", "/v1/completions", {**GOOD, "top_k": top_k, "temperature": 1, "seed": 3})
        for top_k in (10**30, 0, -1)
    ]
    assert [status for status, _, _ in answers] == [200] * 3
    assert len({json.loads(body)["choices"][0]["text"] for _, _, body in answers}) == 1
    for field in ("max_tokens", "min_tokens", "seed", "n", "logprobs"):
        status, _, payload = server.request("POST", "/v1/completions", {**GOOD, field: 10**30})
        assert status == 400 and json.loads(payload)["error"]["param"] == field, (field, payload)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**GOOD, "prompt": [7] * 1100, "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ink " * 1100}]}, "messages"),
        ("/v1/completions", {**GOOD, "prompt": [7] * 1000, "max_tokens": 50}, "max_tokens"),
    ],
)
def test_an_over_long_request_names_the_field_to_shorten(server, path: str, body: dict, param: str) -> None:
    """A prompt that leaves no room is the prompt's (or the messages') fault, not max_tokens'."""
    status, _, payload = server.request("POST", path, body)
    assert status == 400 and json.loads(payload)["error"]["param"] == param


def test_length_error_names_both_numbers(server) -> None:
    _, _, payload = server.request(
        "POST", "/v1/completions", {**GOOD, "prompt": [7] * 1000, "max_tokens": 50}
    )
    message = json.loads(payload)["error"]["message"]
    assert "1024" in message and "1050" in message


def test_unknown_model_and_route(server) -> None:
    status, _, payload = server.request("POST", "/v1/completions", {**GOOD, "model": "gpt-9"})
    assert status == 404 and json.loads(payload)["error"]["code"] == "model_not_found"
    status, _, payload = server.request("GET", "/v1/nothing")
    assert status == 404 and "error" in json.loads(payload)


def test_api_key_is_required(server) -> None:
    for key in (None, "wrong"):
        status, _, payload = server.request("POST", "/v1/completions", GOOD, key=key)
        assert status == 401 and json.loads(payload)["error"]["type"] == "authentication_error"
    assert server.request("GET", "/health", key=None)[0] == 200


def test_full_queue_answers_503_with_retry_after(server) -> None:
    state = server.app.state.server
    state._in_flight += 10_000  # as if that many sequences were queued
    try:
        status, headers, payload = server.request("POST", "/v1/completions", GOOD)
    finally:
        state._in_flight -= 10_000
    assert status == 503 and headers.get("retry-after") == "1"
    assert json.loads(payload)["error"]["type"] == "service_unavailable_error"


def test_health_is_503_until_the_model_is_loaded(model, caplog: pytest.LogCaptureFixture) -> None:
    loaded = threading.Event()

    def load():
        loaded.wait(30)
        return served_model(model)

    caplog.set_level(logging.INFO, logger="optimum_qwen36")
    settings = ServerSettings(MODEL, default_enable_thinking=False, url="http://127.0.0.1:1234")
    running = RunningServer(build_app(load, settings))
    try:
        deadline = time.monotonic() + 10
        while running.status("GET", "/health") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running.status("GET", "/health") == 503
        status, headers, _ = running.request("POST", "/v1/completions", GOOD)
        assert status == 503 and "retry-after" in {k.lower() for k in headers}
        # A scraper sees every series from start-up: the engine's at zero while the model loads.
        loading = metric_values(running)
        assert loading["vllm:num_requests_waiting"] == loading["optimum_qwen36:num_requests_running"] == 0
        assert loading["vllm:request_success_total"] == 0
        loaded.set()
        running.wait_healthy()
        # This server's default is thinking off.
        response = running.request("POST", "/v1/chat/completions", {"messages": GREETING, "temperature": 0})
        assert (
            json.loads(response[2])["choices"][0]["message"]["content"] == CONVERSATIONS["no_thinking"].answer
        )
        # The log says when the model is ready, and where.
        assert f"Ready: serving {MODEL} at http://127.0.0.1:1234/v1" in caplog.text
    finally:
        loaded.set()
        running.stop()


def test_serve_command_serves_and_drains_on_sigterm(checkpoint: Path) -> None:
    """`optimum-qwen36 serve CHECKPOINT`: exported on the fly (eager), served until SIGTERM; then it
    drains as a router expects of a replica: the stream in flight runs to its end while /health and new
    requests answer 503 with Retry-After, and the process exits by itself once idle."""
    port = free_port()
    command = [sys.executable, "-m", "optimum_qwen36.cli", "serve", str(checkpoint), "--backend", "eager"]
    command += ["--port", str(port), "--served-model-name", "cli", "--sequence-length", "512"]
    command += ["--default-enable-thinking", "false", "--log-level", "info"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        response = client.chat.completions.create(model="cli", messages=GREETING, temperature=0)
        assert response.choices[0].message.content == CONVERSATIONS["no_thinking"].answer
        assert client.models.list().data[0].max_model_len == 512

        long = dict(model="cli", prompt="Hello", max_tokens=480, extra_body={"ignore_eos": True}, stream=True)
        stream = iter(client.completions.create(**long))
        next(stream)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(url + "/health", timeout=5)
        assert health.value.code == 503 and health.value.headers["Retry-After"]
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="cli", messages=GREETING, max_tokens=2)
        assert refused.value.status_code == 503 and refused.value.response.headers["Retry-After"]
        assert "shutting down" in refused.value.message
        assert [chunk.choices[0].finish_reason for chunk in stream][-1] == "length"
        process.wait(timeout=30)
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0].decode()
    assert process.returncode == 0, output
    assert f"Ready: serving cli at http://127.0.0.1:{port}/v1" in output, output
    assert "Draining: 1 sequences in flight" in output, output


@pytest.mark.parametrize("flags", [(), ("--no-prefix-caching",)], ids=["default", "no-prefix-caching"])
def test_serve_caches_prefixes_unless_told_not_to(checkpoint: Path, flags: tuple[str, ...]) -> None:
    """`serve` caches prefixes by default (as vLLM does), also for a model exported without prefix caching,
    as this checkpoint is: a repeated chat reports cached prompt tokens; --no-prefix-caching turns it off."""
    from optimum_qwen36.cli import build_parser, serve_app

    command = ["serve", str(checkpoint), "--backend", "eager", "--sequence-length", "512"]
    command += ["--served-model-name", MODEL, "--api-key", API_KEY, *flags]
    args = build_parser().parse_args(command)
    assert args.prefix_caching == (not flags)
    running = RunningServer(serve_app(args))
    try:
        running.wait_healthy(timeout=120)
        client = openai.OpenAI(base_url=running.url + "/v1", api_key=API_KEY, max_retries=0)
        messages = [{"role": "user", "content": "amber lantern " * 60}]
        answers = [chat(client, messages, max_tokens=4, extra_body=NO_THINKING) for _ in range(2)]
    finally:
        running.stop()
    first, second = (answer.usage.prompt_tokens_details.cached_tokens for answer in answers)
    assert first == 0
    assert second > 0 if args.prefix_caching else second == 0
    assert answers[1].choices[0].message.content == answers[0].choices[0].message.content


# ---------------------------------------------------------------------- what clients read of the server
def test_openapi_describes_the_server(server) -> None:
    """/openapi.json is what generated clients and fuzzers build requests from: typed messages, the 200
    bodies, and the OpenAI errors the server answers (never FastAPI's 422)."""
    status, _, body = server.request("GET", "/openapi.json", key=None)
    document = json.loads(body)
    assert status == 200 and "422" not in body.decode()
    chat_route = document["paths"]["/v1/chat/completions"]["post"]
    assert set(chat_route["responses"]) == {"200", "400", "401", "404", "503"}
    ok = chat_route["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletion"}
    # An event stream's schema is one event's (OpenAPI before 3.2): its data a chunk as JSON, or [DONE].
    data = ok["text/event-stream"]["schema"]["properties"]["data"]["anyOf"]
    assert data[0] == {"const": "[DONE]"} and data[1]["contentMediaType"] == "application/json"
    chunk = {"$ref": "#/components/schemas/ChatCompletionChunk"}
    assert data[1]["contentSchema"]["anyOf"] == [chunk, {"$ref": "#/components/schemas/ErrorResponse"}]
    assert {"ChatCompletionChunk", "ResponseEvent"} <= set(document["components"]["schemas"])
    error = chat_route["responses"]["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    schemas = document["components"]["schemas"]
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]["items"]
    assert set(messages["discriminator"]["mapping"]) == {"system", "developer", "user", "assistant", "tool"}
    assert schemas["ChatMessageOut"]["required"] == ["role", "content", "refusal"]
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path in ("/v1/models", "/tokenize", "/v1/responses", "/tokenizer_info", "/v1/completions"):
        for operation in document["paths"][path].values():
            assert operation["responses"]["200"]["content"]["application/json"]["schema"], path


def test_messages_carry_refusal_and_developer_is_system(server) -> None:
    """OpenAI's message.refusal and logprobs.refusal (required, null here); a developer message renders as
    the system message, as vLLM does."""
    status, _, body = server.request(
        "POST", "/v1/chat/completions", {"messages": GREETING, "logprobs": True, "max_tokens": 2}
    )
    choice = json.loads(body)["choices"][0]
    assert status == 200 and choice["message"]["refusal"] is None and choice["logprobs"]["refusal"] is None
    rendered = [
        json.loads(
            server.request(
                "POST", "/tokenize", {"messages": [{"role": role, "content": "Be brief."}, *GREETING]}
            )[2]
        )
        for role in ("system", "developer")
    ]
    assert rendered[0]["tokens"] == rendered[1]["tokens"]
    streamed = {"messages": GREETING, "stream": True, "logprobs": True, "max_tokens": 3}
    status, _, body = server.request("POST", "/v1/chat/completions", streamed)
    events = [line[len("data: ") :] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    for event in events[:-1]:  # every streamed chunk is what /openapi.json documents
        ChatCompletionChunk.model_validate_json(event)


def test_tokenizer_info_serves_what_lm_evaluation_harness_reads(server, model) -> None:
    """GET /tokenizer_info as vLLM serves it: tokenizer_config.json's settings with the chat template, which
    lm-evaluation-harness renders itself (jinja2, as its RemoteTokenizer does) instead of loading the
    tokenizer."""
    import jinja2

    status, _, body = server.request("GET", "/tokenizer_info")
    info = json.loads(body)
    config = json.loads((Path(model.tokenizer_dir) / "tokenizer_config.json").read_text())
    assert status == 200 and info["eos_token"] == "<|im_end|>" and info["tokenizer_class"]
    assert info["chat_template"] == served_tokenizer(model).chat_template
    assert info["added_tokens_decoder"] == config["added_tokens_decoder"]

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    text = environment.from_string(info["chat_template"]).render(
        messages=GREETING, add_generation_prompt=True
    )
    by_server = json.loads(server.request("POST", "/tokenize", {"messages": GREETING})[2])["tokens"]
    from_text = json.loads(
        server.request("POST", "/tokenize", {"prompt": text, "add_special_tokens": False})[2]
    )
    assert from_text["tokens"] == by_server


# ---------------------------------------------------------------------- the Responses API
WEATHER_FUNCTION = {"type": "function", **WEATHER_TOOL["function"]}


def respond(client: openai.OpenAI, input: Any, **kwargs: Any):
    return client.responses.create(model=MODEL, input=input, temperature=0, **kwargs)


def test_responses_text_and_reasoning(client) -> None:
    response = respond(client, "Say hello.")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "The user greets me.\n"
    assert message.type == "message" and response.output_text == "Hello! How can I help you today?"
    assert response.status == "completed" and response.usage.output_tokens_details.reasoning_tokens > 0
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    quiet = respond(client, [{"role": "user", "content": "Say hello."}], reasoning={"effort": "none"})
    assert [item.type for item in quiet.output] == ["message"]
    assert quiet.output_text == CONVERSATIONS["no_thinking"].answer
    assert quiet.usage.output_tokens_details.reasoning_tokens == 0


def test_responses_instructions_are_the_system_message(server, client) -> None:
    response = respond(client, "Say hello.", instructions="Be brief.", max_output_tokens=2)
    messages = [{"role": "system", "content": "Be brief."}, *GREETING]
    rendered = json.loads(server.request("POST", "/tokenize", {"messages": messages})[2])
    assert response.usage.input_tokens == rendered["count"]
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2


def test_responses_stream_events_build_the_response(client) -> None:
    """Streamed, OpenAI's typed events in order (the client's stream helper rebuilds the response from them
    and checks their indices), ending with the same response as unstreamed."""
    whole = respond(client, "Say hello.")
    with client.responses.stream(model=MODEL, input="Say hello.", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for kind in ("reasoning_text.delta", "output_text.delta", "content_part.added", "output_item.done"):
        assert f"response.{kind}" in kinds
    assert final.output_text == whole.output_text and final.output[0].content == whole.output[0].content
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    raw = list(respond(client, "Say hello.", stream=True, max_output_tokens=3))
    assert raw[-1].type == "response.incomplete" and raw[-1].response.status == "incomplete"


def test_responses_function_call_round_trip(client) -> None:
    response = respond(client, "What is the weather in Paris?", tools=[WEATHER_FUNCTION])
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == WEATHER_ARGUMENTS
    assert response.output_text == "" and response.output[0].type == "reasoning"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}
    follow_up = respond(
        client, [*WEATHER_QUESTION, call.model_dump(exclude_none=True), result], tools=[WEATHER_FUNCTION]
    )
    assert follow_up.output_text == "It is 21 degrees in Paris."
    # streamed, the call's arguments arrive as deltas that add up to them
    with client.responses.stream(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER_FUNCTION], temperature=0
    ) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(deltas) == json.loads(done.arguments) == WEATHER_ARGUMENTS


def test_responses_previous_response_id_continues_in_memory(server, client) -> None:
    """A follow-up continues the stored conversation: its prompt is the history then its input, and reuses
    the history's cached prefix."""
    first = respond(client, "amber lantern " * 50, max_output_tokens=4)
    follow_up = respond(client, "And then?", previous_response_id=first.id, max_output_tokens=2)
    history = [
        {"role": "user", "content": "amber lantern " * 50},
        {
            "role": "assistant",
            "content": first.output_text,
            "reasoning_content": first.output[0].content[0].text,
        },
        {"role": "user", "content": "And then?"},
    ]
    rendered = json.loads(server.request("POST", "/tokenize", {"messages": history})[2])
    assert follow_up.usage.input_tokens == rendered["count"]
    assert follow_up.usage.input_tokens_details.cached_tokens >= 64
    assert client.responses.retrieve(follow_up.id).output == follow_up.output
    # Only the last max_stored_responses (4 here) are kept; an older id is refused, saying what to do.
    for _ in range(4):
        respond(client, "Say hello.", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as refused:
        respond(client, "And then?", previous_response_id=first.id)
    assert refused.value.code == "previous_response_not_found" and "input" in refused.value.message
    unstored = respond(client, "Say hello.", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
        # this model takes text only
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0"),
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input.0"),
        ({"input": "\ud800"}, "input"),
    ],
)
def test_responses_refuse_what_they_do_not_serve_by_name(server, body: dict, param: str) -> None:
    status, _, payload = server.request("POST", "/v1/responses", body)
    assert status == 400 and json.loads(payload)["error"]["param"].startswith(param), payload


# ---------------------------------------------------------------------- LangChain
def test_langchain_structured_output(server) -> None:
    """LangChain's ChatOpenAI.with_structured_output: by function calling (a forced call, its arguments held
    to the schema) and by json_schema (response_format)."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key=API_KEY, temperature=0, max_retries=0)
    weather = llm.with_structured_output(WEATHER_TOOL["function"], method="function_calling")
    assert weather.invoke(WEATHER_QUESTION[0]["content"]) == WEATHER_ARGUMENTS

    class Mood(pydantic.BaseModel):
        mood: Literal["happy", "sad"]
        sure: bool

    quiet = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key=API_KEY, temperature=0, max_retries=0,
        extra_body=NO_THINKING, max_tokens=64,
    )  # fmt: skip
    assert isinstance(
        quiet.with_structured_output(Mood, method="function_calling").invoke("Say hello."), Mood
    )

    class Person(pydantic.BaseModel):
        name: str
        age: int

    person = quiet.with_structured_output(Person, method="json_schema").invoke(PERSON[0]["content"])
    assert person == Person(name="Ada", age=36)


# ---------------------------------------------------------------------- tensor parallelism
def test_tensor_parallel_server_answers_as_one_process(checkpoint: Path, client) -> None:
    """`serve --tp-degree 2`'s engine: the same answers over HTTP, streamed or not, as one process."""
    settings = dict(batch_size=SLOTS, sequence_length=1024, prefill_chunk_size=64, prefix_caching=True)
    split = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend="eager", tp_degree=2, **settings
    )
    running = RunningServer(build_app(lambda: served_model(split), ServerSettings(MODEL, api_key=API_KEY)))
    running.wait_healthy()
    try:
        other = openai.OpenAI(base_url=running.url + "/v1", api_key=API_KEY, max_retries=0)
        expected = chat(client, GREETING).choices[0].message
        answer = chat(other, GREETING).choices[0].message
        assert (answer.reasoning, answer.content) == (expected.reasoning, expected.content)
        joined, _ = stream_chat(other, GREETING)
        assert (joined["reasoning"], joined["content"]) == (expected.reasoning, expected.content)
        calls = [
            chat(c, WEATHER_QUESTION, tools=[WEATHER_TOOL]).choices[0].message.tool_calls
            for c in (client, other)
        ]
        assert [(t.function.name, t.function.arguments) for t in calls[1]] == [
            (t.function.name, t.function.arguments) for t in calls[0]
        ]
        # Structured output: each worker rebuilds the request's grammar constraint
        schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
        response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
        structured = [
            chat(c, PERSON, response_format=response_format, extra_body=NO_THINKING).choices[0].message
            for c in (client, other)
        ]
        structured = [message.content for message in structured]
        assert structured[1] == structured[0] and "name" in json.loads(structured[0])
        status, _, body = running.request("GET", "/metrics")
        assert status == 200 and b"prefix_cache" in body
    finally:
        running.stop()
