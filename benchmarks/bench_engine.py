"""Serving throughput and latency: the continuous-batching engine against static-batch `generate()` (and
vLLM-CPU's offline `LLM.generate` when its Python is given), on the same requests.

A workload is `--requests` requests from a fixed seed: prompts of `--prompt-tokens MIN MAX` random tokens,
each with its own output length in `--output-tokens MIN MAX`, greedy, no EOS (every request generates
exactly its output length on every side: the same tokens are computed). Two arrival patterns:
- `burst`: every request submitted at once;
- `poisson`: arrivals at `--rate` requests/s (exponential gaps from the same seed).
Methods, on one exported model (the same compiled graphs, batch `--batch-size`):
- `engine`: `create_engine()`, stepped in this process; a request is added when it arrives;
- `static generate`: `generate()` on batches of up to `--batch-size` requests in arrival order, each batch
  started when the previous one ended and at least one request has arrived; a batch runs until its
  longest output (what a static batch costs);
- `vllm` (optional): `--vllm-python PY` (or $OPTIMUM_QWEN36_VLLM_PYTHON), a Python with vLLM installed
  (`../shared/peers/setup_vllm_cpu.sh` makes one), started after sourcing `--vllm-env SCRIPT` where given
  (or $OPTIMUM_QWEN36_VLLM_ENV; vLLM-CPU's `vllm_env.sh` there); burst only, `LLM.generate` on the same
  token ids with `max_num_seqs=--batch-size`, total time only (offline vLLM reports no per-token times),
  its process kept loaded so that each of its rounds runs right after one of ours (`engine_over_vllm`: the
  ratio per round). Skipped, and said so in the output, when not given.
Per run: total time, output tok/s, and over the requests TTFT (arrival to first token) and TPOT (time per
output token after the first) p50 / p99. Methods alternate run by run (`--repeats`); the JSON keeps every
run and min / median / max. Also checked: each request's tokens are the same from the engine and from
static generate (`same_tokens`). With `burst`, each round also times the `prefill floor`: the engine
prefilling every prompt and giving each its first token only. No scheduler finishes the workload sooner,
so static generate's total over it (`static_total_over_floor`) bounds what any engine can gain on it.

Default model: bench_generate.py's random 0.75B model (24 layers) in bfloat16 (`--dtype float32` for the
float32 one).

    python benchmarks/bench_engine.py                                               # the full workload
    python benchmarks/bench_engine.py --layers 4 --requests 16 \\
        --prompt-tokens 64 512 --output-tokens 16 64 --rate 1                        # a smaller one
    python benchmarks/bench_engine.py --vllm-python $HOME/.cache/qwen36-peers/vllm-venv/bin/python \\
        --vllm-env ../shared/peers/vllm_env.sh

Writes benchmarks/results/bench_engine.json and .png (or --output and its .png) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_generate import random_checkpoint
from timing import VLLM_PYTHON_ENV, PeerProcess, add_vllm_arguments, command_line, fmt, machine, spread

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.engine import EngineRequest, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
ENGINE, STATIC, VLLM = "engine", "static generate", "vllm"
PREFILL_FLOOR = "prefill floor"


@dataclass
class Work:
    prompt: list[int]
    output_tokens: int
    arrival_s: float  # after the start of the run


@dataclass
class Served:
    """One request's timeline in a run (seconds after the run's start) and its tokens."""

    arrival_s: float
    token_s: list[float]
    tokens: list[int]


def workload(args: argparse.Namespace, vocab: int, pattern: str) -> list[Work]:
    rng = random.Random(args.seed)
    gaps = [rng.expovariate(args.rate) if pattern == "poisson" else 0.0 for _ in range(args.requests)]
    works, arrival = [], 0.0
    for gap in gaps:
        arrival += gap
        length = rng.randint(*args.prompt_tokens)
        prompt = [rng.randrange(1, min(vocab, 200_000)) for _ in range(length)]
        works.append(Work(prompt, rng.randint(*args.output_tokens), arrival))
    return works


def run_engine(model: NeuronQwen36ForCausalLM, works: list[Work]) -> list[Served]:
    engine = model.create_engine()
    pending = deque(sorted(range(len(works)), key=lambda i: works[i].arrival_s))
    requests = {}
    start = time.monotonic()
    while pending or engine.has_unfinished():
        now = time.monotonic() - start
        while pending and works[pending[0]].arrival_s <= now:
            i = pending.popleft()
            params = SamplingParams(temperature=0, max_tokens=works[i].output_tokens, ignore_eos=True)
            requests[i] = engine.request(engine.add_request(EngineRequest(works[i].prompt, params)))
            requests[i].arrival_time = start + works[i].arrival_s
        if engine.has_unfinished():
            engine.step()
        else:
            time.sleep(max(0.0, works[pending[0]].arrival_s - now))
    return [
        Served(works[i].arrival_s, [t - start for t in requests[i].token_times], requests[i].output_ids)
        for i in range(len(works))
    ]


def prefill_floor(model: NeuronQwen36ForCausalLM, works: list[Work]) -> float:
    """Seconds the engine takes to prefill every prompt of a burst and give each its first token only."""
    firsts = [dataclasses.replace(w, output_tokens=1, arrival_s=0.0) for w in works]
    return max(s.token_s[-1] for s in run_engine(model, firsts))


class StepTimes:
    """A streamer that timestamps each put after the prompt's: one per generated step."""

    def __init__(self, start: float) -> None:
        self.start, self.times, self._prompt_seen = start, [], False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.monotonic() - self.start)
        self._prompt_seen = True

    def end(self) -> None:
        pass


