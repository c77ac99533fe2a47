"""CPU benchmark of the Gated DeltaNet ops against transformers' PyTorch reference implementations.

Prefill: our chunk_gated_delta_rule vs transformers' torch_chunk_gated_delta_rule; decode: our
fused_recurrent_gated_delta_rule vs torch_recurrent_gated_delta_rule (one token per call, state carried).
Qwen3.6-27B per-rank GDN shapes at TP=4 (B=1, 4 key heads, 12 value heads, K=V=128), fp32 and bf16
inputs, accuracy as max |error| / max |output| against a float64 token-by-token recurrence.
A sweep over chunk size and base block records the speed/accuracy trade-off of the intra-chunk solve.

    python benchmarks/bench_gdn.py            # full run, 1 thread (several minutes)
    python benchmarks/bench_gdn.py --quick    # T = 512, 4096 only, no sweep
    python benchmarks/bench_gdn.py --profile  # where our prefill's time goes (T = 4096, float32)
    python benchmarks/bench_gdn.py --lengths 128 --decode-steps 16 --no-sweep --output /tmp/gdn.json  # smoke

Every speed is repeated (prefill: 5..10 runs by length, decode 10, sweep 5; --repeats overrides), ours and
transformers alternated run by run so that both see the same machine load; the JSON keeps every run with
min / median / max (tok/s), the speed-up per round (transformers' time / ours in the same round), and the
median is the headline figure. Errors are deterministic (one run). One thread by default: on a shared box
OpenMP barriers make multi-threaded runs erratic.
Writes benchmarks/results/bench_gdn.json and benchmarks/results/bench_gdn.png (--profile:
benchmarks/results/bench_gdn_profile.json); --output / --profile-output write elsewhere.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from gdn_reference import make_gdn_inputs, max_rel_error, reference_gated_delta_rule  # noqa: E402
from timing import alternate, command_line, fmt, machine, paired_ratios, rates, spread, wall  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import (  # noqa: E402
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from optimum_qwen36.nki import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402
from optimum_qwen36.nki.kernels import chunk_gated_delta_rule_torch as chunk_twin  # noqa: E402

HEADS = {"num_k_heads": 4, "num_v_heads": 12, "k_dim": 128, "v_dim": 128}  # 27B GDN layer / TP=4
HARD = {"a_log_max": -1.0, "softplus_max": -3.0, "key_correlation": 0.95, "beta_range": (0.8, 1.0)}
STRONG = {"a_log_max": math.log(16.0), "softplus_max": 20.0}  # tests/test_gdn_ops.py: exp(A_log) up to 16
RESULTS = ROOT / "benchmarks" / "results"


def compare(fns: dict[str, Callable[[], object]], tokens: int, repeats: int) -> dict:
    """tok/s spreads of ours and transformers (run alternately) and the per-round speed-up."""
    runs = alternate({name: wall(fn) for name, fn in fns.items()}, repeats)
    return {
        "ours_tok_s": rates(tokens, runs["ours"]),
        "hf_tok_s": rates(tokens, runs["hf"]),
        "speedup": paired_ratios(runs["hf"], runs["ours"]),
    }


def describe(row: dict, what: str) -> str:
    return (
        f"{what}  ours {fmt(row['ours_tok_s'], 0)} tok/s  hf {fmt(row['hf_tok_s'], 0)} tok/s  "
        f"x{fmt(row['speedup'], 2)}  err ours {row['ours_err']:.1e} hf {row['hf_err']:.1e}"
    )


def bench_prefill(lengths: list[int], dtypes: list[torch.dtype], repeats: int | None) -> list[dict]:
    rows = []
    for dtype in dtypes:
        inputs = make_gdn_inputs(seq_len=max(lengths), dtype=dtype, **HEADS)
        # One float64 run on the longest sequence; shorter lengths are its prefixes.
        ref_o, _ = reference_gated_delta_rule(**inputs)
        for seq_len in lengths:
            part = {name: t[:, :seq_len] for name, t in inputs.items()}
            ours_o = chunk_gated_delta_rule(**part)[0]
            hf_o = torch_chunk_gated_delta_rule(*part.values())[0]
            timed = compare(
                {
                    "ours": lambda p=part: chunk_gated_delta_rule(**p),
                    "hf": lambda p=part: torch_chunk_gated_delta_rule(*p.values()),
                },
                seq_len,
                repeats or max(5, min(10, 32768 // seq_len)),
            )
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "T": seq_len,
                **timed,
                "ours_err": max_rel_error(ours_o, ref_o[:, :seq_len]),
                "hf_err": max_rel_error(hf_o, ref_o[:, :seq_len]),
            }
            rows.append(row)
            print(describe(row, f"prefill {row['dtype']:8s} T={seq_len:5d}"), flush=True)
    return rows


def decode_tokens(tokens: list[dict], step: Callable[[dict, torch.Tensor | None], tuple]) -> torch.Tensor:
    """Outputs of `step(token_inputs, state) -> (o, state)` over the tokens, the state carried."""
    state, outs = None, []
    for tok in tokens:
        o, state = step(tok, state)
        outs.append(o)
    return torch.cat(outs, 1)


def bench_decode(dtypes: list[torch.dtype], steps: int, repeats: int | None) -> list[dict]:
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
        row = {
            "dtype": str(dtype).removeprefix("torch."),
            "steps": steps,
            **compare({"ours": ours, "hf": hf}, steps, repeats or 10),
            "ours_err": max_rel_error(ours(), ref_o),
            "hf_err": max_rel_error(hf(), ref_o),
        }
        rows.append(row)
        print(describe(row, f"decode  {row['dtype']:8s} {steps} steps"), flush=True)
    return rows


def sweep_blocks(repeats: int | None, seq_len: int = 4096, accuracy_len: int = 1024) -> list[dict]:
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

            seconds = alternate({"twin": wall(lambda r=run: r(speed_inputs))}, repeats or 5)["twin"]
            row = {
                "chunk_size": chunk_size,
                "base_block": base_block,
                "tok_s": rates(seq_len, seconds),
                "hard_err": max_rel_error(run(hard_inputs), ref_o),
                "hf_hard_err": hf_err[chunk_size],
            }
            rows.append(row)
            print(
                f"sweep chunk {chunk_size:3d} base {base_block:2d}  {fmt(row['tok_s'], 0)} tok/s  "
                f"hard err {row['hard_err']:.1e} (hf {row['hf_hard_err']:.1e})",
                flush=True,
            )
    return rows


def strong_decay_errors(seq_len: int = 1024) -> dict:
    """Errors of ours and transformers' chunked prefill on strong decays (g down to about -300 per token,
    cumulative decays |c| far beyond 1e3), float32, against float64: deterministic, one run."""
    inputs = make_gdn_inputs(seq_len=seq_len, **HEADS, **STRONG)
    ref_o, _ = reference_gated_delta_rule(**inputs)
    row = {
        "T": seq_len,
        "min_g": inputs["g"].min().item(),
        "ours_err": max_rel_error(chunk_gated_delta_rule(**inputs)[0], ref_o),
        "hf_err": max_rel_error(torch_chunk_gated_delta_rule(*inputs.values())[0], ref_o),
    }
    print(f"strong decays T={seq_len}: err ours {row['ours_err']:.1e} hf {row['hf_err']:.1e}", flush=True)
    return row


def exp2_vs_exp(repeats: int | None, elements: int = 1 << 22) -> dict:
    """torch.exp against torch.exp2 on the same float32 tensor (the twin carries decays in base 2)."""
    x = -torch.rand(elements) * 10
    runs = alternate({"exp": wall(lambda: torch.exp(x)), "exp2": wall(lambda: torch.exp2(x))}, repeats or 10)
    row = {
        "elements": elements,
        "exp_gelem_s": rates(elements / 1e9, runs["exp"]),
        "exp2_gelem_s": rates(elements / 1e9, runs["exp2"]),
        "exp_time_over_exp2": paired_ratios(runs["exp"], runs["exp2"]),
    }
    print(f"exp / exp2 time: x{fmt(row['exp_time_over_exp2'], 2)}", flush=True)
    return row


def plot(prefill: list[dict], decode: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_err) = plt.subplots(1, 2, figsize=(12, 4.5))
    for dtype, style in (("float32", "-"), ("bfloat16", "--")):
        rows = [r for r in prefill if r["dtype"] == dtype]
        lengths = [r["T"] for r in rows]
        for side, marker, color, name in (("ours", "o", "C0", "ours"), ("hf", "s", "C1", "HF")):
            speeds = [r[f"{side}_tok_s"] for r in rows]
            ax_speed.errorbar(
                lengths,
                [c["median"] for c in speeds],
                yerr=[[c["median"] - c["min"] for c in speeds], [c["max"] - c["median"] for c in speeds]],
                fmt=marker + style,
                color=color,
                capsize=3,
                label=f"{name} {dtype}",
            )
            ax_err.plot(
                lengths,
                [r[f"{side}_err"] for r in rows],
                marker + style,
                color=color,
                label=f"{name} {dtype}",
            )
    for ax in (ax_speed, ax_err):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length T")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_speed.set_ylabel("prefill tokens/s, median (min-max)\n(one GDN layer, 27B per-rank shapes)")
    ax_err.set_yscale("log")
    ax_err.set_ylabel("max |error| / max |o| vs float64")
    decode_note = ", ".join(
        f"{r['dtype']}: ours {r['ours_tok_s']['median']:.0f} vs {r['hf_tok_s']['median']:.0f} tok/s"
        for r in decode
    )
    threads = torch.get_num_threads()
    fig.suptitle(f"GDN chunked prefill on CPU ({threads} threads); decode {decode_note}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def profile_prefill(runs: int, seq_len: int = 4096, calls: int = 3, top: int = 15) -> dict:
    """torch.profiler shares of self CPU time per op and input shapes for our float32 prefill, the matmuls'
    achieved GFLOP/s, and a 2048^3 float32 matmul's GFLOP/s as this core's practical peak. The profile is
    taken `runs` times (each over `calls` calls): every figure is a spread over those runs."""
    from torch.profiler import profile

    inputs = make_gdn_inputs(seq_len=seq_len, **HEADS)
    chunk_gated_delta_rule(**inputs)
    per_run, ms_per_call = [], []
    for _ in range(runs):
        with profile(record_shapes=True, with_flops=True) as prof:
            for _ in range(calls):
                chunk_gated_delta_rule(**inputs)
        events = prof.key_averages(group_by_input_shape=True)
        total = sum(e.self_cpu_time_total for e in events)
        ms_per_call.append(total / calls / 1e3)
        per_run.append(
            {
                (e.key, str(e.input_shapes)): (
                    e.self_cpu_time_total / total,
                    # matmuls only (profiler flops of elementwise ops are element counts); time in us
                    e.flops / e.self_cpu_time_total / 1e3 if e.flops and "mm" in e.key else None,
                )
                for e in events
                if e.self_cpu_time_total > 0
            }
        )
    keys = {key for run in per_run for key in run}
    shares = {key: spread([run.get(key, (0.0, None))[0] for run in per_run]) for key in keys}
    rows = []
    for key in sorted(keys, key=lambda k: -shares[k]["median"])[:top]:
        flops = [run[key][1] for run in per_run if key in run and run[key][1] is not None]
        rows.append(
            {
                "op": key[0],
                "input_shapes": key[1],
                "share": shares[key],
                "gflop_s": spread(flops) if flops else None,
            }
        )
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    gemm = rates(2 * 2048**3 / 1e9, alternate({"gemm": wall(lambda: a @ b)}, 5)["gemm"])
    result = {
        "command": command_line(),
        "machine": machine(),
        "T": seq_len,
        "profile_runs": runs,
        "calls_per_run": calls,
        "ms_per_call": spread(ms_per_call),
        "gemm_2048_gflop_s": gemm,
        "ops": rows,
    }
    print(f"prefill T={seq_len} float32: {fmt(result['ms_per_call'])} ms/call (profiled); "
          f"2048^3 float32 matmul {fmt(gemm)} GFLOP/s")  # fmt: skip
    for r in rows:
        rate = f"{fmt(r['gflop_s'])} GFLOP/s" if r["gflop_s"] else ""
        print(f"{fmt(r['share'], 3)}  {r['op']:<20s} {rate:>24s}  {r['input_shapes']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 512 and 4096 only, no sweep")
    parser.add_argument("--lengths", type=int, nargs="+", help="prefill lengths (default 512 .. 8192)")
    parser.add_argument("--decode-steps", type=int, default=256, help="decode steps per timed run")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile x base-block sweep")
    parser.add_argument("--repeats", type=int, help="timed runs per figure (default: 5..10, see above)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--profile", action="store_true", help="profile our prefill at T = 4096 only")
    parser.add_argument("--profile-runs", type=int, default=3, help="profiles taken (spread over them)")
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_gdn.json", help="JSON (and .png)")
    parser.add_argument("--profile-output", type=Path, default=RESULTS / "bench_gdn_profile.json")
    args = parser.parse_args()
    if args.repeats is not None and args.repeats < 3:
        parser.error("--repeats must be at least 3 (the JSON reports min / median / max)")
    torch.set_num_threads(args.threads)
    if args.profile:
        result = profile_prefill(args.profile_runs)
        args.profile_output.parent.mkdir(parents=True, exist_ok=True)
        args.profile_output.write_text(json.dumps(result, indent=2) + "\n")
        return
    lengths = args.lengths or ([512, 4096] if args.quick else [512, 1024, 2048, 4096, 8192])
    dtypes = [torch.float32, torch.bfloat16]

    prefill = bench_prefill(lengths, dtypes, args.repeats)
    decode = bench_decode(dtypes, args.decode_steps, args.repeats)
    sweep = [] if args.quick or args.no_sweep else sweep_blocks(args.repeats)
    strong = strong_decay_errors(min(1024, max(lengths)))
    exp2 = exp2_vs_exp(args.repeats)
    result = {
        "command": command_line(),
        "machine": machine(),
        "shapes": {"batch": 1, **HEADS},
        "prefill": prefill,
        "decode": decode,
        "chunk_block_sweep": sweep,
        "strong_decay_errors": strong,
        "exp2_vs_exp": exp2,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=lambda x: None) + "\n")
    plot(prefill, decode, args.output.with_suffix(".png"))
    for row in prefill:
        if row["T"] == max(lengths):
            print(f"T={row['T']} {row['dtype']} prefill speed-up (per round): x{fmt(row['speedup'], 2)}")
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")
    assert all(math.isfinite(r["ours_err"]) for r in prefill)


if __name__ == "__main__":
    main()
