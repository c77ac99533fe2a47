"""Generation speed of a compiled backend (`cpu`, or `cuda` on a GPU) against transformers eager on the same
device, same weights and dtype.

Measures, in one run: prefill tok/s at each prompt length (one row), decode tok/s at batch 1 and at the
compiled batch, for our backend (AOTInductor) and transformers' Qwen3_5ForCausalLM; the device's read
bandwidth and the decode roofline (bytes of weights read per token / bandwidth). Default model: a
random ~0.8B model of the Qwen3.6 shape family (hidden 1024, 24 layers 3:1, 8/2 attention heads of 256,
16/16 GDN heads of 128, vocab 248320, tied embeddings).

    python benchmarks/bench_generate.py                      # the ~0.8B model (compiling takes a while)
    python benchmarks/bench_generate.py --layers 4           # same widths, 4 layers: a quick run
    python benchmarks/bench_generate.py --model PATH_OR_ID   # a real checkpoint
    python benchmarks/bench_generate.py --backend cuda       # on a GPU (.ci/device_check runs it)

Writes benchmarks/results/bench_generate.json and .png. Compiled graphs are kept in the compile cache, so
a second run with the same settings does not compile again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from optimum_qwen36 import NeuronQwen36ForCausalLM

RESULTS = Path(__file__).resolve().parent / "results"


def random_checkpoint(directory: Path, layers: int, dtype: torch.dtype) -> Path:
    config = Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
        + ["linear_attention"] * (layers % 4),
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        dtype=str(dtype).removeprefix("torch."),
    )
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(config).to(dtype).save_pretrained(directory)
    return directory


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Minimum wall time over repeats (the machine may be shared: the minimum is the least disturbed). GPU
    work is waited for, so that each time covers what fn launched."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth_gbs(device: str, gigabytes: float = 1.0) -> float:
    data = torch.ones(int(gigabytes * 2**30 / 4), dtype=torch.float32, device=device)
    seconds = best_time(lambda: data.sum(), repeats=5)
    return data.numel() * 4 / seconds / 1e9


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter once, except the embedding table (one row is
    gathered) unless it is tied to the output projection, which reads all of it."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == embedding.data_ptr()
    return total if tied else total - embedding.numel() * embedding.element_size()


def prompts(length: int, rows: int, vocab: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(length)
    return torch.randint(1, min(vocab, 200_000), (rows, length), generator=generator).to(device)


def bench_ours(model: NeuronQwen36ForCausalLM, lengths: list[int], batch: int, steps: int) -> dict:
    model.generation_config.eos_token_id = None  # random weights: never stop early

    def generate(ids: torch.Tensor, new: int) -> None:
        model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)

    results: dict = {"prefill_tok_s": {}, "decode_tok_s": {}}
    for length in lengths:
        ids = prompts(length, 1, model.config.vocab_size)
        results["prefill_tok_s"][length] = length / best_time(lambda ids=ids: generate(ids, 1), repeats=2)
    for rows in sorted({1, batch}):
        ids = prompts(16, rows, model.config.vocab_size)
        first = best_time(lambda ids=ids: generate(ids, 1), repeats=2)
        full = best_time(lambda ids=ids: generate(ids, steps + 1), repeats=2)
        results["decode_tok_s"][rows] = rows * steps / (full - first)
    return results


@torch.no_grad()
def bench_transformers(model: torch.nn.Module, lengths: list[int], batch: int, steps: int) -> dict:
    vocab, device = model.config.vocab_size, str(model.device)
    results: dict = {"prefill_tok_s": {}, "decode_tok_s": {}}
    for length in lengths:
        ids = prompts(length, 1, vocab, device)
        results["prefill_tok_s"][length] = length / best_time(lambda ids=ids: model(ids), repeats=2)

    def generate(ids: torch.Tensor, new: int) -> None:
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    for rows in sorted({1, batch}):
        ids = prompts(16, rows, vocab, device)
        first = best_time(lambda ids=ids: generate(ids, 1), repeats=2)
        full = best_time(lambda ids=ids: generate(ids, steps + 1), repeats=2)
        results["decode_tok_s"][rows] = rows * steps / (full - first)
    return results


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    systems = list(report["results"])
    for axis, metric, title in ((left, "prefill_tok_s", "prefill"), (right, "decode_tok_s", "decode")):
        keys = list(report["results"][systems[0]][metric])
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            values = [report["results"][system][metric][k] for k in keys]
            axis.bar([j + i * width for j in range(len(keys))], values, width, label=system)
        axis.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(keys))])
        label = "prompt tokens" if metric == "prefill_tok_s" else "batch"
        axis.set_xticklabels([f"{label} {k}" for k in keys])
        axis.set_ylabel("tokens / s")
        where = report["device"] if report["backend"] == "cuda" else f"{report['threads']} threads"
        axis.set_title(f"{title} ({report['dtype']}, {where})")
    right.axhline(report["decode_roofline_tok_s"], color="k", linestyle="--", label="batch-1 roofline")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint directory or Hub id (default: a random ~0.8B model)")
    parser.add_argument("--layers", type=int, default=24, help="layers of the random model (default 24)")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch-size", type=int, default=8, help="compiled batch (decode is also run at 1)")
    parser.add_argument("--prefill-chunk-size", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_generate.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.model or str(random_checkpoint(Path(tmp) / "model", args.layers, dtype))
        start = time.perf_counter()
        ours = NeuronQwen36ForCausalLM.from_pretrained(
            checkpoint,
            export=True,
            backend=args.backend,
            dtype=args.dtype,
            batch_size=args.batch_size,
            sequence_length=max(args.prompt_lengths) + args.decode_steps + 16,
            prefill_chunk_size=args.prefill_chunk_size,
        )
        export_seconds = time.perf_counter() - start
        device = ours.backend.device
        bandwidth = read_bandwidth_gbs(device)
        reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval().to(device)
        per_token = weight_bytes_per_token(reference)
        report = {
            "model": args.model or f"random Qwen3.6-shaped, {args.layers} layers",
            "parameters": sum(p.numel() for p in reference.parameters()),
            "dtype": args.dtype,
            "backend": args.backend,
            "device": torch.cuda.get_device_name(device) if args.backend == "cuda" else "cpu",
            "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
            "export_seconds_incl_compile_or_cache_hit": export_seconds,
            "read_bandwidth_gb_s": bandwidth,
            "weight_bytes_per_token": per_token,
            "decode_roofline_tok_s": bandwidth * 1e9 / per_token,
            "results": {
                f"optimum-qwen36 {args.backend}": bench_ours(
                    ours, args.prompt_lengths, args.batch_size, args.decode_steps
                )
            },
        }
        del ours
        if not args.skip_transformers:
            report["results"]["transformers eager"] = bench_transformers(
                reference, args.prompt_lengths, args.batch_size, args.decode_steps
            )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    chart(report, args.output.with_suffix(".png"))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
