"""Accuracy of the NKI prefill kernel on the hard case of the intra-chunk solve (docs/NKI.md's error table).

Qwen3.6-27B per-rank GDN shapes (4 key heads, 12 value heads, K = V = 128, batch 1), an initial state, and
"hard" inputs: weak decays, keys with correlation 0.95, beta in [0.8, 1] (the inputs of
tests/test_nki_kernels.py::test_prefill_hard_inputs_at_per_rank_shapes). Error = max |error| / max |o|
against the float64 token-by-token recurrence (tests/gdn_reference.py), for:
- the NKI prefill kernel, run by `nki.simulate` (the project's numpy interpreter unless the AWS `nki`
  package is installed; the JSON says which), also against its PyTorch twin;
- the twin with the kernel's tiling (`tile_size=64`, base block 2);
- the twin with base block 16: 16x16 nilpotent doubling, (I + M)(I + M^2)(I + M^4)(I + M^8), then block
  forward substitution (the scheme that exceeds the 1e-4 tolerance on these inputs);
- transformers' `torch_chunk_gated_delta_rule` (chunk 64).
The computation is deterministic (one run per case); it takes about a minute on one core.

    python benchmarks/nki_errors.py                                  # seeds 0..3 at T = 200, seed 3 at 1024
    python benchmarks/nki_errors.py --cases 64:0 --output /tmp/nki_errors.json                  # smoke run

Writes benchmarks/results/nki_errors.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from gdn_reference import make_gdn_inputs, max_rel_error, reference_gated_delta_rule  # noqa: E402
from timing import command_line, machine  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule  # noqa: E402

from optimum_qwen36.nki.interpreter import nki_modules  # noqa: E402
from optimum_qwen36.nki.kernels import chunk_gated_delta_rule as chunk_module  # noqa: E402
from optimum_qwen36.nki.kernels.chunk_gated_delta_rule_torch import chunk_gated_delta_rule_torch  # noqa: E402

HEADS = (4, 12)  # key heads, value heads: the 27B GDN layer at TP=4 (K = V = 128 by default)
HARD = {"a_log_max": -1.0, "softplus_max": -3.0, "key_correlation": 0.95, "beta_range": (0.8, 1.0)}
RESULTS = ROOT / "benchmarks" / "results"
SCHEMES = {
    "kernel": "NKI prefill kernel: 2x2 base blocks + pairwise merges (nki.simulate)",
    "twin": "PyTorch twin, tile 64, base block 2",
    "twin_base16": "PyTorch twin, tile 64, base block 16 (16x16 nilpotent doubling + block forward "
    "substitution)",
    "transformers": "transformers torch_chunk_gated_delta_rule (chunk 64)",
}


def errors(seq_len: int, seed: int, nki) -> dict:
    inputs = make_gdn_inputs(1, seq_len, *HEADS, seed=seed, **HARD)
    batch, _, num_v_heads, v_dim = inputs["v"].shape
    k_dim = inputs["k"].shape[-1]
    generator = torch.Generator().manual_seed(1)
    state0 = 0.1 * torch.randn(batch, num_v_heads, k_dim, v_dim, generator=generator)
    ref_o, _ = reference_gated_delta_rule(**inputs, initial_state=state0)
    start = time.perf_counter()
    launch = nki.simulate(chunk_module.chunk_gated_delta_rule_kernel)
    kernel_o = chunk_module.chunk_gated_delta_rule(**inputs, initial_state=state0, launch=launch)[0]
    kernel_s = time.perf_counter() - start

    def twin(base_block: int) -> torch.Tensor:
        return chunk_gated_delta_rule_torch(
            **inputs, scale=k_dim**-0.5, initial_state=state0, tile_size=64, base_block=base_block
        )[0]

    outputs = {
        "kernel": kernel_o,
        "twin": twin(2),
        "twin_base16": twin(16),
        "transformers": torch_chunk_gated_delta_rule(*inputs.values(), initial_state=state0)[0],
    }
    return {
        "T": seq_len,
        "seed": seed,
        "error": {name: max_rel_error(o, ref_o) for name, o in outputs.items()},
        "vs_twin": {
            name: max_rel_error(outputs[name], outputs["twin"]) for name in ("kernel", "twin_base16")
        },
        "kernel_seconds": kernel_s,
    }


def summary(cases: list[dict]) -> dict:
    """Per scheme: min and max of the error (and of the distance to the twin) over the cases at each T."""
    out: dict = {}
    for name in SCHEMES:
        out[name] = {}
        for seq_len in sorted({c["T"] for c in cases}):
            at = [c for c in cases if c["T"] == seq_len]
            entry = {"error": [min(c["error"][name] for c in at), max(c["error"][name] for c in at)]}
            if name in at[0]["vs_twin"]:
                entry["vs_twin"] = [min(c["vs_twin"][name] for c in at), max(c["vs_twin"][name] for c in at)]
            entry["seeds"] = [c["seed"] for c in at]
            out[name][str(seq_len)] = entry
    return out


def markdown(result: dict) -> str:
    lengths = sorted({c["T"] for c in result["cases"]})

    def cell(values: list[float]) -> str:
        low, high = values
        return f"{low:.1e}" if f"{low:.1e}" == f"{high:.1e}" else f"{low:.1e} .. {high:.1e}"

    header = (
        " | ".join(f"error, T = {t}" for t in lengths)
        + " | "
        + " | ".join(f"vs twin, T = {t}" for t in lengths)
    )
    lines = [f"| prefill scheme | {header} |", "| --- |" + " --- |" * (2 * len(lengths))]
    for name, description in SCHEMES.items():
        by_t = result["summary"][name]
        errs = [cell(by_t[str(t)]["error"]) for t in lengths]
        twins = [cell(by_t[str(t)]["vs_twin"]) if "vs_twin" in by_t[str(t)] else "" for t in lengths]
        lines.append(f"| {description} | " + " | ".join(errs + twins) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["200:0", "200:1", "200:2", "200:3", "1024:3"],
        help="T:seed pairs (default: seeds 0..3 at T = 200, seed 3 at T = 1024)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--output", type=Path, default=RESULTS / "nki_errors.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    nki, _, _ = nki_modules()
    cases = []
    for case in args.cases:
        seq_len, seed = (int(x) for x in case.split(":"))
        cases.append(errors(seq_len, seed, nki))
        errs = ", ".join(f"{name} {e:.1e}" for name, e in cases[-1]["error"].items())
        print(
            f"T={seq_len} seed {seed}: {errs}; kernel vs twin {cases[-1]['vs_twin']['kernel']:.1e}",
            flush=True,
        )
    result = {
        "command": command_line(),
        "nki": getattr(nki, "__name__", str(nki)),  # the interpreter's module unless the AWS nki is installed
        "machine": machine(),
        "shapes": {"batch": 1, "num_k_heads": HEADS[0], "num_v_heads": HEADS[1], "k_dim": 128, "v_dim": 128},
        "inputs": {**HARD, "beta_range": list(HARD["beta_range"]), "initial_state": "0.1 * randn (seed 1)"},
        "schemes": SCHEMES,
        "deterministic": "one run per case: the computation has no randomness beyond the seeded inputs",
        "cases": cases,
    }
    result["summary"] = summary(cases)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
