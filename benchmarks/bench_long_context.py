"""A 128K-token prompt on a small random model: time to first token, memory, and that the greedy tokens do not
depend on the prefill chunk size (the same prompt run with two chunk sizes).

The chunked design has no prefix bucket: a prompt of any length is a series of prefill chunks over the paged
KV cache. Measured per chunk size, each on its own export (the chunk size is a compiled shape):
- with the first chunk size, `--repeats` greedy generations of `--new-tokens` tokens: TTFT (the time to the
  first new token, min / median / max) and prefill tok/s; with the second, one (for its tokens);
- memory: the KV cache + GDN state tensors (bytes), and the process's peak RSS so far (`peak_rss_bytes`:
  it includes the compiles, and for the second chunk size everything before it, so it bounds, not measures,
  what generation needs).
Then: are the two runs' greedy tokens equal, and the largest |logit difference| between them (relative to the
largest logit), float32 by default so that difference is rounding only.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_long_context.py          # ~25 min on 2 cores
    python benchmarks/bench_long_context.py --length 4096 --chunk-sizes 512 1024 --repeats 1 \\
        --output /tmp/long.json                                               # a smoke run

Writes benchmarks/results/long_context.json (or --output) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch
from timing import command_line, fmt, machine, spread
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from optimum_qwen36 import NeuronQwen36ForCausalLM

RESULTS = Path(__file__).resolve().parent / "results"


def random_checkpoint(directory: Path, vocab: int) -> Path:
    """A small random model of the Qwen3.6 layout: 8 layers (6 GDN, 2 attention), hidden 512."""
    config = Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=262144,
        tie_word_embeddings=True,
        dtype="float32",
    )
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(config).save_pretrained(directory)
    return directory


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class FirstTokenTime:
    """A generate() streamer that records when the first new token arrives (put() gets the prompt first)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.calls = 0
        self.first_token_s: float | None = None

    def put(self, tokens: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_s = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def run_chunk_size(
    checkpoint: Path,
    prompt: torch.Tensor,
    chunk: int,
    repeats: int,
    args: argparse.Namespace,
    cache_dir: Path,
) -> tuple[dict, torch.Tensor]:
    """`repeats` greedy generations of the prompt on an export with this prefill chunk: TTFT of each, the new
    tokens (checked equal across the repeats) and the logits of the last run."""
    start = time.perf_counter()
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint,
        export=True,
        backend=args.backend,
        batch_size=1,
        sequence_length=prompt.shape[1] + args.new_tokens,
        prefill_chunk_size=chunk,
        dtype=args.dtype,
        compile_cache_dir=cache_dir,
    )
    export_s = time.perf_counter() - start
    ttft, tokens = [], []
    for _ in range(repeats):
        timer = FirstTokenTime()
        out = model.generate(
            prompt, max_new_tokens=args.new_tokens, do_sample=False, streamer=timer,
            return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
        ttft.append(timer.first_token_s)
        tokens.append(out.sequences[0, prompt.shape[1] :].tolist())
    if any(t != tokens[0] for t in tokens):
        raise RuntimeError(f"chunk {chunk}: the repeats generated different tokens: {tokens}")
    result = {
        "prefill_chunk_size": chunk,
        "export_s": export_s,
        "runs": repeats,
        "ttft_s": ttft,
        "prefill_tok_per_s": [prompt.shape[1] / s for s in ttft],
        "cache_bytes": sum(t.numel() * t.element_size() for t in out.past_key_values.step_tensors()),
        "peak_rss_bytes": peak_rss_bytes(),
        "new_tokens": tokens[0],
    }
    if repeats >= 3:
        result["ttft_s"], result["prefill_tok_per_s"] = spread(ttft), spread(result["prefill_tok_per_s"])
    return result, torch.cat(out.logits)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=131072, help="prompt tokens (default 131072)")
    parser.add_argument("--chunk-sizes", type=int, nargs=2, default=[2048, 1024], help="two prefill chunks")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs with the first chunk size, for TTFT (default 3)"
    )
    parser.add_argument("--backend", default="cpu", choices=["eager", "cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--output", type=Path, default=RESULTS / "long_context.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        checkpoint = random_checkpoint(Path(tmp) / "checkpoint", args.vocab)
        prompt = torch.randint(1, args.vocab, (1, args.length), generator=torch.Generator().manual_seed(1))
        runs, logits = [], []
        # The second chunk size runs once: it is there for its tokens, not its time.
        for chunk, repeats in zip(args.chunk_sizes, (args.repeats, 1), strict=True):
            cache_dir = Path(tmp) / "compile-cache"
            result, run_logits = run_chunk_size(checkpoint, prompt, chunk, repeats, args, cache_dir)
            runs.append(result)
            logits.append(run_logits)
            ttft = fmt(result["ttft_s"], 1, " s") if repeats >= 3 else f"{result['ttft_s'][0]:.1f} s (1 run)"
            print(
                f"chunk {chunk}: TTFT {ttft}, cache {result['cache_bytes'] / 2**20:.0f} MiB, "
                f"peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB",
                flush=True,
            )
    largest = float(logits[0].abs().max())
    report = {
        "command": command_line(),
        "machine": machine(),
        "prompt_tokens": args.length,
        "backend": args.backend,
        "dtype": args.dtype,
        "runs": runs,
        "same_tokens": runs[0]["new_tokens"] == runs[1]["new_tokens"],
        "max_logit_diff_relative": float((logits[0] - logits[1]).abs().max()) / largest,
    }
    print(
        f"greedy tokens equal across chunk sizes {args.chunk_sizes}: {report['same_tokens']}; "
        f"max |logit diff| / max |logit| = {report['max_logit_diff_relative']:.2e}"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
