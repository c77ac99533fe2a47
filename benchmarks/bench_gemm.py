"""The machine's matrix-product rates through ATen (`torch.mm`), float32 and bfloat16, at 1 and all threads:
the ceiling a prefill can reach here, and whether bfloat16 has hardware support (without avx512_bf16 or AMX,
ATen's bf16 products fall far below float32's, and a bf16 model should be exported in float32 on this CPU).

    python benchmarks/bench_gemm.py                   # 1024^3 products, 5 runs each (about a minute)
    python benchmarks/bench_gemm.py --size 256 --repeats 3 --output /tmp/gemm.json

Writes benchmarks/results/bench_gemm.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from timing import command_line, fmt, machine, spread, wall

RESULTS = Path(__file__).resolve().parent / "results"


def gflop_per_s(size: int, dtype: torch.dtype, threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    product = wall(lambda: torch.mm(a, b))
    product()  # warm-up
    return spread([2 * size**3 / product() / 1e9 for _ in range(repeats)])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=1024, help="square matrices of this size (default 1024)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_gemm.json")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (the JSON reports min / median / max)")
    all_threads = torch.get_num_threads()
    described = machine()
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        for threads in sorted({1, all_threads}):
            name = f"{str(dtype).removeprefix('torch.')}, {threads} thread(s)"
            rates[name] = gflop_per_s(args.size, dtype, threads, args.repeats)
            print(f"{name:24s} {fmt(rates[name], 1, ' GFLOP/s')}", flush=True)
    torch.set_num_threads(all_threads)
    result = {
        "command": command_line(),
        "machine": described,
        "size": args.size,
        "repeats": args.repeats,
        "gflop_per_s": rates,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
