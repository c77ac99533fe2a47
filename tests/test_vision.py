"""Images in: the vision tower, multimodal RoPE and image features through generate(), the engine and the
prefix cache, against transformers' Qwen3_5ForConditionalGeneration on a tiny random checkpoint (float32)."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from conftest import TINY_VISION_TOKENS, save_tiny_checkpoint
from helpers import image_patches, image_tokens, serve_tiny_vision_model
from PIL import Image
from running_server import API_KEY, RunningServer
from transformers import Qwen3_5ForConditionalGeneration

from optimum_qwen36 import NeuronQwen36ForCausalLM, NeuronQwen36ForConditionalGeneration
from optimum_qwen36.cli import _images_per_prompt, build_parser
from optimum_qwen36.engine import EngineRequest, SamplingParams
from optimum_qwen36.network.vision import ImageInput, Qwen36VisionModel
from optimum_qwen36.server.errors import OpenAIError
from optimum_qwen36.server.images import ImageLimits, ImageReader
from optimum_qwen36.tokenizer import load_qwen36_tokenizer

IMAGE = TINY_VISION_TOKENS["image_token_id"]
SETTINGS = dict(backend="eager", dtype="float32", batch_size=2, sequence_length=128, prefill_chunk_size=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen3_5ForConditionalGeneration]:
    directory, reference = save_tiny_checkpoint(
        tmp_path_factory.mktemp("vision") / "ckpt", layout="conditional"
    )
    return directory, reference.float()


@pytest.fixture(scope="module")
def model(checkpoint) -> NeuronQwen36ForConditionalGeneration:
    return NeuronQwen36ForConditionalGeneration.from_pretrained(checkpoint[0], export=True, **SETTINGS)


@pytest.fixture(scope="module", params=["eager", "cpu"])
def any_backend_model(checkpoint, request) -> NeuronQwen36ForConditionalGeneration:
    settings = {**SETTINGS, "backend": request.param}
    return NeuronQwen36ForConditionalGeneration.from_pretrained(checkpoint[0], export=True, **settings)


def reference_generate(reference: Qwen3_5ForConditionalGeneration, **inputs: Any) -> Any:
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE).long()
    with torch.no_grad():
        return reference.generate(
            **inputs, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True
        )


def assert_same_generation(ours: Any, theirs: Any) -> None:
    assert ours.sequences.tolist() == theirs.sequences.tolist()
    for mine, expected in zip(ours.logits, theirs.logits, strict=True):
        assert (mine - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_the_tower_equals_transformers_on_images_of_several_sizes(checkpoint) -> None:
    _, reference = checkpoint
    tower = Qwen36VisionModel(reference.config.vision_config)
    state = {k.removeprefix("model.visual."): v for k, v in reference.state_dict().items() if "visual." in k}
    tower.load_state_dict(state)
    for seed, grid in enumerate([(1, 4, 6), (1, 10, 4), (2, 4, 4)]):
        pixels = image_patches(reference.config.vision_config, grid, seed)
        with torch.no_grad():
            expected = reference.model.get_image_features(pixels, torch.tensor([grid])).pooler_output[0]
            ours = tower.encode(ImageInput(pixels, grid))
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_generate_with_two_images_equals_transformers(checkpoint, any_backend_model) -> None:
    """Two images of different sizes; chunks of 8 tokens end inside both images."""
    _, reference = checkpoint
    grids = [(1, 4, 6), (1, 8, 4)]
    ids = torch.tensor([[11, 12, *image_tokens(grids[0]), 13, 14, 15, *image_tokens(grids[1]), 16, 17]])
    pixels = torch.cat(
        [image_patches(reference.config.vision_config, grid, seed) for seed, grid in enumerate(grids)]
    )
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels)
    theirs = reference_generate(reference, **inputs, image_grid_thw=torch.tensor(grids))
    ours = any_backend_model.generate(
        **inputs,
        image_grid_thw=torch.tensor(grids),
        max_new_tokens=8,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert_same_generation(ours, theirs)
    # The image is what decides: other pixels behind the same tokens give other logits.
    other = any_backend_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=pixels.flip(0),
        image_grid_thw=torch.tensor(grids),
        max_new_tokens=1,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert (other.logits[0] - ours.logits[0]).abs().max() > 1e-2


def test_a_batch_mixing_an_image_row_and_a_left_padded_text_row_equals_transformers(
    checkpoint, any_backend_model
) -> None:
    _, reference = checkpoint
    grid = (1, 6, 4)
    image_row = [21, *image_tokens(grid), 22, 23, 24]
    text_row = [31, 32, 33, 34, 35]
    width = len(image_row)
    ids = torch.tensor([image_row, [0] * (width - len(text_row)) + text_row])
    mask = torch.tensor([[1] * width, [0] * (width - len(text_row)) + [1] * len(text_row)])
    pixels = image_patches(reference.config.vision_config, grid, 5)
    inputs = dict(
        input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=torch.tensor([grid])
    )
    theirs = reference_generate(reference, **inputs)
    ours = any_backend_model.generate(
        **inputs, max_new_tokens=8, output_logits=True, return_dict_in_generate=True
    )
    assert_same_generation(ours, theirs)
    # Batch invariance: each row alone gives the same tokens.
    alone = any_backend_model.generate(
        torch.tensor([image_row]), pixel_values=pixels, image_grid_thw=torch.tensor([grid]), max_new_tokens=8
    )
    assert alone[0].tolist() == ours.sequences[0].tolist()
    assert (
        any_backend_model.generate(torch.tensor([text_row]), max_new_tokens=8)[0].tolist()
        == ours.sequences[1, -13:].tolist()
    )


def engine_tokens(engine: Any, prompt: list[int], images: tuple[ImageInput, ...]) -> tuple[list[int], int]:
    """A greedy request's tokens and how many of its prompt tokens came from the prefix cache."""
    request_id = engine.add_request(
        EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=6), images=images)
    )
    request = engine.run()[request_id]
    return request.output_ids, request.cached_prompt_tokens


