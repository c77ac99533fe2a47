"""The machine's matrix-product rates through ATen (`torch.mm`), float32 and bfloat16, at 1 and all threads:
the ceiling a prefill can reach here, and whether bfloat16 has hardware support (without avx512_bf16 or AMX,
ATen's bf16 products fall far below float32's, and a bf16 model should be exported in float32 on this CPU).

With avx512_bf16 (and no AMX) it also measures the bf16 instruction peak: a loop of independent `vdpbf16ps`
on registers (64 FLOP each), at 1 and all threads. No bf16 product on this CPU can run faster, so ATen's
rate over it is how much of the hardware a prefill's projections use.

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


PEAK_SOURCE = r"""
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <chrono>
#include <torch/extension.h>

// Twelve independent accumulators: enough to cover vdpbf16ps's latency at its throughput.
__attribute__((target("avx512f,avx512bf16"))) static float dpbf16_loop(int64_t iterations) {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80);  // 1.0
  const __m512bh y = (__m512bh)_mm512_set1_epi16(0x2f80);  // 2^-32: the sums stay finite
  for (int64_t n = 0; n < iterations; ++n) {
#pragma GCC unroll 12
    for (auto& a : acc) a = _mm512_dpbf16_ps(a, x, y);
  }
  float total = 0.f;
  for (auto& a : acc) total += _mm512_reduce_add_ps(a);
  return total;
}

double dpbf16_gflop_per_s(int64_t iterations, int64_t threads) {
  std::vector<float> sink(threads);
  auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sink[t] = dpbf16_loop(iterations);
  });
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return 64.0 * 12 * iterations * threads / seconds / 1e9 + 0.0 * sink[0];
}
"""


def bf16_instruction_peak(threads: int, repeats: int) -> dict:
    """GFLOP/s of a register-only `vdpbf16ps` loop on `threads` threads (one loop per thread)."""
    from torch.utils.cpp_extension import load_inline

    module = load_inline(
        "bench_gemm_peak",
        cpp_sources=PEAK_SOURCE,
        functions=["dpbf16_gflop_per_s"],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
    torch.set_num_threads(threads)
    module.dpbf16_gflop_per_s(10**6, threads)  # warm-up: clocks settle
    return spread([module.dpbf16_gflop_per_s(2 * 10**7, threads) for _ in range(repeats)])


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
    peaks = {}
    isa = described["cpu_isa"]
    if "avx512_bf16" in isa and "amx_bf16" not in isa:
        for threads in sorted({1, all_threads}):
            name = f"vdpbf16ps, {threads} thread(s)"
            peaks[name] = bf16_instruction_peak(threads, args.repeats)
            ours = rates[f"bfloat16, {threads} thread(s)"]["median"]
            print(
                f"{name:24s} {fmt(peaks[name], 1, ' GFLOP/s')} (ATen bf16 reaches "
                f"{ours / peaks[name]['median']:.0%})",
                flush=True,
            )
    else:
        print("bf16 instruction peak: skipped (measured only with avx512_bf16 and without AMX)")
    torch.set_num_threads(all_threads)
    result = {
        "command": command_line(),
        "machine": described,
        "size": args.size,
        "repeats": args.repeats,
        "gflop_per_s": rates,
        "bf16_instruction_peak_gflop_per_s": peaks or "skipped: needs avx512_bf16 and no AMX",
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
