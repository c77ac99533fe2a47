"""A tiny model with the real Qwen3.5/3.6 vocabulary, trained in the test session to answer a few chat
prompts (rendered by the server's own chat rendering) with known text: reasoning that ends in `</think>`,
tool calls in the template's XML format, a tool round trip, a JSON object. A random model never writes
those, so this is how the server's reasoning and tool-call paths meet real model output.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from conftest import save_tiny_checkpoint

from optimum_qwen36.server.chat import render_chat
from optimum_qwen36.tokenizer import load_qwen36_tokenizer

VOCAB_SIZE = 248_320  # the real embedding size (the tokenizer has 248,077 tokens)
TRAIN_STEPS = 80
LEARNING_RATE = 2e-2
MARGIN = 2.0  # the logit every answer token is trained to beat
BACKGROUND_SCALE = 0.05  # untrained output rows: small logits, still varied

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
WEATHER_ARGUMENTS = {"city": "Paris", "days": 3}
TOOL_RESULT = json.dumps({"temperature": 21})


def tool_round_trip_messages(call_id: str = "call_0") -> list[dict[str, Any]]:
    """The weather question, the assistant's call as an OpenAI client sends it back, and the result."""
    call = {"id": call_id, "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": json.dumps(WEATHER_ARGUMENTS)}
    return [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT},
    ]


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    answer: str  # what the model is trained to write (then <|im_end|>)
    tools: list[dict[str, Any]] = field(default_factory=list)
    thinking: bool = True


GREETING = [{"role": "user", "content": "Say hello."}]
PERSON = [{"role": "user", "content": "Describe a person as JSON."}]
CONVERSATIONS = {
    "tool_call": Conversation(
        WEATHER_QUESTION,
        "The user wants the forecast: I call the tool.\n</think>\n\n" + WEATHER_CALL,
        [WEATHER_TOOL],
    ),
    "tool_answer": Conversation(
        tool_round_trip_messages(),
        "The tool says 21 degrees.\n</think>\n\nIt is 21 degrees in Paris.",
        [WEATHER_TOOL],
    ),
    "thinking": Conversation(GREETING, "The user greets me.\n</think>\n\nHello! How can I help you today?"),
    "no_thinking": Conversation(GREETING, "Hello there, nice to meet you.", thinking=False),
    "json": Conversation(PERSON, '{"name": "Ada", "age": 36}', thinking=False),
}


def prompt_text(tokenizer: Any, conversation: Conversation) -> str:
    kwargs = {"enable_thinking": conversation.thinking}
    return render_chat(tokenizer, conversation.messages, conversation.tools, kwargs)


def _training_examples(tokenizer: Any) -> list[tuple[torch.Tensor, int]]:
    """Each conversation as (prompt + answer + EOS ids, the answer's start)."""
    examples = []
    for conversation in CONVERSATIONS.values():
        prompt = tokenizer.encode(prompt_text(tokenizer, conversation), add_special_tokens=False)
        answer = [*tokenizer.encode(conversation.answer, add_special_tokens=False), tokenizer.eos_token_id]
        examples.append((torch.tensor([prompt + answer]), len(prompt)))
    return examples


def cached_chat_checkpoint() -> Path:
    """The trained checkpoint, trained once for what it depends on and kept in the temp directory.

    Training takes minutes on a small CPU, and several test modules (the server's, the web UI's) serve this
    model: the first to ask trains it while the others wait on a file lock. The key covers this file and
    conftest.py (the recipe and the tiny config), the rendered training ids (the chat template and the
    tokenizer), the end-of-turn ids and the torch and transformers versions."""
    here = Path(__file__).parent
    key = hashlib.sha256()
    for source in (here / "chat_model.py", here / "conftest.py"):
        key.update(source.read_bytes())
    tokenizer = load_qwen36_tokenizer()
    for ids, start in _training_examples(tokenizer):
        key.update(json.dumps([ids[0].tolist(), start]).encode())
    key.update(json.dumps([tokenizer.eos_token_id, tokenizer.pad_token_id]).encode())
    key.update(f"{torch.__version__} {transformers.__version__}".encode())
    root = Path(tempfile.gettempdir()) / "optimum-qwen36-tests"
    root.mkdir(exist_ok=True)
    directory = root / f"chat-model-{key.hexdigest()[:16]}"
    with open(root / f"{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not directory.is_dir():
            partial = root / f"{directory.name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            train_chat_checkpoint(partial)
            partial.rename(directory)  # complete or absent, even if a test run is killed while training
    return directory


def train_chat_checkpoint(directory: Path) -> Path:
    """Train the tiny model on CONVERSATIONS (loss on the answers only) and save it.

    Only the output rows of the tokens the answers use are trained (a 248K-row output layer would take most
    of the time); the other rows are scaled down, so they stay below a trained answer's tokens but still
    give untrained prompts varied greedy tokens. The loss puts each answer token above a fixed logit
    (MARGIN), which stands for every untrained row."""
    tokenizer = load_qwen36_tokenizer()
    _, model = save_tiny_checkpoint(directory, "causal", seed=5, vocab_size=VOCAB_SIZE)
    examples = _training_examples(tokenizer)
    used = torch.unique(torch.cat([ids[0, start:] for ids, start in examples]))
    lm_head = model.lm_head.weight
    head = torch.nn.Parameter(lm_head.detach()[used].clone())
    model.lm_head.requires_grad_(False)
    model.model.embed_tokens.requires_grad_(False)
    parameters = [p for p in model.parameters() if p.requires_grad] + [head]
    optimizer = torch.optim.AdamW(parameters, lr=LEARNING_RATE, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LEARNING_RATE, total_steps=TRAIN_STEPS)
    model.train()
    for _ in range(TRAIN_STEPS):
        for ids, start in examples:
            hidden = model.model(input_ids=ids).last_hidden_state[0, start - 1 : -1]
            logits = hidden @ head.T
            logits = torch.cat([logits, torch.full((len(logits), 1), MARGIN)], dim=1)
            torch.nn.functional.cross_entropy(logits, torch.searchsorted(used, ids[0, start:])).backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    model.eval().requires_grad_(False)
    lm_head.mul_(BACKGROUND_SCALE)
    lm_head[used] = head.detach()
    for ids, start in examples:  # decisive on the whole vocabulary, not just the trained rows
        logits = model(input_ids=ids).logits[0, start - 1 : -1]
        assert torch.equal(logits.argmax(-1), ids[0, start:]), "the chat model did not learn its answers"
    # As Qwen3.5/3.6 checkpoints ship it: <|im_end|> and <|endoftext|> end a turn.
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.save_pretrained(directory)
    return directory