def test_the_prefix_cache_reuses_an_image_only_with_the_same_pixels(checkpoint) -> None:
    _, reference = checkpoint
    model = NeuronQwen36ForConditionalGeneration.from_pretrained(
        checkpoint[0],
        export=True,
        **{**SETTINGS, "prefill_chunk_size": 64},
        prefix_caching=True,
        kv_block_size=16,
    )
    engine = model.create_engine()
    grid = (1, 12, 8)  # 24 image tokens
    prompt = [41, 42, *image_tokens(grid), *range(50, 90)]
    image = ImageInput(image_patches(reference.config.vision_config, grid, 7), grid)
    cold, cold_hit = engine_tokens(engine, prompt, (image,))
    warm, warm_hit = engine_tokens(engine, prompt, (image,))
    assert cold_hit == 0 and warm_hit > len(image_tokens(grid)) and warm == cold
    other = ImageInput(image_patches(reference.config.vision_config, grid, 8), grid)
    missed, missed_hit = engine_tokens(engine, prompt, (other,))
    assert missed_hit <= 2  # at most the text before the image; never its tokens
    fresh = NeuronQwen36ForConditionalGeneration.from_pretrained(checkpoint[0], export=True, **SETTINGS)
    assert missed == engine_tokens(fresh.create_engine(), prompt, (other,))[0]


def test_a_saved_model_is_a_transformers_checkpoint_again(checkpoint, model, tmp_path: Path) -> None:
    model.save_pretrained(tmp_path)
    loaded = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path).float()
    _, reference = checkpoint
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    again = NeuronQwen36ForConditionalGeneration.from_pretrained(tmp_path)
    grid = (1, 4, 4)
    ids = torch.tensor([[7, *image_tokens(grid), 8]])
    inputs = dict(
        pixel_values=image_patches(reference.config.vision_config, grid, 3),
        image_grid_thw=torch.tensor([grid]),
        max_new_tokens=4,
    )
    assert again.generate(ids, **inputs).tolist() == model.generate(ids, **inputs).tolist()


def test_bad_image_input_is_refused_with_the_reason(checkpoint, model) -> None:
    _, reference = checkpoint
    grid = (1, 4, 4)
    pixels = image_patches(reference.config.vision_config, grid, 0)
    with pytest.raises(ValueError, match="image placeholder tokens"):
        model.generate(
            torch.tensor([[1, *image_tokens((1, 4, 8)), 2]]), pixel_values=pixels, image_grid_thw=[grid]
        )
    with pytest.raises(ValueError, match="more images"):
        model.generate(torch.tensor([[1, 2]]), pixel_values=pixels, image_grid_thw=[grid])
    with pytest.raises(ValueError, match="pixel_values"):
        model.generate(
            torch.tensor([[1, *image_tokens(grid)]]), pixel_values=pixels[:-1], image_grid_thw=[grid]
        )
    with pytest.raises(ValueError, match="image placeholder tokens"):
        model.generate(torch.tensor([[1, *image_tokens(grid), 2]]))  # placeholders without an image
    text_model = NeuronQwen36ForCausalLM.from_pretrained(checkpoint[0], export=True, **SETTINGS)
    with pytest.raises(ValueError, match="NeuronQwen36ForConditionalGeneration"):
        text_model.generate(
            torch.tensor([[1, *image_tokens(grid)]]), pixel_values=pixels, image_grid_thw=[grid]
        )
    engine = text_model.create_engine()
    with pytest.raises(ValueError, match="no vision tower"):
        engine.add_request(EngineRequest([1, *image_tokens(grid)], images=(ImageInput(pixels, grid),)))


