"""CPU benchmark of the Gated DeltaNet ops against transformers' PyTorch reference implementations.

Prefill: our chunk_gated_delta_rule vs transformers' torch_chunk_gated_delta_rule; decode: our
fused_recurrent_gated_delta_rule vs torch_recurrent_gated_delta_rule (one token per call, state carried).
Qwen3.6-27B per-rank GDN shapes at TP=4 (B=1, 4 key heads, 12 value heads, K=V=128), fp32 and bf16
inputs, accuracy as max |error| / max |output| against a float64 token-by-token recurrence.
A sweep over chunk size and base block records the speed/accuracy trade-off of the intra-chunk solve.

    python benchmarks/bench_gdn.py            # full run, 1 thread (several minutes)
    python benchmarks/bench_gdn.py --quick    # T = 512, 4096 only, no sweep
    python benchmarks/bench_gdn.py --profile  # where our prefill's time goes (T = 4096, float32)
One thread by default: on a shared box OpenMP barriers make multi-threaded runs erratic.
Writes benchmarks/results/bench_gdn.json and benchmarks/results/bench_gdn.png (--profile:
benchmarks/results/bench_gdn_profile.json).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from gdn_reference import make_gdn_inputs, max_rel_error, reference_gated_delta_rule  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import (  # noqa: E402
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from optimum_qwen36.nki import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402
from optimum_qwen36.nki.kernels import chunk_gated_delta_rule_torch as chunk_twin  # noqa: E402

HEADS = {"num_k_heads": 4, "num_v_heads": 12, "k_dim": 128, "v_dim": 128}  # 27B GDN layer / TP=4
HARD = {"a_log_max": -1.0, "softplus_max": -3.0, "key_correlation": 0.95, "beta_range": (0.8, 1.0)}
RESULTS = ROOT / "benchmarks" / "results"


def best_times(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Minimum wall time of each fn over repeats, the fns run alternately after one warm-up each: the
    machine is shared, so alternating exposes them to the same load and the minimum is the least
    disturbed run."""
    best = [math.inf] * len(fns)
    for fn in fns:
        fn()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def bench_prefill(lengths: list[int], dtypes: list[torch.dtype]) -> list[dict]:
    rows = []
    for dtype in dtypes:
        inputs = make_gdn_inputs(seq_len=max(lengths), dtype=dtype, **HEADS)
        # One float64 run on the longest sequence; shorter lengths are its prefixes.
        ref_o, _ = reference_gated_delta_rule(**inputs)
        for seq_len in lengths:
            part = {name: t[:, :seq_len] for name, t in inputs.items()}
            repeats = max(5, min(10, 32768 // seq_len))  # the minimum needs many tries on a shared box
            ours_o = chunk_gated_delta_rule(**part)[0]
            hf_o = torch_chunk_gated_delta_rule(*part.values())[0]
            ours_t, hf_t = best_times(
                [
                    lambda p=part: chunk_gated_delta_rule(**p),
                    lambda p=part: torch_chunk_gated_delta_rule(*p.values()),
                ],
                repeats,
            )
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "T": seq_len,
                "ours_tok_s": seq_len / ours_t,
                "hf_tok_s": seq_len / hf_t,
                "speedup": hf_t / ours_t,
                "ours_err": max_rel_error(ours_o, ref_o[:, :seq_len]),
                "hf_err": max_rel_error(hf_o, ref_o[:, :seq_len]),
            }
            rows.append(row)
            print(
                f"prefill {row['dtype']:8s} T={seq_len:5d}  ours {row['ours_tok_s']:9.0f} tok/s  "
                f"hf {row['hf_tok_s']:9.0f} tok/s  x{row['speedup']:.2f}  "
                f"err ours {row['ours_err']:.1e} hf {row['hf_err']:.1e}",
                flush=True,
            )
    return rows


def decode_tokens(tokens: list[dict], step: Callable[[dict, torch.Tensor | None], tuple]) -> torch.Tensor:
    """Outputs of `step(token_inputs, state) -> (o, state)` over the tokens, the state carried."""
    state, outs = None, []
    for tok in tokens:
        o, state = step(tok, state)
        outs.append(o)
    return torch.cat(outs, 1)


def bench_decode(dtypes: list[torch.dtype], steps: int = 256) -> list[dict]:
    """One token per call with the state carried, as in decode; accuracy over all steps."""
    rows = []
    for dtype in dtypes:
        inputs = make_gdn_inputs(seq_len=steps, dtype=dtype, **HEADS)
        ref_o, _ = reference_gated_delta_rule(**inputs)
        tokens = [{name: t[:, i : i + 1] for name, t in inputs.items()} for i in range(steps)]
        ours = partial(
            decode_tokens,
            tokens,
            lambda tok, s: fused_recurrent_gated_delta_rule(**tok, initial_state=s, output_final_state=True),
        )
        hf = partial(
            decode_tokens,
            tokens,
            lambda tok, s: torch_recurrent_gated_delta_rule(
                *tok.values(), initial_state=s, output_final_state=True
            ),
        )
        ours_t, hf_t = best_times([ours, hf], 3)
        row = {
            "dtype": str(dtype).removeprefix("torch."),
            "steps": steps,
            "ours_tok_s": steps / ours_t,
            "hf_tok_s": steps / hf_t,
            "speedup": hf_t / ours_t,
            "ours_err": max_rel_error(ours(), ref_o),
            "hf_err": max_rel_error(hf(), ref_o),
        }
        rows.append(row)
        print(
            f"decode  {row['dtype']:8s} {steps} steps  ours {row['ours_tok_s']:7.0f} tok/s  "
            f"hf {row['hf_tok_s']:7.0f} tok/s  x{row['speedup']:.2f}  "
            f"err ours {row['ours_err']:.1e} hf {row['hf_err']:.1e}",
            flush=True,
        )
    return rows


def sweep_blocks(seq_len: int = 4096, accuracy_len: int = 1024) -> list[dict]:
    """Speed (random inputs, T=seq_len) and accuracy (hard inputs: weak decays, correlated keys, beta
    near 1, T=accuracy_len) of tile (chunk) size x base block of the intra-tile inverse."""
    speed_inputs = make_gdn_inputs(seq_len=seq_len, **HEADS)
    hard_inputs = make_gdn_inputs(seq_len=accuracy_len, **HEADS, **HARD)
    ref_o, _ = reference_gated_delta_rule(**hard_inputs)
    hf_err = {}
    rows = []
    for chunk_size in (16, 32, 64, 128):
        hf_o = torch_chunk_gated_delta_rule(*hard_inputs.values(), chunk_size)[0]
        hf_err[chunk_size] = max_rel_error(hf_o, ref_o)
        for base_block in (2, 4, 8, 16, 32, 64):
            if base_block > chunk_size:
                continue

            def run(inputs: dict, c: int = chunk_size, b: int = base_block) -> torch.Tensor:
                return chunk_twin.chunk_gated_delta_rule_torch(
                    **inputs, scale=HEADS["k_dim"] ** -0.5, chunk_size=c, tile_size=c, base_block=b
                )[0]

            row = {
                "chunk_size": chunk_size,
                "base_block": base_block,
                "tok_s": seq_len / best_times([lambda r=run: r(speed_inputs)], 2)[0],
                "hard_err": max_rel_error(run(hard_inputs), ref_o),
                "hf_hard_err": hf_err[chunk_size],
            }
            rows.append(row)
            print(
                f"sweep chunk {chunk_size:3d} base {base_block:2d}  {row['tok_s']:8.0f} tok/s  "
                f"hard err {row['hard_err']:.1e} (hf {row['hf_hard_err']:.1e})",
                flush=True,
            )
    return rows


def plot(prefill: list[dict], decode: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_err) = plt.subplots(1, 2, figsize=(12, 4.5))
    for dtype, style in (("float32", "-"), ("bfloat16", "--")):
        rows = [r for r in prefill if r["dtype"] == dtype]
        lengths = [r["T"] for r in rows]
        for ax, key in ((ax_speed, "tok_s"), (ax_err, "err")):
            ax.plot(lengths, [r[f"ours_{key}"] for r in rows], "o" + style, color="C0", label=f"ours {dtype}")
            ax.plot(lengths, [r[f"hf_{key}"] for r in rows], "s" + style, color="C1", label=f"HF {dtype}")
    for ax in (ax_speed, ax_err):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length T")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_speed.set_ylabel("prefill tokens/s (one GDN layer, 27B per-rank shapes)")
    ax_err.set_yscale("log")
    ax_err.set_ylabel("max |error| / max |o| vs float64")
    decode_note = ", ".join(
        f"{r['dtype']}: ours {r['ours_tok_s']:.0f} vs {r['hf_tok_s']:.0f} tok/s" for r in decode
    )
    threads = torch.get_num_threads()
    fig.suptitle(f"GDN chunked prefill on CPU ({threads} threads); decode {decode_note}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def profile_prefill(seq_len: int = 4096, calls: int = 3, top: int = 15) -> dict:
    """torch.profiler shares of self CPU time per op and input shapes for our float32 prefill, the matmuls'
    achieved GFLOP/s, and a 2048^3 float32 matmul's GFLOP/s as this core's practical peak."""
    from torch.profiler import profile

    inputs = make_gdn_inputs(seq_len=seq_len, **HEADS)
    chunk_gated_delta_rule(**inputs)
    with profile(record_shapes=True, with_flops=True) as prof:
        for _ in range(calls):
            chunk_gated_delta_rule(**inputs)
    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events)
    rows = [
        {
            "op": e.key,
            "input_shapes": str(e.input_shapes),
            "share": e.self_cpu_time_total / total,
            # matmuls only (profiler flops of elementwise ops are element counts); time in us
            "gflop_s": e.flops / e.self_cpu_time_total / 1e3 if e.flops and "mm" in e.key else None,
        }
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    ]
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    peak_s = best_times([lambda: a @ b], 5)[0]
    result = {
        "command": "python " + " ".join(sys.argv),
        "T": seq_len,
        "ms_per_call": total / calls / 1e3,
        "gemm_2048_gflop_s": 2 * 2048**3 / peak_s / 1e9,
        "ops": rows,
    }
    print(f"prefill T={seq_len} float32: {result['ms_per_call']:.1f} ms/call (profiled); "
          f"2048^3 float32 matmul {result['gemm_2048_gflop_s']:.1f} GFLOP/s")  # fmt: skip
    for r in rows:
        rate = f"{r['gflop_s']:6.1f} GFLOP/s" if r["gflop_s"] else ""
        print(f"{r['share']:6.1%}  {r['op']:<20s} {rate:>15s}  {r['input_shapes']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 512 and 4096 only, no sweep")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--profile", action="store_true", help="profile our prefill at T = 4096 only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        RESULTS.mkdir(parents=True, exist_ok=True)
        result = profile_prefill()
        (RESULTS / "bench_gdn_profile.json").write_text(json.dumps(result, indent=2) + "\n")
        return
    lengths = [512, 4096] if args.quick else [512, 1024, 2048, 4096, 8192]
    dtypes = [torch.float32, torch.bfloat16]

    prefill = bench_prefill(lengths, dtypes)
    decode = bench_decode(dtypes)
    sweep = [] if args.quick else sweep_blocks()
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": {
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "shapes": {"batch": 1, **HEADS},
        "prefill": prefill,
        "decode": decode,
        "chunk_block_sweep": sweep,
    }
    (RESULTS / "bench_gdn.json").write_text(json.dumps(result, indent=2, default=lambda x: None) + "\n")
    plot(prefill, decode, RESULTS / "bench_gdn.png")
    worst = min(r["speedup"] for r in prefill if r["T"] == 4096)
    print(f"wrote {RESULTS / 'bench_gdn.json'} and .png; worst T=4096 prefill speedup x{worst:.2f}")
    assert all(math.isfinite(r["ours_err"]) for r in prefill)


if __name__ == "__main__":
    main()
