"""MTP speculative decoding: acceptance per draft position and decode tok/s at batch 1 and 8, k = 0..3.

The model is benchmarks/mtp_model.py's: a small Qwen3.6-architecture model and its MTP layer, trained on
the Python standard library's source (one token per byte); random MTP weights would accept nothing. The
prompts are held-out standard-library text (`--prompt-tokens` bytes each, at fixed offsets); every request
decodes `--new-tokens` tokens greedily without EOS, so every k computes the same tokens (checked:
`same_tokens`). For each k one model is exported (`--backend`, default cpu) and the k's runs alternate
(`--repeats` rounds). Decode tok/s is the batch's tokens after the first ones over the time from the last
first token to the end (prefill excluded); acceptance comes from the engine's stats. Where the time goes:
per engine step, the milliseconds in the backend's decode, verify and MTP calls and in the rest (the
engine's own work), from each k's last run.

    python benchmarks/bench_speculative.py           # trains the model if needed (OpenMP default wait policy:
                                                     # PASSIVE hides the steps behind thread wake-ups here)

That model is small enough that a step's cost is the calls' fixed overhead, and its MTP layer is one of 5
layers. `--num-layers 64 --intermediate-size 4096` runs it with Qwen3.6-27B's cost structure instead
(mtp_model.inert_checkpoint: 60 appended layers and widened MLPs that do their work and add exactly zero, so
the tokens are unchanged): a decode step is bound by reading the weights, and the MTP layer is 1 of 65.

Writes benchmarks/results/bench_speculative.json and .png (or --output and its .png) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from mtp_model import inert_checkpoint, mtp_checkpoint
from text_model import CONFIG, corpus
from timing import alternate, fmt, machine, paired_ratios, spread

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.engine import EngineRequest, SamplingParams
from optimum_qwen36.engine.runner import ModelRunner

RESULTS = Path(__file__).resolve().parent / "results"


def prompts(count: int, length: int) -> list[list[int]]:
    text = corpus(held_out=True)
    stride = (len(text) - length) // count
    return [text[i * stride : i * stride + length].tolist() for i in range(count)]


@contextlib.contextmanager
def backend_calls() -> Iterator[collections.Counter]:
    """Seconds spent in the runner's decode, verify and MTP calls (the backend) while inside."""
    spent: collections.Counter = collections.Counter()
    originals = {name: getattr(ModelRunner, name) for name in ("decode", "verify", "draft")}

    def timed(name: str, real):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = real(*args, **kwargs)
            spent[name] += time.perf_counter() - start
            return out

        return call

    for name, real in originals.items():
        setattr(ModelRunner, name, timed(name, real))
    try:
        yield spent
    finally:
        for name, real in originals.items():
            setattr(ModelRunner, name, real)


def trunk_weight_bytes(checkpoint: Path, dtype: torch.dtype) -> int:
    """Bytes of trunk weights a decode step reads in `dtype` (every `model.*` tensor but the embedding table,
    of which a step gathers one row per token), from the safetensors headers."""
    from safetensors import safe_open

    numel = 0
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as weights:
        for name in weights.keys():  # noqa: SIM118 (a safetensors file is not iterable)
            if name != "model.embed_tokens.weight":
                numel += math.prod(weights.get_slice(name).get_shape())
    return numel * dtype.itemsize


