"""Tensor parallelism on this machine: tp=1 against tp=2 (`--backend`: cpu, the compiled graphs, or eager;
gloo), same checkpoint
(bench_generate's random model of the Qwen3.5-0.8B shape, `--layers` layers), same tokens, same dtype; with
the memory per rank and the collectives' traffic per decode step, measured here and computed for Qwen3.6-27B
at TP=4.

Each figure is `--repeats` rounds after a warm-up, tp=1 and tp=2 alternated round by round; the JSON keeps
every run. tp=1 runs with all of this process's threads, tp=2 with half on each of its two processes (what
`from_pretrained(tp_degree=2)` gives each rank), so both sides use the same cores.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_tp.py                   # cpu backend, ~10 min on 2 cores
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_tp.py --backend eager
    python benchmarks/bench_tp.py --layers 2 --decode-steps 4 --repeats 2 --output /tmp/tp.json   # smoke

Writes benchmarks/results/bench_tp_<backend>.json and .png and prints a table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from bench_generate import random_checkpoint
from timing import alternate, fmt, machine, paired_ratios, rates

from optimum_qwen36 import NeuronQwen36ForCausalLM

RESULTS = Path(__file__).parent / "results"
# Qwen3.6-27B (../shared/REFERENCE.md): what one decode step all-reduces.
QWEN36_27B = {"layers": 64, "hidden": 5120, "vocab": 248320, "dtype_bytes": 2}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def parameter_bytes(model: NeuronQwen36ForCausalLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.parameters())


def collective_traffic(
    layers: int, hidden: int, vocab: int, dtype_bytes: int, degree: int, rows: int
) -> dict:
    """Per decode step of `rows` rows: two all-reduces of [rows, hidden] per layer (after the mixer and
    after the MLP) and one for the vocab-parallel embedding; one all-gather of the logits [rows, vocab]. A
    ring all-reduce sends 2 (degree - 1) / degree of its message from each rank, a ring all-gather
    (degree - 1) / degree of the gathered tensor."""
    message = rows * hidden * dtype_bytes
    count = 2 * layers + 1
    logits = rows * vocab * dtype_bytes
    return {
        "all_reduces": count,
        "all_reduce_message_bytes": message,
        "all_gather_bytes": logits,
        "bytes_sent_per_rank": int((count * message * 2 + logits) * (degree - 1) / degree),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=("cpu", "eager"), default="cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, help="default: benchmarks/results/bench_tp_<backend>.json")
    args = parser.parse_args()
    args.output = args.output or RESULTS / f"bench_tp_{args.backend}.json"

    threads = torch.get_num_threads()
    scratch = Path(tempfile.mkdtemp(prefix="bench-tp-"))
    checkpoint = random_checkpoint(scratch / "ckpt", args.layers, getattr(torch, args.dtype))
    settings = dict(
        export=True,
        backend=args.backend,
        dtype=args.dtype,
        batch_size=args.batch_size,
        sequence_length=args.prompt_length + args.decode_steps + 64,
        prefill_chunk_size=args.prompt_length,
    )
    models = {
        degree: NeuronQwen36ForCausalLM.from_pretrained(checkpoint, tp_degree=degree, **settings)
        for degree in (1, 2)
    }
    rank_threads = {1: threads, 2: max(1, threads // 2)}
    generator = torch.Generator().manual_seed(0)
    vocab = models[1].config.vocab_size
    prompt = torch.randint(1, vocab, (1, args.prompt_length), generator=generator)
    batch = torch.randint(1, vocab, (args.batch_size, 16), generator=generator)

    def timed(degree: int, input_ids: torch.Tensor, new_tokens: int) -> float:
        torch.set_num_threads(rank_threads[degree])
        start = time.perf_counter()
        models[degree].generate(input_ids, max_new_tokens=new_tokens, do_sample=False)
        return time.perf_counter() - start

    measures = {}
    for degree in (1, 2):
        measures[f"prefill/tp{degree}"] = lambda d=degree: timed(d, prompt, 1)
        for rows in (1, args.batch_size):
            # decode time = generate(prefill + steps) - generate(prefill + 1): the steps alone
            def decode(d: int = degree, r: int = rows) -> float:
                ids = batch[:r]
                return timed(d, ids, args.decode_steps + 1) - timed(d, ids, 1)

            measures[f"decode_b{rows}/tp{degree}"] = decode
    seconds = alternate(measures, args.repeats)
    torch.set_num_threads(threads)

    results = {"prefill": {}, "decode": {}}
    for degree in (1, 2):
        results["prefill"][f"tp{degree}"] = rates(args.prompt_length, seconds[f"prefill/tp{degree}"])
        for rows in (1, args.batch_size):
            key = f"decode_b{rows}/tp{degree}"
            results["decode"].setdefault(f"b{rows}", {})[f"tp{degree}"] = rates(
                rows * args.decode_steps, seconds[key]
            )
    results["prefill"]["tp2_vs_tp1"] = paired_ratios(seconds["prefill/tp1"], seconds["prefill/tp2"])
    for rows in (1, args.batch_size):
        results["decode"][f"b{rows}"]["tp2_vs_tp1"] = paired_ratios(
            seconds[f"decode_b{rows}/tp1"], seconds[f"decode_b{rows}/tp2"]
        )

    split = models[2]
    worker_pid = split.tensor_parallel.group.workers[0].pid
    config = split.config
    report = {
        "machine": machine(),
        "settings": vars(args)
        | {"output": str(args.output), "threads": threads, "rank_threads": rank_threads},
        "tokens_per_second": results,
        "memory": {
            "parameter_bytes": {"tp1": parameter_bytes(models[1]), "tp2_per_rank": parameter_bytes(split)},
            "worker_rss_bytes": rss_bytes(worker_pid),
        },
        "collective_traffic_per_decode_step": {
            "this_model_tp2_b1": collective_traffic(
                config.num_hidden_layers, config.hidden_size, config.vocab_size, 2, 2, 1
            ),
            "qwen3.6-27b_tp4_b1": collective_traffic(**QWEN36_27B, degree=4, rows=1),
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")

    print(f"{'':18} {'tp=1':>22} {'tp=2':>22} {'tp2 / tp1 (per round)':>24}")
    rows_out = [("prefill", results["prefill"])] + [
        (f"decode batch {k[1:]}", v) for k, v in results["decode"].items()
    ]
    for name, entry in rows_out:
        ratio = fmt(entry["tp2_vs_tp1"], 2, "x")
        print(f"{name:18} {fmt(entry['tp1']):>22} {fmt(entry['tp2']):>22} {ratio:>24}")
    memory = report["memory"]
    one_rank, per_rank = (memory["parameter_bytes"][k] / 1e6 for k in ("tp1", "tp2_per_rank"))
    worker = memory["worker_rss_bytes"] / 1e6
    print(f"parameters: tp1 {one_rank:.0f} MB, tp2 {per_rank:.0f} MB per rank (worker RSS {worker:.0f} MB)")
    big = report["collective_traffic_per_decode_step"]["qwen3.6-27b_tp4_b1"]
    sent = big["bytes_sent_per_rank"] / 1e6
    print(
        f"Qwen3.6-27B at TP=4, one decode token: {big['all_reduces']} all-reduces of "
        f"{big['all_reduce_message_bytes']} B and the logits' all-gather, {sent:.2f} MB sent per rank"
    )
    plot(report, args.output.with_suffix(".png"))


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["tokens_per_second"]
    entries = [("prefill", results["prefill"])] + [(f"decode {k}", v) for k, v in results["decode"].items()]
    figure, axes = plt.subplots(1, len(entries), figsize=(4 * len(entries), 3.5))
    for axis, (name, entry) in zip(axes, entries, strict=True):
        medians = [entry[f"tp{d}"]["median"] for d in (1, 2)]
        errors = [
            [m - entry[f"tp{d}"]["min"] for d, m in zip((1, 2), medians, strict=True)],
            [entry[f"tp{d}"]["max"] - m for d, m in zip((1, 2), medians, strict=True)],
        ]
        axis.bar(["tp=1", "tp=2"], medians, yerr=errors, capsize=4, color=["#888", "#3a7"])
        axis.set_title(name)
        axis.set_ylabel("tokens / s")
    backend = report["settings"]["backend"]
    figure.suptitle(f"tensor parallelism on this machine ({backend} backend, gloo)")
    figure.tight_layout()
    figure.savefig(path)


if __name__ == "__main__":
    main()
