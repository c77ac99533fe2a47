"""Prefix-cache benchmark: cold vs warm time to first token (TTFT), a chat replay, hit rate, memory, the
cache's own bookkeeping time, and warm-vs-cold exactness in fp32.

    python benchmarks/bench_prefix_cache.py                      # random "small" model, eager backend
    python benchmarks/bench_prefix_cache.py --model PATH_OR_ID --backend eager --dtype bfloat16
    python benchmarks/bench_prefix_cache.py --sizes 256 --turns 2 --system 128 --answer 4 \
        --exactness-chunks 64 100 --out /tmp/prefix_cache.json                       # a smoke run

For each shared-prefix length S, a first request (S tokens + a 64-token suffix) runs on an empty
cache (cold), then a second request with the same S tokens and another 64-token suffix (warm);
`--repeats` rounds, each on an emptied cache. The time spent inside the PrefixCache methods that
generate() calls (hashing, lookup, checksums, block and checkpoint bookkeeping, state copies) is
recorded per request. The chat replay feeds a conversation (system prompt, then user message /
generated answer turns) to a model without prefix caching (cold) and to the cached one (warm), turn
by turn, `--chat-repeats` times, and checks that both produce the same tokens. Exactness: in fp32,
for each `--exactness-chunks` prefill chunk size, the logits of a prompt on a model without prefix
caching (cold) against the same prompt's first and repeated (warm) runs on a cached model, max |difference|
over every generated step.
Every timing is kept run by run with min / median / max; the median is the headline figure. Writes
JSON and a PNG chart, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from timing import fmt, machine, spread

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


# The PrefixCache methods the engine calls for generate(): their time is the cache's bookkeeping.
BOOKKEEPING = (
    "begin", "restore", "ensure_blocks", "commit", "store_checkpoint", "decode_snapshot_due",
    "stage_checkpoint", "finish",
)  # fmt: skip


class Bookkeeping:
    """Wall time inside the prefix cache's methods (outermost calls only: one method calling another is
    counted once), by method, since the last ``take()``."""

    def __init__(self, cache: Any) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._depth = 0
        self.methods = [name for name in BOOKKEEPING if callable(getattr(cache, name, None))]
        if not self.methods:
            raise RuntimeError(
                "none of the PrefixCache methods this benchmark times exists: update BOOKKEEPING"
            )
        for name in self.methods:
            setattr(cache, name, self._timed(name, getattr(cache, name)))

    def _timed(self, name: str, method: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                self.seconds[name] += time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        taken = {**self.seconds, "total": sum(self.seconds.values())}
        self.seconds.clear()
        return taken


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
    """Per size, ``repeats`` rounds: cold on an emptied cache, then warm with another suffix."""
    gen = torch.Generator().manual_seed(1)
    bookkeeping = Bookkeeping(model.prefix_cache)
    rows = []
    for size in sizes:
        prefix = torch.randint(1, vocab, (size,), generator=gen)
        colds, warms, hits, cold_books, warm_books = [], [], [], [], []
        for _ in range(repeats):
            model.prefix_cache.clear()
            first, second = (
                torch.cat([prefix, torch.randint(1, vocab, (suffix,), generator=gen)]) for _ in "ab"
            )
            bookkeeping.take()
            colds.append(run(model, first, 1)[0])
            cold_books.append(bookkeeping.take())
            warm, out = run(model, second, 1)
            warm_books.append(bookkeeping.take())
            warms.append(warm)
            hits.append(int(out.cached_tokens[0]))
        stats = model.prefix_cache.stats()
        row = dict(
            shared_prefix=size,
            suffix=suffix,
            cold_ttft_s=spread(colds),
            warm_ttft_s=spread(warms),
            warm_over_cold=spread([w / c for w, c in zip(warms, colds, strict=True)]),
            warm_cached_tokens=min(hits),
            bytes_used=stats["bytes_used"],
            checkpoints=stats["checkpoints"],
            bookkeeping_s={
                "methods_timed": bookkeeping.methods,
                "cold": spread([b["total"] for b in cold_books]),
                "warm": spread([b["total"] for b in warm_books]),
                "by_method_median": {
                    mode: {
                        name: spread([b.get(name, 0.0) for b in books])["median"]
                        for name in sorted({n for b in books for n in b} - {"total"})
                    }
                    for mode, books in (("cold", cold_books), ("warm", warm_books))
                },
            },
        )
        rows.append(row)
        print(
            f"shared {size:5d}: cold {fmt(row['cold_ttft_s'], 3)}s  warm {fmt(row['warm_ttft_s'], 3)}s  "
            f"({fmt({k: 100 * v for k, v in row['warm_over_cold'].items() if k != 'runs'})}%)  "
            f"cached {min(hits)}  cache {stats['bytes_used'] / 2**20:.1f} MiB  "
            f"bookkeeping cold {1e3 * row['bookkeeping_s']['cold']['median']:.1f} ms "
            f"warm {1e3 * row['bookkeeping_s']['warm']['median']:.1f} ms",
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
    repeats: int,
) -> dict[str, Any]:
    """Turn k's prompt = turn k-1's prompt + its answer + a new user message. Each turn runs on the
    baseline (no prefix caching) and then on the cached model, back to back (similar machine load).
    The replay is run ``repeats`` times (the same conversation, the cache emptied first)."""
    replays, identical_every_replay = [], True
    for _ in range(repeats):
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
            history = out.sequences[0]
        replays.append(rows)
        identical_every_replay &= identical
        print(
            "chat replay: "
            + ", ".join(
                f"turn {t['turn']} cold {t['cold_ttft_s']:.3f}s warm {t['warm_ttft_s']:.3f}s" for t in rows
            )
            + f"; same tokens: {identical}",
            flush=True,
        )
    prompt_tokens = sum(t["prompt_tokens"] for t in replays[0])
    hit_rates = [sum(t["cached_tokens"] for t in rows) / prompt_tokens for rows in replays]
    return dict(
        repeats=repeats,
        turns=[
            dict(
                turn=first["turn"],
                prompt_tokens=first["prompt_tokens"],
                cold_ttft_s=spread([rows[i]["cold_ttft_s"] for rows in replays]),
                warm_ttft_s=spread([rows[i]["warm_ttft_s"] for rows in replays]),
                cached_tokens=first["cached_tokens"],
            )
            for i, first in enumerate(replays[0])
        ],
        same_tokens_warm_and_cold=identical_every_replay,
        hit_rate=min(hit_rates),
        hit_rate_same_every_replay=len(set(hit_rates)) == 1,
        total_ttft_cold_s=spread([sum(t["cold_ttft_s"] for t in rows) for rows in replays]),
        total_ttft_warm_s=spread([sum(t["warm_ttft_s"] for t in rows) for rows in replays]),
        warm_over_cold_total=spread(
            [sum(t["warm_ttft_s"] for t in rows) / sum(t["cold_ttft_s"] for t in rows) for rows in replays]
        ),
    )


def exactness(
    model_path: str | Path, chunks: list[int], prompt_tokens: int, new_tokens: int, vocab: int, backend: str
) -> list[dict[str, Any]]:
    """fp32, per prefill chunk size: a prompt on a model without prefix caching (cold), and on a cached
    model twice: first on its empty cache (it stores the checkpoint at the last multiple of the granularity
    below the prompt length), then again (warm: restored from that checkpoint). Max |logit difference|
    against the cold run over every generated step, and whether the greedy tokens are the same."""
    prompt = torch.randint(1, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(3))
    settings = dict(do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True)
    rows = []
    for chunk in chunks:
        models = [
            NeuronQwen36ForCausalLM.from_pretrained(
                model_path,
                export=True,
                backend=backend,
                dtype="float32",
                batch_size=1,
                prefix_caching=cached,
                sequence_length=-(-(prompt_tokens + new_tokens) // 64) * 64,
                prefill_chunk_size=chunk,
            )
            for cached in (False, True)
        ]
        baseline, cached = models
        # In this order: the cached model's first run fills its empty cache, the second one hits it.
        runs = (("cold", baseline), ("first", cached), ("warm", cached))
        outs = {
            name: model.generate(
                prompt[None], max_new_tokens=new_tokens, return_dict_in_generate=True, **settings
            )
            for name, model in runs
        }
        logits = {name: torch.stack(out.logits, dim=1).float() for name, out in outs.items()}
        cold, first, warm = outs["cold"], outs["first"], outs["warm"]
        row = dict(
            prefill_chunk=chunk,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            warm_cached_tokens=int(warm.cached_tokens[0]),
            max_abs_logit_diff=(logits["warm"] - logits["cold"]).abs().max().item(),
            first_run_max_abs_logit_diff=(logits["first"] - logits["cold"]).abs().max().item(),
            max_abs_logit=logits["cold"].abs().max().item(),
            same_tokens=torch.equal(warm.sequences, cold.sequences)
            and torch.equal(first.sequences, cold.sequences),
        )
        rows.append(row)
        print(
            f"exactness fp32 chunk {chunk:4d}: warm (cached {row['warm_cached_tokens']}) vs cold max |logit "
            f"diff| {row['max_abs_logit_diff']:.2e}, first cached run vs cold "
            f"{row['first_run_max_abs_logit_diff']:.2e} (logits up to {row['max_abs_logit']:.2f}), "
            f"same tokens {row['same_tokens']}",
            flush=True,
        )
    return rows


def chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    sweep = result["shared_prefix"]
    x = range(len(sweep))
    for offset, mode, label in ((-0.2, "cold", "cold"), (0.2, "warm", "warm (prefix cached)")):
        cells = [r[f"{mode}_ttft_s"] for r in sweep]
        errors = [[c["median"] - c["min"] for c in cells], [c["max"] - c["median"] for c in cells]]
        left.bar(
            [i + offset for i in x], [c["median"] for c in cells], 0.4, yerr=errors, capsize=3, label=label
        )
    left.set_xticks(list(x), [str(r["shared_prefix"]) for r in sweep])
    left.set_xlabel("shared prefix tokens (+64-token suffix)")
    left.set_ylabel("time to first token (s), median (min-max)")
    left.set_yscale("log")
    left.legend()
    chat = result["chat_replay"]["turns"]
    for mode in ("cold", "warm"):
        cells = [t[f"{mode}_ttft_s"] for t in chat]
        right.errorbar(
            [t["turn"] for t in chat],
            [c["median"] for c in cells],
            yerr=[[c["median"] - c["min"] for c in cells], [c["max"] - c["median"] for c in cells]],
            fmt="o-",
            capsize=3,
            label=mode,
        )
    right.set_xticks([t["turn"] for t in chat])
    right.set_xlabel("chat turn")
    right.set_ylabel("time to first token (s)")
    right.legend()
    setup = result["setup"]
    fig.suptitle(f"Prefix caching, {setup['model']} ({setup['backend']}, {setup['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict[str, Any]) -> str:
    repeats = result["setup"]["repeats"]
    lines = [
        f"Timings: median (min-max) of {repeats} rounds.",
        "",
        "| shared prefix | cold TTFT | warm TTFT | warm / cold | cached tokens | cache bytes "
        "| bookkeeping, warm |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["shared_prefix"]:
        ratio = {k: 100 * v for k, v in r["warm_over_cold"].items() if k != "runs"}
        book = {k: 1e3 * v for k, v in r["bookkeeping_s"]["warm"].items() if k != "runs"}
        lines.append(
            f"| {r['shared_prefix']} + {r['suffix']} | {fmt(r['cold_ttft_s'], 3, ' s')} | "
            f"{fmt(r['warm_ttft_s'], 3, ' s')} | {fmt(ratio, 1, '%')} | {r['warm_cached_tokens']} | "
            f"{r['bytes_used'] / 2**20:.1f} MiB | {fmt(book, 1, ' ms')} |"
        )
    chat = result["chat_replay"]
    ratio = {k: 100 * v for k, v in chat["warm_over_cold_total"].items() if k != "runs"}
    lines.append(
        f"| chat replay, {len(chat['turns'])} turns (sum; {chat['repeats']} replays) | "
        f"{fmt(chat['total_ttft_cold_s'], 3, ' s')} | {fmt(chat['total_ttft_warm_s'], 3, ' s')} | "
        f"{fmt(ratio, 1, '%')} | hit rate {100 * chat['hit_rate']:.0f}% | | |"
    )
    if result["exactness"]:
        lines += [
            "",
            "| fp32 prefill chunk | warm vs cold max \\|logit diff\\| | same tokens |",
            "|---:|---:|---:|",
        ]
        for r in result["exactness"]:
            lines.append(f"| {r['prefill_chunk']} | {r['max_abs_logit_diff']:.2e} | {r['same_tokens']} |")
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
    parser.add_argument("--chat-repeats", type=int, default=3)
    parser.add_argument(
        "--exactness-chunks", type=int, nargs="*", default=[16, 64, 128, 256, 100],
        help="fp32 prefill chunk sizes of the warm-vs-cold exactness check (none: skip it)",
    )  # fmt: skip
    parser.add_argument("--exactness-prompt", type=int, default=357, help="prompt tokens of that check")
    parser.add_argument("--exactness-new-tokens", type=int, default=16)
    # One thread by default: on a shared machine, extra threads oversubscribe the cores and make
    # timings swing several-fold from run to run.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_cache.json")
    args = parser.parse_args()
    if args.repeats < 3 or args.chat_repeats < 3:
        parser.error("--repeats and --chat-repeats must be at least 3 (the JSON reports min / median / max)")
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
            command="python " + " ".join(sys.argv),
            setup=dict(
                model=str(args.model or "random small (hidden 512, 8 layers 3:1)"),
                backend=args.backend,
                dtype=args.dtype,
                prefill_chunk=args.prefill_chunk,
                threads=args.threads,
                machine=machine(),
                granularity=model.prefix_cache.config.granularity,
                gdn_checkpoint_bytes=model.prefix_cache.state_spec.nbytes,
                kv_bytes_per_block=model.prefix_cache.kv_bytes_per_block,
                repeats=args.repeats,
            ),
            shared_prefix=shared_prefix_sweep(model, args.sizes, args.suffix, vocab, args.repeats),
            chat_replay=chat_replay(
                model, baseline, args.system, args.turns, args.user, args.answer, vocab, args.chat_repeats
            ),
        )
        result["stats"] = model.prefix_cache.stats()
        result["exactness"] = exactness(
            model_path, args.exactness_chunks, args.exactness_prompt, args.exactness_new_tokens, vocab,
            args.backend,
        )  # fmt: skip

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    chart(result, args.out.with_suffix(".png"))
    print(markdown(result))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