def test_a_text_only_checkpoint_is_refused_by_the_vision_class(tiny_checkpoint) -> None:
    directory, _ = tiny_checkpoint()
    with pytest.raises(ValueError, match="NeuronQwen36ForCausalLM"):
        NeuronQwen36ForConditionalGeneration.from_pretrained(directory, export=True, **SETTINGS)


# ------------------------------------------------------------------------------------ the server's images
def data_url(picture: Image.Image, image_format: str) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format=image_format, **({"lossless": True} if image_format == "WEBP" else {}))
    return f"data:image/{image_format.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def reader(checkpoint) -> ImageReader:
    config = checkpoint[1].config
    return ImageReader(None, config.vision_config, IMAGE, ImageLimits(max_images_per_prompt=2))


def test_image_parts_decode_png_jpeg_and_webp_into_the_processors_patches(reader: ImageReader) -> None:
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 255, (70, 90, 3), dtype=np.uint8))
    expected = reader.processor(images=[picture], return_tensors="pt")
    for image_format in ("PNG", "WEBP"):  # lossless: the same pixels
        (image,) = reader.read([("messages.0.content.0", data_url(picture, image_format))])
        torch.testing.assert_close(image.pixel_values, expected["pixel_values"], rtol=0, atol=0)
        assert list(image.grid_thw) == expected["image_grid_thw"][0].tolist()
    (jpeg,) = reader.read([("messages.0.content.0", data_url(picture, "JPEG"))])
    assert list(jpeg.grid_thw) == expected["image_grid_thw"][0].tolist()
    assert reader.place([1, IMAGE, 2], [jpeg]) == [1] + [IMAGE] * jpeg.num_tokens(2) + [2]


