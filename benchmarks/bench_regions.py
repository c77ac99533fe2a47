"""Regional compilation against whole-model graphs: compile time, and what calling one graph per layer costs.

In one process, the random model of `bench_generate.py`'s shape (hidden 1024, 3 GDN : 1 attention, vocab
248320, tied) is compiled both ways: by regions, as `from_pretrained(..., export=True)` does (one graph per
layer kind and the head, exporters/regions.py), and as one whole-model graph per step (the same model
methods `prefill_chunk` / `decode_step`, the same dynamic dimensions, decode_row traced as matrix-vector
products as well). Both are then called on the same inputs, alternated round by round, and the ratio of
their times is taken within each round.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_regions.py            # 8 layers, ~15 min on 2 cores
    python benchmarks/bench_regions.py --layers 4 --repeats 3 --calls 2   # a smoke run

Writes benchmarks/results/bench_regions.json (or --output) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_generate import random_checkpoint
from timing import alternate, fmt, machine, paired_ratios, spread, wall

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.backends.base import blocks_in_use
from optimum_qwen36.backends.compiled_graph import CompiledGraph, model_tensors
from optimum_qwen36.exporters.aoti import compile_method
from optimum_qwen36.exporters.compile_aoti import graphs_to_compile, linears_mode
from optimum_qwen36.exporters.example_args import example_step_args
from optimum_qwen36.network.cache import CacheStorage
from optimum_qwen36.ops.native import bf16_linear_vectorized, bf16_matmul_instructions

RESULTS = Path(__file__).resolve().parent / "results"
METHOD = {"prefill_chunk": "prefill_chunk", "decode_row": "decode_step", "decode_step": "decode_step"}


def whole_dynamic_shapes(step: str, args: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """The dimensions the region graphs leave dynamic, on a whole step's arguments: KV blocks, block table
    width, decode_step's batch (arguments end with block table(s), key, value, conv, recurrent caches)."""
    blocks = torch.export.Dim("num_kv_blocks", min=2)
    kv = ({1: blocks}, {1: blocks}, None, None)
    max_blocks, rows = args[-5].shape[-1], args[0].shape[0]
    width = torch.export.Dim("blocks_per_row", min=1, max=max_blocks)
    if step == "prefill_chunk":
        return (None, None, None, None, {0: width}, *kv)
    batch = {0: torch.export.Dim("batch", min=2, max=rows)} if step == "decode_step" else None
    table = {0: batch[0], 1: width} if batch else {1: width}
    return (batch, batch, batch, table, *kv)


def timed_args(step: str, examples: dict, position: int) -> tuple[torch.Tensor, ...]:
    """A step's arguments with every row at `position` (decode) or a full chunk there (prefill), block tables
    cut to the blocks in use, as the backend passes them."""
    args = list(examples[step])
    if step == "prefill_chunk":
        args[1] = torch.tensor(position)
    else:
        args[1] = torch.full_like(args[1], position)
    return blocks_in_use(METHOD[step], tuple(args))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--position", type=int, default=512, help="context length of the timed steps")
    parser.add_argument("--calls", type=int, default=4, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_regions.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dtype = getattr(torch, args.dtype)
    scratch = Path(tempfile.mkdtemp(prefix="bench-regions-"))
    checkpoint = random_checkpoint(scratch / "checkpoint", args.layers, dtype)

    # The first AOTInductor compile of a process also precompiles its headers: pay that before either side.
    compile_method(torch.nn.Linear(8, 8), "forward", (torch.zeros(2, 8),), scratch / "warmup.pt2")

    chunk = 256
    settings = dict(
        batch_size=args.batch_size,
        sequence_length=args.position + chunk,
        prefill_chunk_size=chunk,
        dtype=args.dtype,
    )
    start = time.perf_counter()
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint, export=True, backend="cpu", compile_cache_dir=scratch / "compile_cache", **settings
    )
    regions_export_s = time.perf_counter() - start
    regional = model.backend.graphs
    cache_hits = []
    for _ in range(3):  # what a second export of the same model and settings (or loading an artifact) costs
        start = time.perf_counter()
        NeuronQwen36ForCausalLM.from_pretrained(
            checkpoint, export=True, backend="cpu", compile_cache_dir=scratch / "compile_cache", **settings
        )
        cache_hits.append(time.perf_counter() - start)

    examples = example_step_args(
        model.neuron_config, CacheStorage.for_settings(model.model.config, model.neuron_config)
    )
    tensors = model_tensors(model.model)
    whole, whole_compile_s = {}, {}
    for step in graphs_to_compile(model.neuron_config):
        start = time.perf_counter()
        path = scratch / f"whole-{step}.pt2"
        constants = compile_method(
            model.model,
            METHOD[step],
            examples[step],
            path,
            dynamic_shapes=whole_dynamic_shapes(step, examples[step]),
            tracing_mode=linears_mode(step, bf16_linear_vectorized(), bf16_matmul_instructions()),
        )
        whole_compile_s[step] = time.perf_counter() - start
        whole[step] = CompiledGraph(path, {**tensors, **constants})

    results: dict[str, dict] = {}
    for step in whole:
        step_args = timed_args(step, examples, args.position)

        def calls(graph: Any, step_args: tuple = step_args) -> None:
            with torch.no_grad():
                for _ in range(args.calls):
                    graph(*step_args)

        runs = alternate(
            {
                "whole": wall(lambda graph=whole[step]: calls(graph)),
                "regions": wall(lambda graph=regional[step]: calls(graph)),
            },
            args.repeats,
        )
        results[step] = {
            "whole_ms_per_call": spread([1e3 * s / args.calls for s in runs["whole"]]),
            "regions_ms_per_call": spread([1e3 * s / args.calls for s in runs["regions"]]),
            "regions_over_whole_time": paired_ratios(runs["regions"], runs["whole"]),
        }
    report = {
        "command": "OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_regions.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "output"),
        "machine": machine(),
        "layers": args.layers,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "position": args.position,
        "compile_s": {
            "regions (from_pretrained export, all steps)": regions_export_s,
            "regions, compile cache hit (from_pretrained export)": spread(cache_hits),
            "whole-model graphs": whole_compile_s,
            "whole-model graphs, total": sum(whole_compile_s.values()),
        },
        "steps": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{args.layers} layers, {args.dtype}: compile by regions {regions_export_s:.0f} s (export), "
        f"whole-model graphs {report['compile_s']['whole-model graphs, total']:.0f} s"
    )
    print("| step | whole ms/call | regions ms/call | regions / whole (per round) |")
    print("| --- | --- | --- | --- |")
    for step, r in results.items():
        print(
            f"| {step} | {fmt(r['whole_ms_per_call'], 2)} | {fmt(r['regions_ms_per_call'], 2)} | "
            f"{fmt(r['regions_over_whole_time'], 3)} |"
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
