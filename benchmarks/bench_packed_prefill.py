"""Packed prefill against one sequence per call, on the engine's model: several requests' chunks in one
prefill call (`ModelRunner.prefill_packed`) or each in its own call (`ModelRunner.prefill`), the same
tokens at the same positions in the same slots, alternated round by round.

Cases: `--sequences` chunks of `--tokens` tokens each (default 4 x 64, 2 x 128, 8 x 32: what a step holds
when short prompts arrive together or a warm prefix-cache request's suffix is short). Also timed, for what
a step's decode rows cost in their own decode call against riding in the packed prefill (the engine's
choice where the backend takes them): one decode call of `--batch-size` rows, and ATen's bf16 matrix
product over the model's projection shapes at `--chunk` rows and at `--chunk` + `--batch-size` rows.

Default model: bench_generate.py's random 0.75B model (24 layers) in bfloat16, as bench_engine.py exports it.

    python benchmarks/bench_packed_prefill.py --model /tmp/ckpt     # bench_generate.py --write-checkpoint
    python benchmarks/bench_packed_prefill.py --layers 4 --repeats 3 --output /tmp/packed.json

Writes benchmarks/results/bench_packed_prefill.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_generate import random_checkpoint
from bench_matvec import MODELS, layer_shapes
from timing import alternate, command_line, fmt, machine, paired_ratios, spread, wall

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.engine.runner import ModelRunner, PackedChunk
from optimum_qwen36.network.cache import CacheStorage

RESULTS = Path(__file__).resolve().parent / "results"


def packed_cases(runner: ModelRunner, cases: list[tuple[int, int]], repeats: int) -> dict:
    tables = runner.cache.block_tables
    generator = torch.Generator().manual_seed(0)
    results = {}
    for count, tokens in cases:
        chunks = [
            PackedChunk(torch.randint(1, 1000, (tokens,), generator=generator), 0, slot, tables[slot])
            for slot in range(count)
        ]
        runs = alternate(
            {
                "packed": wall(lambda chunks=chunks: runner.prefill_packed(chunks)),
                "one per call": wall(lambda chunks=chunks: [runner.prefill(c) for c in chunks]),
            },
            repeats,
        )
        results[f"{count} x {tokens}"] = {
            "packed_s": spread(runs["packed"]),
            "one_per_call_s": spread(runs["one per call"]),
            "one_per_call_over_packed": paired_ratios(runs["one per call"], runs["packed"]),
        }
    return results


def decode_call(runner: ModelRunner, rows: int, context: int, repeats: int) -> dict:
    tables = runner.cache.block_tables
    for slot in range(rows):  # each row's context
        for start in range(0, context, runner.prefill_chunk_size):
            tokens = torch.randint(1, 1000, (min(runner.prefill_chunk_size, context - start),))
            runner.prefill(PackedChunk(tokens, start, slot, tables[slot]))
    slots = torch.arange(rows)
    step = wall(
        lambda: runner.decode(
            torch.ones(rows, dtype=torch.long), torch.full((rows,), context), slots, tables[:rows]
        )
    )
    return spread(alternate({"decode": step}, repeats)["decode"])


def gemm_rows(shape: str, chunk: int, extra: int, repeats: int) -> dict:
    """ATen's bf16 products over one layer group's projections (bench_matvec's shapes) at chunk and
    chunk + extra rows."""
    weights = [torch.randn(out, inp).bfloat16() for out, inp in layer_shapes(MODELS[shape])]
    inputs = {
        rows: {w.shape[1]: torch.randn(rows, w.shape[1]).bfloat16() for w in weights}
        for rows in (chunk, chunk + extra)
    }

    def products(rows: int) -> None:
        for w in weights:
            F.linear(inputs[rows][w.shape[1]], w)

    runs = alternate({rows: wall(lambda rows=rows: products(rows)) for rows in inputs}, repeats)
    flop = {rows: sum(2 * rows * w.numel() for w in weights) for rows in inputs}
    return {
        f"{rows} rows": {
            "s": spread(runs[rows]),
            "gflop_per_s": spread([flop[rows] / s / 1e9 for s in runs[rows]]),
        }
        for rows in inputs
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a checkpoint (default: a random model of --layers layers)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--chunk", type=int, default=256, help="prefill_chunk_size")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--cases", nargs="+", default=["4x64", "2x128", "8x32"], help="SEQUENCESxTOKENS")
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile-cache-dir", type=Path)
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_packed_prefill.json")
    args = parser.parse_args()
    cases = [tuple(int(n) for n in case.split("x")) for case in args.cases]

    with tempfile.TemporaryDirectory(prefix="bench-packed-") as tmp:
        checkpoint = (
            Path(args.model)
            if args.model
            else random_checkpoint(Path(tmp) / "ckpt", args.layers, torch.bfloat16)
        )
        model = NeuronQwen36ForCausalLM.from_pretrained(
            checkpoint, export=True, backend="cpu", dtype="bfloat16", batch_size=args.batch_size,
            sequence_length=args.decode_context + args.chunk, prefill_chunk_size=args.chunk,
            compile_cache_dir=args.compile_cache_dir,
        )  # fmt: skip
        if not model.backend.packs_prefill:
            raise SystemExit("this CPU's prefill graphs take one sequence per call (no native GDN chunk op)")
        runner = ModelRunner(
            model.backend,
            CacheStorage.for_settings(
                model.model.config, model.neuron_config, snapshot_slots=model.backend.prefill_snapshots
            ),
            args.chunk,
        )
        report = {
            "command": command_line(),
            "machine": machine(),
            "model": args.model or f"random {args.layers}-layer Qwen3.6-shaped model (bfloat16)",
            "prefill_chunk_size": args.chunk,
            "batch_size": args.batch_size,
            "repeats": args.repeats,
            "packed": packed_cases(runner, cases, args.repeats),
            "decode_call_s": decode_call(runner, args.batch_size, args.decode_context, args.repeats),
            "decode_context": args.decode_context,
            "bf16_products_per_4_layers": gemm_rows("bench-model", args.chunk, args.batch_size, args.repeats),
        }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    for name, case in report["packed"].items():
        packed, alone = fmt(case["packed_s"], 3), fmt(case["one_per_call_s"], 3)
        ratio = fmt(case["one_per_call_over_packed"], 2)
        print(f"{name:>9}: packed {packed} s, one per call {alone} s, ratio {ratio}x")
    print(
        f"decode call of {args.batch_size} rows at {args.decode_context}: {fmt(report['decode_call_s'], 3)} s"
    )
    for rows, entry in report["bf16_products_per_4_layers"].items():
        print(f"bf16 products, {rows}: {fmt(entry['s'], 4)} s, {fmt(entry['gflop_per_s'], 0)} GFLOP/s")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