def decode_run(model, batch: list[list[int]], new_tokens: int) -> dict:
    """One engine run of the batch: decode seconds (from the last first token), tokens, acceptance, and
    per decode step the milliseconds in each kind of backend call and in the rest."""
    engine = model.create_engine()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(EngineRequest(prompt, params)) for prompt in batch]
    requests = [engine.request(i) for i in ids]
    engine.step()  # the prefill (one chunk per prompt, batched in one step's plan)
    while any(r.first_token_time is None for r in requests):
        engine.step()
    first, steps = time.monotonic(), 0
    with backend_calls() as spent:
        while engine.has_unfinished():
            engine.step()
            steps += 1
    seconds = time.monotonic() - first
    stats = engine.stats().get("speculative")
    per_step = {name: 1e3 * s / steps for name, s in spent.items()}
    return {
        "seconds": seconds,
        "tokens": sum(len(r.output_ids) - 1 for r in requests),
        "outputs": [r.output_ids for r in requests],
        "drafted": stats["drafted_per_position"] if stats else [],
        "accepted": stats["accepted_per_position"] if stats else [],
        "ms_per_step": {**per_step, "rest": 1e3 * seconds / steps - sum(per_step.values()), "steps": steps},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/optimum-qwen36-mtp-model"))
    parser.add_argument("--backend", default="cpu", choices=("eager", "cpu", "cuda"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    trained = (CONFIG["num_hidden_layers"], CONFIG["intermediate_size"])
    parser.add_argument(
        "--num-layers",
        type=int,
        default=trained[0],
        help="layers: the trained ones, then inert ones (mtp_model.py)",
    )
    parser.add_argument(
        "--intermediate-size",
        type=int,
        default=trained[1],
        help="MLP width: the trained units, then inert ones",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_speculative.json")
    args = parser.parse_args()

    args.model_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = mtp_checkpoint(args.model_dir)
    model_report = json.loads((checkpoint / "mtp_model.json").read_text())
    if (args.num_layers, args.intermediate_size) != trained:
        checkpoint = inert_checkpoint(
            checkpoint,
            args.model_dir.with_name(f"{args.model_dir.name}-{args.num_layers}x{args.intermediate_size}"),
            args.num_layers,
            args.intermediate_size,
        )
    settings = dict(
        backend=args.backend,
        dtype=args.dtype,
        batch_size=max(args.batches),
        sequence_length=args.prompt_tokens + args.new_tokens + 64,
        prefill_chunk_size=args.prompt_tokens,
    )
    models = {}
    export_seconds = {}
    for k in args.ks:
        start = time.perf_counter()
        models[k] = NeuronQwen36ForCausalLM.from_pretrained(
            checkpoint, export=True, num_speculative_tokens=k, **settings
        )
        export_seconds[k] = time.perf_counter() - start
    report = {
        "command": "python benchmarks/bench_speculative.py "
        + " ".join(
            f"--{name.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for name, v in vars(args).items()
            if name not in ("output", "model_dir")
        ),
        "machine": machine(),
        "model": model_report,
        "inert": {"num_layers": args.num_layers, "intermediate_size": args.intermediate_size},
        "settings": settings,
        "trunk_weight_bytes": trunk_weight_bytes(checkpoint, getattr(torch, args.dtype)),
        "export_seconds": export_seconds,
        "batches": {},
    }
    for batch_size in args.batches:
        batch = prompts(batch_size, args.prompt_tokens)
        last: dict[int, dict] = {}

        def measure(k: int, batch: list[list[int]] = batch, last: dict[int, dict] = last):
            def run() -> float:
                result = decode_run(models[k], batch, args.new_tokens)
                last[k] = result
                return result["seconds"]

            return run

        runs = alternate({k: measure(k) for k in args.ks}, repeats=args.repeats)
        tokens = last[args.ks[0]]["tokens"]
        entry = {}
        for k in args.ks:
            drafted, accepted = last[k]["drafted"], last[k]["accepted"]
            entry[str(k)] = {
                "decode_tok_s": spread([tokens / s for s in runs[k]]),
                "acceptance_per_position": [
                    a / d if d else 0.0 for a, d in zip(accepted, drafted, strict=True)
                ],
                "mean_tokens_per_step": 1 + sum(a / drafted[0] for a in accepted) if drafted else 1.0,
                "same_tokens": last[k]["outputs"] == last[args.ks[0]]["outputs"],
                "ms_per_step_last_run": last[k]["ms_per_step"],
            }
            if k and 0 in runs:
                entry[str(k)]["speedup"] = paired_ratios(runs[0], runs[k])
            if k == 0:
                # how close plain decoding comes to streaming the weights at the memory's rate
                step_ms = last[0]["ms_per_step"]["decode"] + last[0]["ms_per_step"]["rest"]
                entry["0"]["trunk_weight_gb_s_last_run"] = report["trunk_weight_bytes"] / step_ms / 1e6
        report["batches"][str(batch_size)] = entry
        print(f"batch {batch_size}:")
        for k in args.ks:
            e = entry[str(k)]
            acceptance = " / ".join(f"{a:.2f}" for a in e["acceptance_per_position"]) or "-"
            speedup = f"  x{fmt(e['speedup'], 2)}" if "speedup" in e else ""
            split = ", ".join(f"{n} {v:.2f}" for n, v in e["ms_per_step_last_run"].items() if n != "steps")
            print(
                f"  k={k}: {fmt(e['decode_tok_s'])} tok/s{speedup}  acceptance {acceptance}  "
                f"tokens/step {e['mean_tokens_per_step']:.2f}  same tokens {e['same_tokens']}  "
                f"ms per step: {split}"
            )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    chart(report, args.output.with_suffix(".png"))
    print(f"wrote {args.output}")


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report["batches"]), figsize=(4 * len(report["batches"]), 3.5))
    axes = [axes] if len(report["batches"]) == 1 else axes
    for ax, (batch, entry) in zip(axes, report["batches"].items(), strict=True):
        ks = list(entry)
        medians = [entry[k]["decode_tok_s"]["median"] for k in ks]
        low = [m - entry[k]["decode_tok_s"]["min"] for m, k in zip(medians, ks, strict=True)]
        high = [entry[k]["decode_tok_s"]["max"] - m for m, k in zip(medians, ks, strict=True)]
        ax.bar(ks, medians, yerr=[low, high], capsize=4)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("num_speculative_tokens")
        ax.set_ylabel("decode tok/s (median, min-max)")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