def test_bad_image_parts_are_refused_naming_the_part(checkpoint, reader: ImageReader) -> None:
    picture = Image.fromarray(np.random.default_rng(2).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    where = "messages.0.content.1"
    cases = {
        "data:image/png;base64,bm90IGFuIGltYWdl": "could not be decoded",
        "data:image/png;base64,%%%": "base64",
        "https://example.com/cat.png": "fetches no image URLs",
        "file:///etc/passwd": "data: or http",
    }
    for url, reason in cases.items():
        with pytest.raises(OpenAIError, match=reason) as refused:
            reader.read([(where, url)])
        assert refused.value.status == 400 and where in str(refused.value)
    with pytest.raises(OpenAIError, match="at most 2"):
        reader.read([(where, data_url(picture, "PNG"))] * 3)
    small = ImageReader(None, checkpoint[1].config.vision_config, IMAGE, ImageLimits(max_image_bytes=100))
    with pytest.raises(OpenAIError, match="larger than"):
        small.read([(where, data_url(picture, "PNG"))])


def test_an_image_url_is_fetched_only_from_an_allowed_domain(checkpoint, tmp_path: Path) -> None:
    picture = Image.fromarray(np.random.default_rng(1).integers(0, 255, (40, 48, 3), dtype=np.uint8))
    picture.save(tmp_path / "cat.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    vision_config = checkpoint[1].config.vision_config
    try:
        allowed = ImageReader(None, vision_config, IMAGE, ImageLimits(allowed_media_domains=("127.0.0.1",)))
        (fetched,) = allowed.read([("messages.0.content.0", url)])
        (sent,) = allowed.read([("messages.0.content.0", data_url(picture, "PNG"))])
        torch.testing.assert_close(fetched.pixel_values, sent.pixel_values, rtol=0, atol=0)
        elsewhere = ImageReader(
            None, vision_config, IMAGE, ImageLimits(allowed_media_domains=("example.com",))
        )
        with pytest.raises(OpenAIError, match="not among the allowed media domains"):
            elsewhere.read([("messages.0.content.0", url)])
    finally:
        server.shutdown()
        thread.join(timeout=10)


# ------------------------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def vision_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Any]]:
    running, model = serve_tiny_vision_model(tmp_path_factory.mktemp("served") / "ckpt", "tiny-vision")
    yield running, model
    running.stop()


def test_the_server_answers_an_image_as_generate_does(vision_server) -> None:
    """Through the openai client, streamed and not: the image's tokens count in usage, and the tokens are
    generate()'s on the same rendered prompt and the processor's patches."""
    running, model = vision_server
    client = openai.OpenAI(base_url=running.url + "/v1", api_key=API_KEY)
    picture = Image.fromarray(np.random.default_rng(3).integers(0, 255, (64, 96, 3), dtype=np.uint8))
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": data_url(picture, "PNG")}},
    ]
    request = dict(
        model="tiny-vision",
        messages=[{"role": "user", "content": content}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    answer = client.chat.completions.create(**request)
    served = [entry.token for entry in answer.choices[0].logprobs.content]
    reader = ImageReader(None, model.checkpoint_config.vision_config, 248056, ImageLimits())
    (image,) = reader.read([("image", data_url(picture, "PNG"))])
    tokenizer = load_qwen36_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    prompt = reader.place(tokenizer.encode(text, add_special_tokens=False), [image])
    assert answer.usage.prompt_tokens == len(prompt) and prompt.count(248056) == image.num_tokens(2) > 1
    expected = model.generate(
        torch.tensor([prompt]),
        pixel_values=image.pixel_values,
        image_grid_thw=[image.grid_thw],
        max_new_tokens=6,
        eos_token_id=None,
    )[0, len(prompt) :].tolist()
    assert served == [tokenizer.decode([token]) for token in expected]
    stream = client.chat.completions.create(**request, stream=True)
    streamed = [
        entry.token
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert streamed == served


def test_the_responses_api_takes_input_image_as_chat_takes_image_url(vision_server) -> None:
    """OpenAI's Responses API with an input_image part: the answer and its prompt tokens are chat's."""
    running, _ = vision_server
    client = openai.OpenAI(base_url=running.url + "/v1", api_key=API_KEY)
    picture = data_url(
        Image.fromarray(np.random.default_rng(5).integers(0, 255, (48, 64, 3), dtype=np.uint8)), "PNG"
    )
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    chat = client.chat.completions.create(
        model="tiny-vision",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe"},
                    {"type": "image_url", "image_url": {"url": picture}},
                ],
            }
        ],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True, **no_thinking},
    )
    response = client.responses.create(
        model="tiny-vision",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Describe"},
                    {"type": "input_image", "image_url": picture},
                ],
            }
        ],
        max_output_tokens=5,
        temperature=0,
        reasoning={"effort": "none"},
        extra_body={"ignore_eos": True},
    )
    assert response.usage.input_tokens == chat.usage.prompt_tokens > 20
    assert response.output_text == chat.choices[0].message.content
    # An image outside a user message is refused by name.
    bad = {"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": picture}]}]}
    status, _, body = running.request("POST", "/v1/responses", bad)
    assert status == 400 and json.loads(body)["error"]["param"] == "input.0.content.0"


def test_the_server_refuses_bad_images_by_part_and_goes_on(vision_server) -> None:
    running, _ = vision_server
    picture = Image.fromarray(np.random.default_rng(4).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    good = {"type": "image_url", "image_url": {"url": data_url(picture, "PNG")}}
    cases = [
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}], "decoded"),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}], "allowed-media-domains"),
        ([good, good, good], "at most 2"),
    ]
    for content, reason in cases:
        body = {"model": "tiny-vision", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        status, _, raw = running.request("POST", "/v1/chat/completions", body)
        error = json.loads(raw)["error"]
        assert status == 400 and reason in error["message"], error
    system_image = {"role": "system", "content": [good]}
    body = {
        "model": "tiny-vision",
        "messages": [system_image, {"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    assert running.request("POST", "/v1/chat/completions", body)[0] == 400
    body = {"model": "tiny-vision", "messages": [{"role": "user", "content": [good]}], "max_tokens": 2}
    assert running.request("POST", "/v1/chat/completions", body)[0] == 200


def test_serve_takes_vllms_image_flags() -> None:
    args = build_parser().parse_args(
        ["serve", "ckpt", "--limit-mm-per-prompt", '{"image": 2}', "--allowed-media-domains", "example.com"]
    )
    assert _images_per_prompt(args.limit_mm_per_prompt) == 2 and args.allowed_media_domains == ["example.com"]
    assert _images_per_prompt("3") == 3
    with pytest.raises(SystemExit, match="limit-mm-per-prompt"):
        _images_per_prompt('{"image": -1}')
