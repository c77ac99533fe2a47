"""A small Qwen3.5/3.6-architecture model trained in about ten minutes on real text available offline: the
Python standard library's source, one token per byte (vocabulary 256; byte 0 never occurs and pads).

A random model's next-token distributions are nearly flat, so quantization error, greedy agreement and
acceptance rates measured on it mean nothing. This one predicts code well enough that they do. Its weight
matrices span several 128 x 128 blocks (hidden 256, MLP 768), so FP8's per-block scales are exercised.

    python benchmarks/text_model.py /tmp/text-model     # trains (400 steps, 8-14 minutes on 2 cores), saves

`text_checkpoint(directory)` reuses a directory that already holds the trained model (same settings).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

CONFIG = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=None,
    bos_token_id=None,
)
TRAIN = dict(steps=400, batch=16, length=256, lr=3e-3, seed=0)
# Training text: the standard library's modules, minus those held out for evaluation.
HELD_OUT = ("tokenize.py", "difflib.py", "textwrap.py", "fractions.py")
MARKER = "text_model.json"


def corpus(held_out: bool = False) -> torch.Tensor:
    """The bytes of the standard library's top-level modules (held_out: only the evaluation ones)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if (p.name in HELD_OUT) == held_out)
    data = b"\n".join(p.read_bytes() for p in files).replace(b"\x00", b"")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


@torch.enable_grad()  # it may train: callers may have turned gradients off
def text_checkpoint(directory: Path) -> Path:
    """The trained model saved at `directory` (trained now unless it is already there)."""
    marker = directory / MARKER
    settings = {"config": CONFIG, "train": TRAIN}
    if marker.is_file() and json.loads(marker.read_text()).get("settings") == settings:
        return directory
    data = corpus()
    torch.manual_seed(TRAIN["seed"])
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN["lr"], weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=TRAIN["lr"], total_steps=TRAIN["steps"])
    generator = torch.Generator().manual_seed(TRAIN["seed"])
    model.train()
    start, losses = time.perf_counter(), []
    for step in range(TRAIN["steps"]):
        starts = torch.randint(0, len(data) - TRAIN["length"], (TRAIN["batch"],), generator=generator)
        batch = data[starts[:, None] + torch.arange(TRAIN["length"])]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == TRAIN["steps"] - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    model.eval().requires_grad_(False)
    model.save_pretrained(directory)
    report = {
        "settings": settings,
        "final_loss": sum(losses[-20:]) / 20,
        "seconds": time.perf_counter() - start,
    }
    marker.write_text(json.dumps(report, indent=2) + "\n")
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    text_checkpoint(args.directory)
    print(json.loads((args.directory / MARKER).read_text()))


if __name__ == "__main__":
    main()
