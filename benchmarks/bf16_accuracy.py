"""bf16 accuracy of the exported `cpu` backend: the figures of docs/EXPORT.md's bf16 table, on the trained
model of tests/pattern_model.py (tests/test_export_bf16.py asserts the tolerance; this records the values).

A tiny 4-layer model trained on a repeating 64-token pattern (decisive logits), exported for the `cpu` backend
in bf16 (batch 3, sequence 96, prefill chunk 16), generates 32 greedy tokens from 3 left-padded prompts (5 /
21 / 37 tokens), in one batch and one row at a time (both on the `decode_step` graphs; one row is padded to
two). Each is compared with the eager backend in bf16 and with transformers in bf16 and fp32: greedy match
rate and max |logit difference| (over the steps up to each row's first mismatch, as in the test). For scale,
the references against each other; and the same references on the untrained (random) model, whose nearly flat
logits make greedy matches meaningless. Deterministic on a given machine: one run. One AOTInductor export of
tiny graphs: about 2-3 minutes on 2 cores.

    python benchmarks/bf16_accuracy.py
    python benchmarks/bf16_accuracy.py --compile-cache-dir ~/.cache/optimum-qwen36 --output /tmp/bf16.json

Writes benchmarks/results/bf16_accuracy.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import save_tiny_checkpoint  # noqa: E402
from pattern_model import (  # noqa: E402
    NEW_TOKENS,
    PROMPT_LENGTHS,
    SETTINGS,
    TRAIN_STEPS,
    compare,
    generate_tokens_and_logits,
    pattern_prompts,
    train_pattern_checkpoint,
)
from timing import command_line, machine  # noqa: E402

from optimum_qwen36 import NeuronQwen36ForCausalLM  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
OURS = ("cpu bf16, batched", "cpu bf16, one row at a time")
REFERENCES = ("eager bf16", "transformers bf16", "transformers fp32")


def decisiveness(logits: torch.Tensor) -> dict:
    top2 = logits.topk(2, dim=-1).values
    return {
        "max_abs_logit": logits.abs().max().item(),
        "min_top2_gap": (top2[..., 0] - top2[..., 1]).min().item(),
    }


def references(checkpoint: Path, fp32_model: torch.nn.Module) -> dict:
    eager = NeuronQwen36ForCausalLM.from_pretrained(checkpoint, export=True, backend="eager", **SETTINGS)
    bf16_model = type(fp32_model).from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    return {
        "eager bf16": generate_tokens_and_logits(eager),
        "transformers bf16": generate_tokens_and_logits(bf16_model),
        "transformers fp32": generate_tokens_and_logits(fp32_model),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compile-cache-dir", type=Path, help="default: a fresh temporary one (compiles)")
    parser.add_argument("--output", type=Path, default=RESULTS / "bf16_accuracy.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        checkpoint, fp32_model = train_pattern_checkpoint(Path(tmp) / "checkpoint")
        train_s = time.perf_counter() - start
        start = time.perf_counter()
        model = NeuronQwen36ForCausalLM.from_pretrained(
            checkpoint,
            export=True,
            backend="cpu",
            compile_cache_dir=args.compile_cache_dir or Path(tmp) / "compile-cache",
            **SETTINGS,
        )
        export_s = time.perf_counter() - start
        results = {
            "cpu bf16, batched": generate_tokens_and_logits(model),
            "cpu bf16, one row at a time": generate_tokens_and_logits(model, True),
        }
        results.update(references(checkpoint, fp32_model))
        untrained_dir, untrained = save_tiny_checkpoint(Path(tmp) / "untrained", "causal", seed=3)
        untrained_results = references(untrained_dir, untrained)

    comparisons = {f"{a} vs {b}": compare(results[a], results[b]) for a in OURS for b in REFERENCES}
    scale = {
        f"{a} vs {b}": compare(results[a], results[b])
        for a, b in (("eager bf16", "transformers bf16"), ("transformers bf16", "transformers fp32"))
    }
    untrained_comparisons = {
        f"{a} vs {b}": compare(untrained_results[a], untrained_results[b])
        for a, b in (("eager bf16", "transformers bf16"), ("transformers bf16", "transformers fp32"))
    }
    result = {
        "command": command_line(),
        "machine": machine(),
        "settings": {**SETTINGS, "prompt_lengths": PROMPT_LENGTHS, "new_tokens": NEW_TOKENS},
        "deterministic": "one run: the training, the export and the generation are seeded",
        "train_steps": TRAIN_STEPS,
        "train_seconds": train_s,
        "export_seconds": export_s,
        "trained_learned_the_pattern": bool(
            torch.equal(results["transformers fp32"][0], pattern_prompts()[2])
        ),
        "trained_fp32_logits": decisiveness(results["transformers fp32"][1]),
        "cpu_bf16_vs_references": comparisons,
        "references_against_each_other": scale,
        "untrained_fp32_logits": decisiveness(untrained_results["transformers fp32"][1]),
        "untrained_references_against_each_other": untrained_comparisons,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| `cpu` bf16 vs | batched: greedy match | max diff | one row at a time: match | max diff |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for ref in REFERENCES:
        batched, single = (comparisons[f"{ours} vs {ref}"] for ours in OURS)
        lines.append(
            f"| {ref} | {batched['greedy_match']:.0%} | {batched['max_logit_diff']:.3f} | "
            f"{single['greedy_match']:.0%} | {single['max_logit_diff']:.3f} |"
        )
    print("\n".join(lines))
    print(json.dumps({k: result[k] for k in ("trained_fp32_logits", "references_against_each_other")}))
    print(
        json.dumps(
            {k: result[k] for k in ("untrained_fp32_logits", "untrained_references_against_each_other")}
        )
    )
    print(f"trained in {train_s:.1f} s, exported in {export_s:.1f} s; wrote {args.output}")


if __name__ == "__main__":
    main()
