"""Time to first token of a request with an image: one 448x448 image (196 image tokens after the 2x2 merge)
and 64 text tokens, cold (an empty prefix cache: the tower encodes the image, every token is computed) and
warm (the same image and prompt again: the prefix cache holds them, and the image is not encoded), with
Qwen3.6-27B's vision tower (depth 27, hidden 1152, 16 heads, patch 16) in front of bench_generate.py's
random ~0.75B text model. Also the tower alone on that image. Cold and warm alternate round by round;
every run is kept (min / median / max).

    python benchmarks/bench_vision.py                                  # cpu backend, bfloat16
    python benchmarks/bench_vision.py --backend eager --layers 2 --depth 2 --repeats 2 \\
        --output /tmp/bench_vision.json                                  # a smoke run

vLLM-CPU as a peer: not run by this script (its CPU backend's support for Qwen3.5's vision tower was not
checked here); the JSON says so.

Writes benchmarks/results/bench_vision.json and .png (or --output and its .png) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_generate import text_config
from PIL import Image
from timing import command_line, fmt, machine, spread
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5VisionConfig,
)

from optimum_qwen36 import NeuronQwen36ForConditionalGeneration
from optimum_qwen36.engine import EngineRequest, SamplingParams
from optimum_qwen36.network.vision import ImageInput
from optimum_qwen36.server.images import ImageLimits, ImageReader
from optimum_qwen36.tokenizer import save_qwen36_tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
TEXT_TOKENS = 64


def random_checkpoint(directory: Path, layers: int, depth: int, dtype: torch.dtype) -> Path:
    """bench_generate.py's text model (hidden 1024) behind Qwen3.6-27B's vision tower (depth `depth`)."""
    text = text_config(layers, dtype)
    vision = Qwen3_5VisionConfig(depth=depth, out_hidden_size=text.hidden_size)
    config = Qwen3_5Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=True
    )
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(config).to(dtype).save_pretrained(directory)
    save_qwen36_tokenizer(directory)
    return directory


def first_token_seconds(engine, prompt: list[int], images: tuple) -> tuple[float, int]:
    """Seconds from adding the request to its first token, and its prompt tokens from the prefix cache."""
    start = time.perf_counter()
    request_id = engine.add_request(
        EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=1), images=images)
    )
    done = engine.run()
    return time.perf_counter() - start, done[request_id].cached_prompt_tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="cpu", choices=["cpu", "eager"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=24, help="text layers (24: the ~0.75B model)")
    parser.add_argument("--depth", type=int, default=27, help="vision tower blocks (27: Qwen3.6-27B's)")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_vision.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    scratch = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    checkpoint = random_checkpoint(scratch / "ckpt", args.layers, args.depth, dtype)
    model = NeuronQwen36ForConditionalGeneration.from_pretrained(
        checkpoint,
        export=True,
        backend=args.backend,
        dtype=args.dtype,
        batch_size=1,
        sequence_length=1024,
        prefill_chunk_size=256,
        prefix_caching=True,
    )
    config = model.checkpoint_config
    reader = ImageReader(str(checkpoint), config.vision_config, config.image_token_id, ImageLimits())
    pixels = np.random.default_rng(0).integers(0, 255, (args.image_size, args.image_size, 3), dtype=np.uint8)
    picture = Image.fromarray(pixels)
    out = reader.processor(images=[picture], return_tensors="pt")
    image = ImageInput(out["pixel_values"], tuple(out["image_grid_thw"][0].tolist()))
    image_tokens = image.num_tokens(config.vision_config.spatial_merge_size)
    text = [(17 * i) % 50000 + 1000 for i in range(TEXT_TOKENS)]
    half = TEXT_TOKENS // 2
    prompt = [
        *text[:half],
        config.vision_start_token_id,
        *[config.image_token_id] * image_tokens,
        config.vision_end_token_id,
        *text[half:],
    ]
    engine = model.create_engine()
    encoder = model.image_encoder
    encoder.encode(image)  # warm-up
    first_token_seconds(engine, prompt, (image,))
    tower, cold, warm, hits = [], [], [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        encoder.encode(image)
        tower.append(time.perf_counter() - start)
        engine.prefix_cache.clear()
        cold.append(first_token_seconds(engine, prompt, (image,))[0])
        seconds, hit = first_token_seconds(engine, prompt, (image,))
        warm.append(seconds)
        hits.append(hit)
    result = {
        "command": command_line(),
        "machine": machine(),
        "backend": args.backend,
        "dtype": args.dtype,
        "text_layers": args.layers,
        "tower_depth": args.depth,
        "image": {"size": args.image_size, "grid_thw": list(image.grid_thw), "tokens": image_tokens},
        "prompt_tokens": len(prompt),
        "tower_seconds": spread(tower),
        "ttft_cold_seconds": spread(cold),
        "ttft_warm_seconds": spread(warm),
        "warm_cached_prompt_tokens": hits,
        "vllm": "not run: vLLM-CPU's support for Qwen3.5's vision tower was not checked here",
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"| {args.backend} {args.dtype} | tower | TTFT cold | TTFT warm | warm cached tokens |")
    print("|---|---|---|---|---|")
    size = f"{args.image_size}x{args.image_size} + {TEXT_TOKENS} text tokens"
    print(
        f"| {size} | {fmt(spread(tower), 3, ' s')} | {fmt(spread(cold), 3, ' s')} | "
        f"{fmt(spread(warm), 3, ' s')} | {hits[0]} of {len(prompt)} |"
    )
    chart(result, args.output.with_suffix(".png"))


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["tower", "TTFT cold", "TTFT warm"]
    keys = ["tower_seconds", "ttft_cold_seconds", "ttft_warm_seconds"]
    medians = [result[k]["median"] for k in keys]
    low = [result[k]["median"] - result[k]["min"] for k in keys]
    high = [result[k]["max"] - result[k]["median"] for k in keys]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, medians, yerr=[low, high], capsize=4, color=["#888", "#c44", "#4a4"])
    ax.set_ylabel("seconds (median, min-max)")
    image = result["image"]
    ax.set_title(
        f"{image['size']}px image ({image['tokens']} tokens) + {TEXT_TOKENS} text tokens, {result['backend']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
