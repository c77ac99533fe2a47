"""Prefix-cache benchmark: cold vs warm time to first token (TTFT), a chat replay, hit rate, memory.

    python benchmarks/bench_prefix_cache.py                      # random "small" model, eager backend
    python benchmarks/bench_prefix_cache.py --model PATH_OR_ID --backend eager --dtype bfloat16

For each shared-prefix length S, a first request (S tokens + a 64-token suffix) runs on an empty
cache (cold), then a second request with the same S tokens and another 64-token suffix (warm).
The chat replay feeds a conversation (system prompt, then user message / generated answer turns)
to a model without prefix caching (cold) and to the cached one (warm), turn by turn, and checks
that both produce the same tokens. Writes JSON and a PNG chart, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from optimum_qwen36 import NeuronQwen36ForCausalLM

RESULTS = Path(__file__).parent / "results"

# A random model small enough for a 2-core CPU at 8K tokens, with the real 3 GDN : 1 attention pattern.
SMALL_CONFIG: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)


class FirstTokenTimer:
    """A streamer that notes when generate() emits its first new token (the first put is the prompt)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self._puts = 0

    def put(self, value: torch.Tensor) -> None:
        self._puts += 1
        if self._puts == 2:
            self.first = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def random_checkpoint(directory: Path) -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SMALL_CONFIG)).save_pretrained(directory)
    return directory


