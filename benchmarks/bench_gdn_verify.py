"""The GDN verify step of MTP speculative decoding at Qwen3.6-27B's GDN head shapes (16 key heads, 48 value
heads, K = V = 128, one layer): the native op (`optimum_qwen36::gdn_verify_step`) against its PyTorch twin
(`gdn_verify_step_torch`, what the step ran before the op) and against k + 1 native decode steps (the cost a
verify step cannot go below with one-token arithmetic), for batch 1 and 8 and k = 1..3. The three sides run
alternately, round after round; the JSON keeps every run.

    python benchmarks/bench_gdn_verify.py                # ~1 minute on 2 cores

Writes benchmarks/results/bench_gdn_verify.json (or --output) and prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from timing import alternate, command_line, fmt, machine, paired_ratios, spread, wall

from optimum_qwen36.ops.gdn import gdn_decode_step_native, gdn_verify_step_native, gdn_verify_step_torch
from optimum_qwen36.ops.native import load_native_ops

RESULTS = Path(__file__).resolve().parent / "results"
HEADS = dict(k_heads=16, v_heads=48, k_dim=128, v_dim=128)  # one GDN layer of Qwen3.6-27B (TP = 1)


def measures(batch: int, tokens: int) -> dict:
    generator = torch.Generator().manual_seed(batch * 10 + tokens)
    h, hv, k_dim, v_dim = HEADS["k_heads"], HEADS["v_heads"], HEADS["k_dim"], HEADS["v_dim"]
    q = torch.randn(batch, tokens, h, k_dim, generator=generator)
    k = torch.randn(batch, tokens, h, k_dim, generator=generator)
    v = torch.randn(batch, tokens, hv, v_dim, generator=generator)
    g = -torch.rand(batch, tokens, hv, generator=generator)
    beta = torch.rand(batch, tokens, hv, generator=generator)
    slots = torch.arange(batch)
    state = torch.randn(1, batch + 1, hv, k_dim, v_dim, generator=generator)
    spec = torch.zeros(1, batch + 1, tokens, hv, k_dim, v_dim)
    stepped = state.clone()
    scale = k_dim**-0.5

    def decode_steps() -> None:
        for t in range(tokens):
            gdn_decode_step_native(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], stepped, 0, slots, scale)

    return {
        "native verify": wall(lambda: gdn_verify_step_native(q, k, v, g, beta, state, spec, 0, slots, scale)),
        "torch verify": wall(lambda: gdn_verify_step_torch(q, k, v, g, beta, state, spec, 0, slots, scale)),
        "native decode x T": wall(decode_steps),
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_gdn_verify.json")
    args = parser.parse_args()
    if not load_native_ops():
        raise SystemExit("the native CPU ops cannot be built here: nothing to compare")
    rows = []
    for batch in args.batches:
        for k in args.ks:
            runs = alternate(measures(batch, k + 1), args.repeats, warmup=2)
            row = {
                "batch": batch,
                "k": k,
                "ms": {name: spread([1e3 * s for s in seconds]) for name, seconds in runs.items()},
                "torch_over_native": paired_ratios(runs["torch verify"], runs["native verify"]),
                "native_over_decode_steps": paired_ratios(runs["native verify"], runs["native decode x T"]),
            }
            rows.append(row)
            print(
                f"batch {batch} k={k}: native {fmt(row['ms']['native verify'], 3)} ms, "
                f"torch {fmt(row['ms']['torch verify'], 3)} ms (x{fmt(row['torch_over_native'])}), "
                f"{k + 1} native decode steps {fmt(row['ms']['native decode x T'], 3)} ms "
                f"(verify / steps x{fmt(row['native_over_decode_steps'], 2)})"
            )
    report = {"command": command_line(), "machine": machine(), "heads": HEADS, "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
