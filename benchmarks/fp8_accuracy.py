"""FP8 accuracy: the trained text model of benchmarks/text_model.py with its linear layers quantized to
block-scaled e4m3 at export (`fp8_modules` "mlp" and "linear"), against the same model unquantized, all in
bf16 compute (the eager backend: the same model code every backend compiles).

Measured along the unquantized bf16 model's own greedy continuations of held-out prompts (standard-library
modules the model was not trained on), at least 2,000 positions:
- KL(p_bf16 || p_fp8) of the next-token distributions at every position (teacher forcing: the FP8 model is
  fed the bf16 model's tokens), mean and p99; SGLang's reference point for a quantized path is mean KL <=
  0.0025;
- top-1 agreement: how often the FP8 model's greedy token is the bf16 model's, at those positions;
- free-running greedy match: the FP8 model generating on its own, the share of positions where its tokens
  equal the bf16 model's, and the mean position of the first difference.
For scale, the same figures for fp32 against bf16 (the rounding of bf16 itself). Deterministic: one run.

    python benchmarks/fp8_accuracy.py                                  # trains the model first (~10 min)
    python benchmarks/fp8_accuracy.py --model-dir /tmp/text-model      # reuses a trained one

Writes benchmarks/results/fp8_accuracy.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from text_model import corpus, text_checkpoint  # noqa: E402
from timing import command_line, machine  # noqa: E402

from optimum_qwen36 import NeuronQwen36ForCausalLM  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PROMPTS, PROMPT_LENGTH, NEW_TOKENS, BATCH = 16, 192, 128, 8
SETTINGS = dict(backend="eager", batch_size=BATCH, sequence_length=512, prefill_chunk_size=64)
VARIANTS = {
    "bf16": dict(dtype="bfloat16"),
    "fp32": dict(dtype="float32"),
    "fp8 mlp (bf16 compute)": dict(dtype="bfloat16", quantization="fp8", fp8_modules="mlp"),
    "fp8 linear (bf16 compute)": dict(dtype="bfloat16", quantization="fp8", fp8_modules="linear"),
}
SGLANG_MEAN_KL = 0.0025


class ForceTokens(LogitsProcessor):
    """Teacher forcing through generate(): step t keeps only the token the reference chose at step t (the
    raw logits, which output_logits records, are the model's own)."""

    def __init__(self, tokens: torch.Tensor, prompt_width: int) -> None:
        self.tokens, self.prompt_width = tokens, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(1, self.tokens[:, step : step + 1], 0.0)
        return forced


def held_out_prompts() -> torch.Tensor:
    data = corpus(held_out=True)
    starts = torch.linspace(0, len(data) - PROMPT_LENGTH - 1, PROMPTS).long()
    return torch.stack([data[s : s + PROMPT_LENGTH] for s in starts])


def generate(
    model, prompts: torch.Tensor, forced: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [P, NEW_TOKENS], float32 logits [P, NEW_TOKENS, vocab]) in batches of BATCH rows."""
    tokens, logits = [], []
    for begin in range(0, len(prompts), BATCH):
        rows = prompts[begin : begin + BATCH]
        processors = None
        if forced is not None:
            processors = LogitsProcessorList([ForceTokens(forced[begin : begin + BATCH], rows.shape[1])])
        out = model.generate(
            rows, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
            output_logits=True, logits_processor=processors, pad_token_id=0,
        )  # fmt: skip
        tokens.append(out.sequences[:, rows.shape[1] :])
        logits.append(torch.stack(out.logits, dim=1).float())
    return torch.cat(tokens), torch.cat(logits)


def compare(
    reference: tuple[torch.Tensor, torch.Tensor], forced_logits: torch.Tensor, free: torch.Tensor
) -> dict:
    ref_tokens, ref_logits = reference
    log_p = torch.log_softmax(ref_logits, dim=-1)
    log_q = torch.log_softmax(forced_logits, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).flatten()
    same = free == ref_tokens
    first = [int((~row).nonzero()[0]) if (~row).any() else NEW_TOKENS for row in same]
    return {
        "positions": kl.numel(),
        "kl_mean": kl.mean().item(),
        "kl_p99": kl.quantile(0.99).item(),
        "kl_max": kl.max().item(),
        "top1_agreement": (forced_logits.argmax(-1) == ref_tokens).float().mean().item(),
        "free_running_greedy_match": same.float().mean().item(),
        "mean_first_difference": sum(first) / len(first),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, help="where the trained model is (trained there if absent)")
    parser.add_argument("--output", type=Path, default=RESULTS / "fp8_accuracy.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = text_checkpoint(args.model_dir or Path(tmp) / "text-model")
        prompts = held_out_prompts()
        models = {
            name: NeuronQwen36ForCausalLM.from_pretrained(checkpoint, export=True, **SETTINGS, **settings)
            for name, settings in VARIANTS.items()
        }
        start = time.perf_counter()
        reference = generate(models["bf16"], prompts)
        comparisons = {}
        for name, model in models.items():
            if name == "bf16":
                continue
            _, forced_logits = generate(model, prompts, forced=reference[0])
            free, _ = generate(model, prompts)
            comparisons[f"{name} vs bf16"] = compare(reference, forced_logits, free)
        seconds = time.perf_counter() - start
        report = json.loads((checkpoint / "text_model.json").read_text())
    reference_probs = torch.softmax(reference[1], dim=-1)
    result = {
        "command": command_line(),
        "machine": machine(),
        "model": {**report["settings"], "final_train_loss": report["final_loss"]},
        "settings": {
            **SETTINGS,
            "prompts": PROMPTS,
            "prompt_length": PROMPT_LENGTH,
            "new_tokens": NEW_TOKENS,
        },
        "deterministic": "one run: training, quantization and greedy generation are all seeded / exact",
        "reference_mean_top1_probability": reference_probs.max(-1).values.mean().item(),
        "sglang_mean_kl_reference": SGLANG_MEAN_KL,
        "comparisons": comparisons,
        "seconds": seconds,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "| vs bf16 (unquantized) | KL mean | KL p99 | top-1 agreement | free-running greedy match | "
        "mean first difference |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, c in comparisons.items():
        lines.append(
            f"| {name.removesuffix(' vs bf16')} | {c['kl_mean']:.5f} | {c['kl_p99']:.5f} | "
            f"{c['top1_agreement']:.1%} | {c['free_running_greedy_match']:.1%} | "
            f"token {c['mean_first_difference']:.0f} of {NEW_TOKENS} |"
        )
    print("\n".join(lines))
    print(
        f"{comparisons[next(iter(comparisons))]['positions']} positions per comparison; wrote {args.output}"
    )


if __name__ == "__main__":
    main()