def run(model: NeuronQwen36ForCausalLM, prompt: torch.Tensor, new_tokens: int) -> tuple[float, Any]:
    timer = FirstTokenTimer()
    out = model.generate(
        prompt[None], max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
        streamer=timer, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    assert timer.first is not None
    return timer.first, out


def shared_prefix_sweep(
    model: NeuronQwen36ForCausalLM, sizes: list[int], suffix: int, vocab: int, repeats: int
) -> list[dict[str, Any]]:
    """Per size: the best of ``repeats`` (cold on an emptied cache, then warm with another suffix)."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for size in sizes:
        prefix = torch.randint(1, vocab, (size,), generator=gen)
        colds, warms, hits = [], [], []
        for _ in range(repeats):
            model.prefix_cache.clear()
            first, second = (
                torch.cat([prefix, torch.randint(1, vocab, (suffix,), generator=gen)]) for _ in "ab"
            )
            colds.append(run(model, first, 1)[0])
            warm, out = run(model, second, 1)
            warms.append(warm)
            hits.append(int(out.cached_tokens[0]))
        stats = model.prefix_cache.stats()
        cold, warm = min(colds), min(warms)
        rows.append(
            dict(
                shared_prefix=size,
                suffix=suffix,
                cold_ttft_s=cold,
                warm_ttft_s=warm,
                warm_over_cold=warm / cold,
                warm_cached_tokens=min(hits),
                bytes_used=stats["bytes_used"],
                checkpoints=stats["checkpoints"],
            )
        )
        print(
            f"shared {size:5d}: cold {cold:7.3f}s  warm {warm:6.3f}s  ({100 * warm / cold:5.1f}%)  "
            f"cached {min(hits)}  cache {stats['bytes_used'] / 2**20:.1f} MiB",
            flush=True,
        )
    return rows


def chat_replay(
    model: NeuronQwen36ForCausalLM,
    baseline: NeuronQwen36ForCausalLM,
    system: int,
    turns: int,
    user: int,
    answer: int,
    vocab: int,
) -> dict[str, Any]:
    """Turn k's prompt = turn k-1's prompt + its answer + a new user message. Each turn runs on the
    baseline (no prefix caching) and then on the cached model, back to back (similar machine load)."""
    model.prefix_cache.clear()
    gen = torch.Generator().manual_seed(2)
    history = torch.randint(1, vocab, (system,), generator=gen)
    rows, identical = [], True
    for turn in range(turns):
        prompt = torch.cat([history, torch.randint(1, vocab, (user,), generator=gen)])
        cold, cold_out = run(baseline, prompt, answer)
        warm, out = run(model, prompt, answer)
        identical &= torch.equal(out.sequences, cold_out.sequences)
        rows.append(
            dict(
                turn=turn + 1,
                prompt_tokens=len(prompt),
                cold_ttft_s=cold,
                warm_ttft_s=warm,
                cached_tokens=int(out.cached_tokens[0]),
            )
        )
        print(
            f"chat turn {turn + 1}: {len(prompt)} tokens, cold {cold:.3f}s, warm {warm:.3f}s, "
            f"cached {rows[-1]['cached_tokens']}",
            flush=True,
        )
        history = out.sequences[0]
    prompt_tokens = sum(t["prompt_tokens"] for t in rows)
    return dict(
        turns=rows,
        same_tokens_warm_and_cold=identical,
        hit_rate=sum(t["cached_tokens"] for t in rows) / prompt_tokens,
        total_ttft_cold_s=sum(t["cold_ttft_s"] for t in rows),
        total_ttft_warm_s=sum(t["warm_ttft_s"] for t in rows),
    )


def chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    sweep = result["shared_prefix"]
    x = range(len(sweep))
    left.bar([i - 0.2 for i in x], [r["cold_ttft_s"] for r in sweep], 0.4, label="cold")
    left.bar([i + 0.2 for i in x], [r["warm_ttft_s"] for r in sweep], 0.4, label="warm (prefix cached)")
    left.set_xticks(list(x), [str(r["shared_prefix"]) for r in sweep])
    left.set_xlabel("shared prefix tokens (+64-token suffix)")
    left.set_ylabel("time to first token (s)")
    left.set_yscale("log")
    left.legend()
    chat = result["chat_replay"]["turns"]
    for mode in ("cold", "warm"):
        right.plot([t["turn"] for t in chat], [t[f"{mode}_ttft_s"] for t in chat], "o-", label=mode)
    right.set_xticks([t["turn"] for t in chat])
    right.set_xlabel("chat turn")
    right.set_ylabel("time to first token (s)")
    right.legend()
    setup = result["setup"]
    fig.suptitle(f"Prefix caching, {setup['model']} ({setup['backend']}, {setup['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| shared prefix | cold TTFT | warm TTFT | warm / cold | cached tokens |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in result["shared_prefix"]:
        lines.append(
            f"| {r['shared_prefix']} + {r['suffix']} | {r['cold_ttft_s']:.3f} s | {r['warm_ttft_s']:.3f} s | "
            f"{100 * r['warm_over_cold']:.1f}% | {r['warm_cached_tokens']} |"
        )
    chat = result["chat_replay"]
    cold, warm = chat["total_ttft_cold_s"], chat["total_ttft_warm_s"]
    lines.append(
        f"| chat replay, {len(chat['turns'])} turns (sum) | {cold:.3f} s | {warm:.3f} s | "
        f"{100 * warm / cold:.1f}% | hit rate {100 * chat['hit_rate']:.0f}% |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint dir or Hub id (default: a random small model)")
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 4096, 8192])
    parser.add_argument("--suffix", type=int, default=64)
    # A warm request computes one chunk (the suffix): with static shapes it costs a whole chunk.
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-gib", type=float, default=2.0)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=1024)
    parser.add_argument("--user", type=int, default=64)
    parser.add_argument("--answer", type=int, default=32)
    # One thread by default: on a shared machine, extra threads oversubscribe the cores and make
    # timings swing several-fold from run to run.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_cache.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model or random_checkpoint(Path(tmp) / "small")
        chat_length = args.system + args.turns * (args.user + args.answer)
        sequence_length = -(-max(max(args.sizes) + args.suffix + 1, chat_length) // 64) * 64
        settings: dict[str, Any] = dict(
            export=True, backend=args.backend, dtype=args.dtype, batch_size=1,
            sequence_length=sequence_length, prefill_chunk_size=args.prefill_chunk,
        )  # fmt: skip
        model = NeuronQwen36ForCausalLM.from_pretrained(
            model_path, prefix_caching=True, prefix_cache_bytes=int(args.cache_gib * 2**30), **settings
        )
        baseline = NeuronQwen36ForCausalLM.from_pretrained(model_path, **settings)
        vocab = model.config.vocab_size
        for m in (model, baseline):  # warm-up (allocations, kernels)
            run(m, torch.randint(1, vocab, (args.prefill_chunk + 5,)), 2)
        result: dict[str, Any] = dict(
            setup=dict(
                model=str(args.model or "random small (hidden 512, 8 layers 3:1)"),
                backend=args.backend,
                dtype=args.dtype,
                prefill_chunk=args.prefill_chunk,
                threads=args.threads,
                cpu=platform.processor() or platform.machine(),
                torch=torch.__version__,
                granularity=model.prefix_cache.config.granularity,
                gdn_checkpoint_bytes=model.prefix_cache.state_spec.nbytes,
                kv_bytes_per_block=model.prefix_cache.kv_bytes_per_block,
            ),
            shared_prefix=shared_prefix_sweep(model, args.sizes, args.suffix, vocab, args.repeats),
            chat_replay=chat_replay(model, baseline, args.system, args.turns, args.user, args.answer, vocab),
        )
        result["stats"] = model.prefix_cache.stats()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    chart(result, args.out.with_suffix(".png"))
    print(markdown(result))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
