"""benchmarks/text_model.py's trained model with a trained multi-token-prediction layer (`mtp.*`).

Random MTP weights accept no drafts, so acceptance and speculative speed-ups need an MTP layer that
predicts. This one is trained on the frozen trunk, on the same text (the Python standard library's source,
one token per byte), the way Qwen's MTP layer works: at position i it reads the trunk's normed hidden
state h_i and the embedding of x_{i+1}, and is trained to predict x_{i+2}. It is transformers' own
full-attention decoder layer between the checkpoints' `pre_fc_norm_*` / `fc` and `norm`, saved under the
official key names (`mtp.fc.weight`, `mtp.layers.0.self_attn.q_proj.weight`, ...).

    python benchmarks/mtp_model.py /tmp/mtp-model     # trains the trunk if needed, then the MTP layer

`mtp_checkpoint(directory)` reuses a directory that already holds both (same settings).

`inert_checkpoint(trained, directory, num_layers, intermediate_size)` gives that model the cost structure
of a large one without changing what it computes: layers appended after the trained ones (copies of the
trained layer of the same kind, in Qwen3.6's 3 GDN + 1 attention pattern) whose output projections are
zero, and MLPs widened with units whose `down_proj` columns are zero. Every added unit does its work (a step
reads its weights, its GDN state and KV are updated) and adds exactly zero to the residual stream, so the
tokens are the trained model's while a decode step is bound by reading the weights, and the MTP layer is
one of `num_layers + 1` layers, as in Qwen3.6-27B (64 + 1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from text_model import CONFIG, MARKER, TRAIN, corpus, text_checkpoint
from torch import nn
from transformers import Qwen3_5ForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

TRAIN_MTP = dict(steps=300, batch=16, length=256, lr=2e-3, seed=1)
MTP_MARKER = "mtp_model.json"
MTP_FILE = "mtp.safetensors"


class MultiTokenPredictor(nn.Module):
    """Qwen3.5/3.6's MTP layer for training: parameter names are the checkpoints' `mtp.*` ones."""

    def __init__(self, trunk: Qwen3_5ForCausalLM) -> None:
        super().__init__()
        config = trunk.config
        size, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(size, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(size, eps=eps)
        self.fc = nn.Linear(2 * size, size, bias=False)
        attention_index = config.layer_types.index("full_attention")
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, layer_idx=attention_index)])
        self.norm = Qwen3_5RMSNorm(size, eps=eps)
        # Start from the trunk's attention layer: it already reads this model's hidden states.
        self.layers[0].load_state_dict(trunk.model.layers[attention_index].state_dict())

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rotary, mask: torch.Tensor) -> torch.Tensor:
        mixed = torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1)
        out = self.fc(mixed)
        for layer in self.layers:
            out = layer(out, position_embeddings=rotary, attention_mask=mask)
        return self.norm(out)


@torch.enable_grad()  # it may train: callers may have turned gradients off
def mtp_checkpoint(directory: Path) -> Path:
    """The trained trunk and MTP layer saved at `directory` (trained now unless already there)."""
    marker = directory / MTP_MARKER
    settings = {"config": CONFIG, "train": TRAIN, "train_mtp": TRAIN_MTP}
    if marker.is_file() and json.loads(marker.read_text()).get("settings") == settings:
        return directory
    trunk_dir = directory / "trunk"
    text_checkpoint(trunk_dir)
    for item in trunk_dir.iterdir():
        if item.name != MARKER:
            shutil.copy(item, directory / item.name)
    trunk = Qwen3_5ForCausalLM.from_pretrained(trunk_dir, dtype=torch.float32).eval().requires_grad_(False)
    torch.manual_seed(TRAIN_MTP["seed"])
    mtp = MultiTokenPredictor(trunk)
    optimizer = torch.optim.AdamW(mtp.parameters(), lr=TRAIN_MTP["lr"], weight_decay=0.01)
    steps = TRAIN_MTP["steps"]
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=TRAIN_MTP["lr"], total_steps=steps)
    data, length = corpus(), TRAIN_MTP["length"]
    generator = torch.Generator().manual_seed(TRAIN_MTP["seed"])
    positions = torch.arange(length - 1)
    mask = torch.ones(length - 1, length - 1, dtype=torch.bool).tril()[None, None]
    start, losses = time.perf_counter(), []
    for step in range(steps):
        starts = torch.randint(0, len(data) - length, (TRAIN_MTP["batch"],), generator=generator)
        batch = data[starts[:, None] + torch.arange(length)]
        with torch.no_grad():
            hidden = trunk.model(input_ids=batch).last_hidden_state  # after the final norm
            embeds = trunk.model.embed_tokens(batch[:, 1:])
            rotary = trunk.model.rotary_emb(hidden, positions.view(1, 1, -1).expand(3, len(batch), -1))
        # Position i reads (h_i, x_{i+1}) and predicts x_{i+2}.
        out = mtp(embeds, hidden[:, :-1], rotary, mask)
        logits = trunk.lm_head(out[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 2:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(
                f"mtp step {step}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)", flush=True
            )
    tensors = {f"mtp.{name}": t.detach().contiguous() for name, t in mtp.state_dict().items()}
    save_file(tensors, str(directory / MTP_FILE))
    report = {
        "settings": settings,
        "mtp_final_loss": sum(losses[-20:]) / 20,
        "trunk_final_loss": json.loads((trunk_dir / MARKER).read_text())["final_loss"],
        "mtp_seconds": time.perf_counter() - start,
    }
    marker.write_text(json.dumps(report, indent=2) + "\n")
    return directory


INERT_MARKER = "inert_model.json"
# Output projections of each mixer: zero in an appended layer, so it adds nothing to the residual stream.
MIXER_OUTPUTS = ("linear_attn.out_proj.weight", "self_attn.o_proj.weight")


def widened_mlp(tensors: dict[str, torch.Tensor], prefix: str, intermediate_size: int) -> None:
    """Widen the MLP under `prefix` to `intermediate_size` units: the added gate / up rows repeat the trained
    ones (realistic activations), their down_proj columns are zero (they contribute exactly nothing)."""
    gate, up, down = (tensors[f"{prefix}mlp.{name}_proj.weight"] for name in ("gate", "up", "down"))
    repeats = -(-intermediate_size // gate.shape[0])
    tensors[f"{prefix}mlp.gate_proj.weight"] = gate.repeat(repeats, 1)[:intermediate_size].contiguous()
    tensors[f"{prefix}mlp.up_proj.weight"] = up.repeat(repeats, 1)[:intermediate_size].contiguous()
    tensors[f"{prefix}mlp.down_proj.weight"] = torch.cat(
        [down, down.new_zeros(down.shape[0], intermediate_size - down.shape[1])], dim=1
    )


def inert_checkpoint(trained: Path, directory: Path, num_layers: int, intermediate_size: int) -> Path:
    """`trained` (an `mtp_checkpoint`) with layers appended up to `num_layers` and every MLP widened to
    `intermediate_size`, all added units inert (see the module docstring); reused when already written."""
    marker = directory / INERT_MARKER
    settings = {
        "trained": json.loads((trained / MTP_MARKER).read_text())["settings"],
        "num_layers": num_layers,
        "intermediate_size": intermediate_size,
    }
    written = json.loads(marker.read_text()) if marker.is_file() else None
    if written is not None and written.pop("logits_max_abs_difference", None) == 0.0 and written == settings:
        return directory
    config = json.loads((trained / "config.json").read_text())
    pattern = config["layer_types"]
    if num_layers % len(pattern) or intermediate_size < config["intermediate_size"]:
        raise ValueError(
            f"num_layers must be a multiple of {len(pattern)} (the trained layer pattern) and "
            f"intermediate_size at least {config['intermediate_size']}: got {num_layers}, {intermediate_size}"
        )
    trunk = load_file(str(trained / "model.safetensors"))
    mtp = load_file(str(trained / MTP_FILE))
    for index in range(len(pattern), num_layers):
        source = f"model.layers.{index % len(pattern)}."
        for name in [n for n in trunk if n.startswith(source)]:
            copied = trunk[name].clone()
            if name.endswith(MIXER_OUTPUTS) or name.endswith("mlp.down_proj.weight"):
                copied.zero_()
            trunk[f"model.layers.{index}.{name[len(source) :]}"] = copied
    for index in range(num_layers):
        widened_mlp(trunk, f"model.layers.{index}.", intermediate_size)
    widened_mlp(mtp, "mtp.layers.0.", intermediate_size)
    directory.mkdir(parents=True, exist_ok=True)
    for item in trained.iterdir():
        if item.is_file() and item.suffix == ".json" and item.name not in ("config.json", MTP_MARKER):
            shutil.copy(item, directory / item.name)
    config.update(
        num_hidden_layers=num_layers,
        intermediate_size=intermediate_size,
        layer_types=pattern * (num_layers // len(pattern)),
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(trunk, str(directory / "model.safetensors"))
    save_file(mtp, str(directory / MTP_FILE))
    # The added units must change nothing: transformers' logits of both checkpoints on held-out text.
    text = corpus(held_out=True)[None, :512].long()
    with torch.no_grad():
        logits = [
            Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32)(text).logits
            for path in (trained, directory)
        ]
    difference = (logits[0] - logits[1]).abs().max().item()
    if difference:
        raise AssertionError(f"the inert units changed the logits (by up to {difference})")
    marker.write_text(json.dumps({**settings, "logits_max_abs_difference": difference}, indent=2) + "\n")
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    args.directory.mkdir(parents=True, exist_ok=True)
    mtp_checkpoint(args.directory)
    print(json.loads((args.directory / MTP_MARKER).read_text()))


if __name__ == "__main__":
    main()
