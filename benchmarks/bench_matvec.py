"""Weight-streaming rate of decode-sized linear layers: ATen's `F.linear` against `matrix_vector_linear` (the
cpu backend's one-row form, optimum_qwen36/exporters/matvec.py), for float32 `weight_major_linear` (its form
for more rows: weight @ x.T) and, for bf16 where it has a vector path (AVX-512 BF16, or AVX2 + FMA), the
native kernel `optimum_qwen36::bf16_linear` (what every bf16 decode graph runs), each compiled by Inductor.

Shapes: the projections of 16 layers of the bench_generate model (hidden 1024, MLP 3584, GDN 16 heads of
128, attention 8 + 2 heads of 256, 3 GDN layers per attention layer; 663 MB in bf16, far more than the
caches, so the weights come from memory as in a decode step), and the 248320 x 1024 output projection alone
(508 MB); with `--shapes qwen3.6-27b`, Qwen3.6-27B's (hidden 5120, MLP 17408, GDN 16 key / 48 value heads
of 128, attention 24 + 4 heads of 256: 4 layers are 3.0 GB in bf16) and its 248320 x 5120 output projection.
GB/s = weight bytes read / time of one call, each way compiled by Inductor as one graph over all
the weights (as in the exported step graphs); --repeats runs after a warm-up, the two ways alternated run by
run (same machine load), kept with min / median / max (the median is the headline figure). `--rows`: one
row (batch-1 decode), and 8 rows by default, which the one-row form reads once per row. `--fp8`: instead,
`bf16_linear` on the bf16 weights against `fp8_linear` on their FP8 copies (what `quantization="fp8"` with
`fp8_modules="linear"` reads: Qwen's releases keep the output projection in bf16); `--int4`: the same against
`int4_linear` on 4-bit copies in groups of 128 (what `quantization="int4"` reads). `--huge-pages`: instead,
`bf16_linear` on the weights as torch allocates them (4 KB pages, unless the OS's transparent huge pages are
`always`) against the same weights moved into huge pages (`ops.huge_pages.move_to_huge_pages`, as the cpu
backend places a model's weights).

    python benchmarks/bench_matvec.py        # bf16, the machine's threads
    python benchmarks/bench_matvec.py --dtype float32 --rows 1 2 4 8
    python benchmarks/bench_matvec.py --layers 4 --skip-output-projection --repeats 3 --output /tmp/mv.json
    python benchmarks/bench_matvec.py --shapes qwen3.6-27b --layers 4 --rows 1 2 3 4 8 \
        --skip-output-projection --output benchmarks/results/bench_matvec_27b.json
    python benchmarks/bench_matvec.py --shapes qwen3.6-27b --layers 4 --rows 1 2 4 8 --fp8 \
        --skip-output-projection --output benchmarks/results/bench_matvec_27b_fp8.json
    python benchmarks/bench_matvec.py --shapes qwen3.6-27b --layers 4 --rows 1 2 4 8 --int4 \
        --skip-output-projection --output benchmarks/results/bench_matvec_27b_int4.json
    python benchmarks/bench_matvec.py --huge-pages --rows 1 2 8 \
        --output benchmarks/results/bench_matvec_huge_pages.json

Writes benchmarks/results/bench_matvec.json.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import alternate, command_line, fmt, machine, paired_ratios, rates, wall

from optimum_qwen36.exporters.matvec import matrix_vector_linear, weight_major_linear
from optimum_qwen36.ops.fp8 import DEFAULT_BLOCK_SIZE, fp8_linear, quantize_fp8
from optimum_qwen36.ops.huge_pages import THP_SETTING, move_to_huge_pages, transparent_huge_pages
from optimum_qwen36.ops.int4 import DEFAULT_GROUP_SIZE, int4_linear, quantize_int4
from optimum_qwen36.ops.native import bf16_linear_vectorized

RESULTS = Path(__file__).resolve().parent / "results"
# (out, in) of each projection of 4 layers (3 GDN + 1 attention): GDN in_proj_qkv, z, b, a, out_proj; MLP
# gate, up, down; attention q (with its gate), k, v, o. And (hidden, vocab) for the output projection.
MODELS = {
    "bench-model": dict(
        hidden=1024,
        mlp=3584,
        gdn=(4096, 2048, 16),
        attention=(4096, 512, 2048),
        vocab=248320,
    ),
    "qwen3.6-27b": dict(
        hidden=5120,
        mlp=17408,
        gdn=(4096, 6144, 48),
        attention=(12288, 1024, 6144),
        vocab=248320,
    ),
}


def layer_shapes(model: dict) -> list[tuple[int, int]]:
    """The projections of 4 layers (3 GDN + 1 attention) of `model` (a MODELS entry), as (out, in)."""
    hidden, (qk, v, heads), (q, kv, o) = model["hidden"], model["gdn"], model["attention"]
    mlp = [(model["mlp"], hidden), (model["mlp"], hidden), (hidden, model["mlp"])]
    gdn = [(qk + v, hidden), (v, hidden), (heads, hidden), (heads, hidden), (hidden, v)]
    attention = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, o)]
    return (gdn + mlp) * 3 + attention + mlp


def one_row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """matrix_vector_linear for each row of x [rows, 1, in] (a one-row graph run once per row)."""
    return torch.cat([matrix_vector_linear(row, weight, None) for row in x.split(1)])


def weight_major(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight_major_linear(x, weight, None)


def native_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.optimum_qwen36.bf16_linear(x, weight, None)


def fp8_copy(weight: torch.Tensor) -> tuple[Callable, tuple[torch.Tensor, ...]]:
    """A block-scaled e4m3 copy (128 x 128 blocks, as Qwen's FP8 releases and `quantization="fp8"`) and the
    kernel that reads it."""
    return (lambda x, q, s: fp8_linear(x, q, s, DEFAULT_BLOCK_SIZE)), quantize_fp8(weight)


def int4_copy(weight: torch.Tensor) -> tuple[Callable, tuple[torch.Tensor, ...]]:
    """A 4-bit copy (groups of 128, as `quantization="int4"`) and the kernel that reads it."""
    return (lambda x, *held: int4_linear(x, *held, DEFAULT_GROUP_SIZE)), quantize_int4(
        weight, DEFAULT_GROUP_SIZE
    )


QUANTIZED_COPIES = {"fp8_linear": fp8_copy, "int4_linear": int4_copy}


def quantized_rates(kernel: str, weights: list[torch.Tensor], rows: int, repeats: int) -> dict:
    """`bf16_linear` on bf16 `weights` against `kernel` (fp8_linear, int4_linear) on their quantized copies:
    GB/s of the bytes each reads (quantized weights with their scales and zero points), and the time ratio
    per round (`bf16_linear_over_<kernel>`: the decode speed-up where the projections are the step)."""
    copies = [QUANTIZED_COPIES[kernel](w) for w in weights]
    inputs = [torch.randn(rows, 1, w.shape[1]).to(w.dtype) for w in weights]
    measures = {
        "bf16_linear": wall(lambda: [native_linear(x, w) for x, w in zip(inputs, weights, strict=True)]),
        kernel: wall(lambda: [linear(x, *held) for x, (linear, held) in zip(inputs, copies, strict=True)]),
    }
    runs = alternate(measures, repeats)
    quantized_bytes = sum(t.numel() * t.element_size() for _, held in copies for t in held)
    return {
        "bf16_linear": rates(sum(w.numel() * w.element_size() for w in weights) / 1e9, runs["bf16_linear"]),
        kernel: rates(quantized_bytes / 1e9, runs[kernel]),
        f"bf16_linear_over_{kernel}": paired_ratios(runs["bf16_linear"], runs[kernel]),
    }


def huge_page_rates(weights: list[torch.Tensor], rows: int, repeats: int) -> dict:
    """`bf16_linear` on `weights` as allocated against copies moved into transparent huge pages: GB/s, and the
    time ratio per round (`4k_pages_over_huge_pages`: the speed-up of huge pages)."""
    moved = torch.nn.ParameterList(torch.nn.Parameter(w.clone(), requires_grad=False) for w in weights)
    move_to_huge_pages(moved)
    inputs = [torch.randn(rows, 1, w.shape[1]).to(w.dtype) for w in weights]
    measures = {
        "4k_pages": wall(lambda: [native_linear(x, w) for x, w in zip(inputs, weights, strict=True)]),
        "huge_pages": wall(lambda: [native_linear(x, w) for x, w in zip(inputs, moved, strict=True)]),
    }
    runs = alternate(measures, repeats)
    total = sum(w.numel() * w.element_size() for w in weights) / 1e9
    return {
        "4k_pages": rates(total, runs["4k_pages"]),
        "huge_pages": rates(total, runs["huge_pages"]),
        "4k_pages_over_huge_pages": paired_ratios(runs["4k_pages"], runs["huge_pages"]),
    }


def streaming_rates(weights: list[torch.Tensor], rows: int, repeats: int) -> dict:
    """GB/s of weights read by all of `weights` applied to `rows` rows, each way compiled as one graph (as in
    the exported step graphs, whose linears are ATen matrix products, one-row sums or the native kernel)."""
    inputs = [torch.randn(rows, 1, w.shape[1]).to(w.dtype) for w in weights]
    total = sum(w.numel() * w.element_size() for w in weights)
    ways = [("F.linear", F.linear), ("matrix_vector_linear", one_row_linear)]
    if weights[0].dtype == torch.float32:
        ways.append(("weight_major_linear", weight_major))
    if weights[0].dtype == torch.bfloat16 and bf16_linear_vectorized():
        ways.append(("bf16_linear", native_linear))
    measures = {}
    # Each way compiles the same function anew: without a reset, dynamo's recompile limit would make the
    # later sets run eagerly.
    torch._dynamo.reset()
    for name, linear in ways:

        def apply_all(xs: list[torch.Tensor], ws: list[torch.Tensor], linear=linear) -> list[torch.Tensor]:
            return [linear(x, w) for x, w in zip(xs, ws, strict=True)]

        graph = torch.compile(apply_all)
        measures[name] = wall(lambda graph=graph: graph(inputs, weights))
    runs = alternate(measures, repeats)
    result = {name: rates(total / 1e9, seconds) for name, seconds in runs.items()}
    for name in measures:
        if name != "F.linear":
            result[f"{name}_over_F.linear"] = paired_ratios(runs["F.linear"], runs[name])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--shapes", default="bench-model", choices=sorted(MODELS), help="whose projections")
    parser.add_argument("--layers", type=int, default=16, help="layers' projections (multiple of 4)")
    parser.add_argument("--skip-output-projection", action="store_true")
    parser.add_argument(
        "--fp8", action="store_true", help="bf16_linear against fp8_linear on FP8 copies (bf16 only)"
    )
    parser.add_argument(
        "--int4", action="store_true", help="bf16_linear against int4_linear on 4-bit copies (bf16 only)"
    )
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="bf16_linear on weights in 4 KB pages against the same in transparent huge pages (bf16 only)",
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="x rows per call")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (after one warm-up)")
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_matvec.json")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (the JSON reports min / median / max)")
    quantized = "fp8_linear" if args.fp8 else "int4_linear" if args.int4 else None
    if quantized and (args.dtype != "bfloat16" or not bf16_linear_vectorized()):
        parser.error(
            "--fp8 / --int4 compare the bf16 and quantized kernels: they need --dtype bfloat16 and "
            "bf16_linear's vector path"
        )
    if args.huge_pages and (args.dtype != "bfloat16" or not bf16_linear_vectorized()):
        parser.error("--huge-pages times bf16_linear: it needs --dtype bfloat16 and its vector path")
    if args.huge_pages and not transparent_huge_pages():
        parser.error(f"--huge-pages: this OS gives no transparent huge pages ({THP_SETTING})")
    if sum((args.fp8, args.int4, args.huge_pages)) > 1:
        parser.error("--fp8, --int4 and --huge-pages are separate comparisons: pass one")
    if args.layers < 4 or args.layers % 4:
        parser.error("--layers must be a positive multiple of 4 (3 GDN layers per attention layer)")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    sets = [
        (
            f"{args.layers} layers' projections",
            [torch.randn(*s).to(dtype) for s in layer_shapes(MODELS[args.shapes]) * (args.layers // 4)],
        )
    ]
    if not args.skip_output_projection:
        model = MODELS[args.shapes]
        sets.append(("output projection", [torch.randn(model["vocab"], model["hidden"]).to(dtype)]))
    report: dict = {
        "command": command_line(),
        "dtype": args.dtype,
        "shapes": args.shapes,
        "machine": machine(),
        "repeats": args.repeats,
        "transparent_huge_pages": THP_SETTING.read_text().strip() if THP_SETTING.is_file() else None,
        "weight_bytes": {},
        "gb_per_s": {},
    }
    for label, weights in sets:
        report["weight_bytes"][label] = sum(w.numel() * w.element_size() for w in weights)
        for rows in args.rows:
            rates_of = huge_page_rates if args.huge_pages else streaming_rates
            if quantized:
                rates_of = functools.partial(quantized_rates, quantized)
            result = rates_of(weights, rows, args.repeats)
            report["gb_per_s"][f"{label}, {rows} row(s)"] = result
            print(
                f"{label:24s} rows={rows}: "
                + "  ".join(
                    f"{k} {fmt(v, 2, 'x')}" if "_over_" in k else f"{k} {fmt(v)} GB/s"
                    for k, v in result.items()
                ),
                flush=True,
            )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