def run_static(model: NeuronQwen36ForCausalLM, works: list[Work], batch_size: int) -> list[Served]:
    order = sorted(range(len(works)), key=lambda i: works[i].arrival_s)
    served: dict[int, Served] = {}
    start = time.monotonic()
    while order:
        now = time.monotonic() - start
        if works[order[0]].arrival_s > now:
            time.sleep(works[order[0]].arrival_s - now)
            now = time.monotonic() - start
        batch = [i for i in order[:batch_size] if works[i].arrival_s <= now]
        order = [i for i in order if i not in batch]
        width = max(len(works[i].prompt) for i in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, i in enumerate(batch):
            input_ids[row, width - len(works[i].prompt) :] = torch.tensor(works[i].prompt)
            mask[row, width - len(works[i].prompt) :] = 1
        times = StepTimes(start)
        out = model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=max(works[i].output_tokens for i in batch),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            streamer=times,
        )
        for row, i in enumerate(batch):
            n = works[i].output_tokens
            served[i] = Served(works[i].arrival_s, times.times[:n], out[row, width : width + n].tolist())
    return [served[i] for i in range(len(works))]


VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
spec = json.load(open(sys.argv[1]))
llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
          max_num_seqs=spec["batch_size"], enable_prefix_caching=False, seed=0)
prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True) for n in spec["outputs"]]
llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
print("VLLM_READY " + json.dumps({"vllm": __import__("vllm").__version__}), flush=True)
for command in sys.stdin:  # one round per line, when the benchmark's own round has ended
    if command.strip() != "round":
        break
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    round = {"total_s": time.perf_counter() - start,
             "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    print("VLLM_ROUND " + json.dumps(round), flush=True)
"""


class VllmRounds:
    """vLLM-CPU's offline `LLM.generate` on the workload, in its own process (timing.PeerProcess), each of
    its rounds run right after ours."""

    def __init__(self, checkpoint: Path, works: list[Work], args: argparse.Namespace) -> None:
        spec = {
            "model": str(checkpoint),
            "dtype": args.dtype,
            "max_model_len": max_len(args),
            "batch_size": args.batch_size,
            "prompts": [w.prompt for w in works],
            "outputs": [w.output_tokens for w in works],
        }
        self._process = PeerProcess("vLLM-CPU", VLLM_SCRIPT, spec, args.vllm_python, args.vllm_env)
        self.version = self._process.ready["vllm"]

    def round(self) -> dict:
        """One timed `LLM.generate` of every request: total_s and output_tok_per_s."""
        done = self._process.request("round", "VLLM_ROUND ")
        return {"total_s": done["total_s"], "output_tok_per_s": done["output_tokens"] / done["total_s"]}

    def close(self) -> None:
        self._process.close()


def percentile(values: list[float], q: float) -> float:
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))


def metrics(served: list[Served]) -> dict:
    total = max(s.token_s[-1] for s in served)
    ttft = [s.token_s[0] - s.arrival_s for s in served]
    tpot = [(s.token_s[-1] - s.token_s[0]) / (len(s.token_s) - 1) for s in served if len(s.token_s) > 1]
    tokens = sum(len(s.tokens) for s in served)
    return {
        "total_s": total,
        "output_tok_per_s": tokens / total,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5),
        "tpot_p99_s": percentile(tpot, 0.99),
    }


def max_len(args: argparse.Namespace) -> int:
    return -(-(args.prompt_tokens[1] + args.output_tokens[1] + 1) // 64) * 64


def summarise(runs: list[dict]) -> dict:
    return {key: spread([r[key] for r in runs]) for key in runs[0]}


def table(report: dict) -> str:
    lines = [
        "| pattern | method | output tok/s | total s | TTFT p50 / p99 s | TPOT p50 / p99 ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for pattern, methods in report["results"].items():
        for method, m in methods.items():
            if "skipped" in m:
                lines.append(f"| {pattern} | {method} | skipped: {m['skipped']} | | | |")
                continue
            if method == PREFILL_FLOOR:
                total = fmt(m["total_s"])
                lines.append(f"| {pattern} | {method}: prompts and first tokens only | | {total} | | |")
                continue
            latency = f"{fmt(m['ttft_p50_s'], 2)} / {fmt(m['ttft_p99_s'], 2)}" if "ttft_p50_s" in m else "n/a"
            per_token = (
                f"{m['tpot_p50_s']['median'] * 1e3:.0f} / {m['tpot_p99_s']['median'] * 1e3:.0f}"
                if "tpot_p50_s" in m
                else "n/a"
            )
            lines.append(
                f"| {pattern} | {method} | {fmt(m['output_tok_per_s'])} | {fmt(m['total_s'])} | "
                f"{latency} | {per_token} |"
            )
    for pattern, ratio in report["engine_over_static"].items():
        lines.append(f"\nengine / static generate output tok/s ({pattern}, per round): {fmt(ratio, 2)}x")
        floor = report["results"][pattern].get(PREFILL_FLOOR)
        if floor:
            ceiling = fmt(floor["static_total_over_floor"], 2)
            lines.append(f"static generate total / prefill floor ({pattern}, per round): {ceiling}x")
        vllm = report["results"][pattern].get(VLLM, {})
        if "engine_over_vllm" in vllm:
            ratio = fmt(vllm["engine_over_vllm"], 2)
            lines.append(f"engine / vLLM output tok/s ({pattern}, per round): {ratio}x")
    return "\n".join(lines)


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, medians, lows, highs = [], [], [], []
    for pattern, methods in report["results"].items():
        for method, m in methods.items():
            if "output_tok_per_s" in m:
                s = m["output_tok_per_s"]
                labels.append(f"{pattern}\n{method}")
                medians.append(s["median"])
                lows.append(s["median"] - s["min"])
                highs.append(s["max"] - s["median"])
    ax.bar(labels, medians, yerr=[lows, highs], capsize=4, color="#4c72b0")
    ax.set_ylabel("output tokens / s (median, min-max)")
    ax.set_title(f"{report['requests']} requests, {report['model']}")
    fig.tight_layout()
    fig.savefig(path)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and its requests (profile_engine.py times the same workload)."""
    parser.add_argument("--model", help="a checkpoint (default: a random model of --layers layers)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--backend", default="cpu", choices=["eager", "cpu", "cuda"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[64, 2048], metavar=("MIN", "MAX"))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--batch-size", type=int, default=8, help="compiled batch = engine slots (default 8)")
    parser.add_argument("--prefill-chunk-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compile-cache-dir", type=Path, help="reuse compilations across runs of this script"
    )


def workload_model(args: argparse.Namespace, tmp: Path) -> tuple[Path, NeuronQwen36ForCausalLM]:
    """The checkpoint (--model, or a random one written under tmp) and the model exported for the workload."""
    dtype = getattr(torch, args.dtype)
    checkpoint = Path(args.model) if args.model else random_checkpoint(tmp / "ckpt", args.layers, dtype)
    model = NeuronQwen36ForCausalLM.from_pretrained(
        checkpoint,
        export=True,
        backend=args.backend,
        dtype=args.dtype,
        batch_size=args.batch_size,
        sequence_length=max_len(args),
        prefill_chunk_size=args.prefill_chunk_size,
        compile_cache_dir=args.compile_cache_dir,
    )
    return checkpoint, model


def workload_report(args: argparse.Namespace) -> dict:
    """What a report says of its run, model and workload."""
    return {
        "command": command_line(),
        "machine": machine(),
        "model": args.model or f"random {args.layers}-layer Qwen3.6-shaped model ({args.dtype})",
        "backend": args.backend,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "prefill_chunk_size": args.prefill_chunk_size,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "seed": args.seed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_arguments(parser)
    parser.add_argument("--rate", type=float, default=0.5, help="poisson arrivals per second (default 0.5)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--patterns", nargs="+", default=["burst", "poisson"], choices=["burst", "poisson"])
    add_vllm_arguments(parser)
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_engine.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        checkpoint, model = workload_model(args, Path(tmp))
        vocab = model.config.vocab_size
        results: dict[str, dict] = {}
        ratios: dict[str, dict] = {}
        same_tokens: dict[str, bool] = {}
        for pattern in args.patterns:
            works = workload(args, vocab, pattern)
            run_engine(model, works[:2])  # warm-up of both paths (first calls allocate)
            run_static(model, works[:2], args.batch_size)
            runs: dict[str, list[dict]] = {ENGINE: [], STATIC: []}
            floors: list[float] = []
            vllm = VllmRounds(checkpoint, works, args) if pattern == "burst" and args.vllm_python else None
            vllm_runs: list[dict] = []
            try:
                for _ in range(args.repeats):
                    engine_served = run_engine(model, works)
                    static_served = run_static(model, works, args.batch_size)
                    runs[ENGINE].append(metrics(engine_served))
                    runs[STATIC].append(metrics(static_served))
                    if pattern == "burst":
                        floors.append(prefill_floor(model, works))
                    if vllm is not None:
                        vllm_runs.append(vllm.round())
                    # Over every repeat, not only the last one.
                    same_tokens[pattern] = same_tokens.get(pattern, True) and all(
                        a.tokens == b.tokens for a, b in zip(engine_served, static_served, strict=True)
                    )
                    print(f"{pattern}: engine {runs[ENGINE][-1]['output_tok_per_s']:.1f} tok/s, static "
                          f"{runs[STATIC][-1]['output_tok_per_s']:.1f} tok/s", flush=True)  # fmt: skip
            finally:
                if vllm is not None:
                    vllm.close()
            results[pattern] = {method: {**summarise(r), "runs": r} for method, r in runs.items()}
            ratios[pattern] = spread(
                [a["output_tok_per_s"] / b["output_tok_per_s"] for a, b in zip(*runs.values(), strict=True)]
            )
            if floors:
                results[pattern][PREFILL_FLOOR] = {
                    "total_s": spread(floors),
                    # No scheduler finishes the workload faster than its prompts prefill: the most any can
                    # gain on static generate's output throughput, per round.
                    "static_total_over_floor": spread(
                        [r["total_s"] / f for r, f in zip(runs[STATIC], floors, strict=True)]
                    ),
                    "runs": floors,
                }
            if pattern == "burst":
                if vllm is not None:
                    results[pattern][VLLM] = {
                        **summarise(vllm_runs),
                        "version": vllm.version,
                        "runs": vllm_runs,
                        # Per round: vLLM-CPU's round ran right after ours.
                        "engine_over_vllm": spread(
                            [
                                a["output_tok_per_s"] / b["output_tok_per_s"]
                                for a, b in zip(runs[ENGINE], vllm_runs, strict=True)
                            ]
                        ),
                    }
                else:
                    reason = f"no vLLM Python (--vllm-python or ${VLLM_PYTHON_ENV})"
                    results[pattern][VLLM] = {"skipped": reason}

    report = {
        **workload_report(args),
        "poisson_rate_per_s": args.rate,
        "repeats": args.repeats,
        "results": results,
        "engine_over_static": ratios,
        "same_tokens": same_tokens,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    chart(report, args.output.with_suffix(".png"))
    print(table(report))
    print(f"same tokens from the engine and static generate: {same_tokens}")
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
