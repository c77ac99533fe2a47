"""Where the time of a compiled cpu step goes: per region graph (GDN layers, attention layers, head, the
eager step inputs) and, inside the graphs, per kind of work (matrix products, the GDN recurrence, attention,
the rest), for a prefill, a batch-1 decode step and a batched decode step.

The model is exported with Inductor's kernel profiling on (`cpp.enable_kernel_profile`: every generated
kernel is a profiler event) into its own compile cache, so the graphs are the ones `from_pretrained` compiles
plus those events. Each region call runs inside a `record_function` scope named after its graph; every
profiler event is then attributed to the innermost region that contains it and classified by name:
- matmul: the projections (`optimum_qwen36::bf16_linear`, ATen's mm / addmm / linear);
- gdn: everything else inside a GDN layer's graph (its chunked or recurrent delta rule, including the
  delta rule's own batched products, the causal conv, gates, norms);
- attention: everything else inside an attention layer's graph (rotary, the KV write, SDPA, gates, norms);
- head: the final norm and output projection; step inputs: the eager work before the first layer (embedding,
  rotary tables, block tables); rest: what is outside every region (generate()'s loop, sampling).
Times are the medians of --repeats profiled runs of each workload, in ms per call of the workload.

    python benchmarks/profile_steps.py --model /tmp/ckpt        # bench_generate.py --write-checkpoint
    python benchmarks/profile_steps.py --layers 4 --prompt-length 512 --output /tmp/profile.json  # smaller

Writes benchmarks/results/profile_steps.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_generate import prompts, random_checkpoint
from timing import command_line, machine
from torch.profiler import ProfilerActivity, profile, record_function

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.backends import compiled_graph, regions
from optimum_qwen36.exporters import aoti

RESULTS = Path(__file__).resolve().parent / "results"
MATMUL_NAMES = ("bf16_linear", "aten::mm", "aten::addmm", "aten::linear", "cpu_mm_out", "cpu_addmm_out")
CATEGORIES = ("matmul", "gdn", "attention", "head", "step inputs", "rest")


def region_of(package_path: str) -> str:
    """'decode_row.linear_attention.pt2' -> 'linear_attention'."""
    return Path(package_path).name.split(".")[1]


@contextlib.contextmanager
def scoped_regions():
    """Every compiled graph call inside a record_function scope named `region:<region>`, and the step inputs
    inside `region:inputs`."""
    call, inputs = compiled_graph.CompiledGraph.__call__, regions.RegionalStep.decoder_output

    def scoped_call(self, *args):
        with record_function(f"region:{region_of(self.package_path)}"):
            return call(self, *args)

    def scoped_decoder_output(self, *args):
        original = self._inputs

        def timed_inputs(*a):
            with record_function("region:inputs"):
                return original(*a)

        self._inputs = timed_inputs
        try:
            return inputs(self, *args)
        finally:
            self._inputs = original

    compiled_graph.CompiledGraph.__call__ = scoped_call
    regions.RegionalStep.decoder_output = scoped_decoder_output
    try:
        yield
    finally:
        compiled_graph.CompiledGraph.__call__ = call
        regions.RegionalStep.decoder_output = inputs


def category(name: str, region: str | None) -> str:
    if region is None:
        return "rest"
    if region == "inputs":
        return "step inputs"
    if region == "head":
        return "head"
    if any(m in name for m in MATMUL_NAMES):
        return "matmul"
    return "gdn" if region == "linear_attention" else "attention"


def breakdown(prof: profile, wall_s: float, top: int) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Seconds per category: each event's self time goes to the category of its innermost region (the
    scopes' own self time is their overhead: the graph runner's); what no event covers is `rest`. Also the
    `top` events of each category by self time (ms, summed over calls)."""
    totals: dict[str, float] = defaultdict(float)
    by_name: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in prof.events():
        region, parent = None, event
        while parent is not None:
            if parent.name.startswith("region:"):
                region = parent.name.removeprefix("region:")
                break
            parent = parent.cpu_parent
        kind = category(event.name, region)
        totals[kind] += event.self_cpu_time_total / 1e6
        by_name[kind][event.name] += event.self_cpu_time_total / 1e3
    covered = sum(v for k, v in totals.items() if k != "rest")
    totals["rest"] = max(0.0, wall_s - covered)
    top_events = {
        kind: dict(sorted(names.items(), key=lambda item: -item[1])[:top]) for kind, names in by_name.items()
    }
    return dict(totals), top_events


def profiled_runs(run, repeats: int, top: int) -> dict:
    """Medians over `repeats` profiled runs (ms), each run's seconds, and the top events of the median run."""
    run()  # warm-up
    runs, tops = [], []
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            run()
            wall_s = time.perf_counter() - start
        totals, top_events = breakdown(prof, wall_s, top)
        runs.append({"wall_s": wall_s, **totals})
        tops.append(top_events)
    median_run = sorted(range(repeats), key=lambda i: runs[i]["wall_s"])[repeats // 2]
    return {
        key: statistics.median(r.get(key, 0.0) for r in runs) * 1e3 for key in ("wall_s", *CATEGORIES)
    } | {"runs_s": runs, "top_events_ms": tops[median_run]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint directory (default: bench_generate.py's random model)")
    parser.add_argument("--layers", type=int, default=24, help="layers of the random model (default 24)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--prompt-length", type=int, default=2048)
    parser.add_argument("--prefill-chunk-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=6, help="events listed per category (prefill; default 6)")
    parser.add_argument("--output", type=Path, default=RESULTS / "profile_steps.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    aoti.DEFAULT_INDUCTOR_CONFIGS = {**aoti.DEFAULT_INDUCTOR_CONFIGS, "cpp.enable_kernel_profile": True}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.model or str(random_checkpoint(Path(tmp) / "model", args.layers, dtype))
        model = NeuronQwen36ForCausalLM.from_pretrained(
            checkpoint,
            export=True,
            batch_size=args.batch_size,
            sequence_length=args.prompt_length + args.decode_steps + 16,
            prefill_chunk_size=args.prefill_chunk_size,
            dtype=args.dtype,
            compile_cache_dir=Path(tmp) / "cache",
        )
        model.generation_config.eos_token_id = None
        vocab = model.config.vocab_size

        def generate(ids: torch.Tensor, new_tokens: int) -> None:
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
            )

        long_prompt = prompts(args.prompt_length, 1, vocab)
        workloads = {f"prefill {args.prompt_length}": lambda: generate(long_prompt, 1)}
        for rows in sorted({1, args.batch_size}):
            ids = prompts(16, rows, vocab)
            # decode steps alone: a run of decode_steps + 1 new tokens minus a run of 1 (same prefill)
            workloads[f"decode batch {rows}"] = (lambda ids=ids: generate(ids, args.decode_steps + 1), ids)
        results = {}
        with scoped_regions():
            for name, work in workloads.items():
                if isinstance(work, tuple):
                    run, ids = work
                    full = profiled_runs(run, args.repeats, args.top)
                    base = profiled_runs(lambda ids=ids: generate(ids, 1), args.repeats, args.top)
                    per_step = {k: (full[k] - base[k]) / args.decode_steps for k in ("wall_s", *CATEGORIES)}
                    results[name] = {"unit": "ms per decode step", **per_step, "runs": [full, base]}
                else:
                    results[name] = {"unit": "ms per prefill", **profiled_runs(work, args.repeats, args.top)}
                cells = ", ".join(f"{k} {results[name][k]:.1f}" for k in CATEGORIES)
                print(f"{name}: {results[name]['wall_s']:.1f} ms ({cells})", flush=True)
    report = {
        "command": command_line(),
        "model": args.model or f"random Qwen3.6-shaped, {args.layers} layers",
        "dtype": args.dtype,
        "machine": machine(),
        "prefill_chunk_size": args.prefill_chunk_size,
        "repeats": args.repeats,
        "categories": {
            "matmul": "the projections: " + ", ".join(MATMUL_NAMES),
            "gdn": "the rest of each GDN layer's graph: delta rule (its own products included), conv, gates",
            "attention": "the rest of each attention layer's graph: rotary, KV write, SDPA, gates",
            "head": "final norm and output projection",
            "step inputs": "eager work before the first layer",
            "rest": "wall time no event covers: generate()'s loop, sampling, the cache allocation",
        },
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print("| ms | wall | " + " | ".join(CATEGORIES) + " |")
    print("| --- |" + " --- |" * (len(CATEGORIES) + 1))
    for name, r in results.items():
        print(
            f"| {name} ({r['unit']}) | {r['wall_s']:.1f} | "
            + " | ".join(f"{r[k]:.1f}" for k in CATEGORIES)
            + " |"
        )
    for name, r in results.items():
        if "top_events_ms" in r:
            print(f"{name}, top events (ms per prefill):")
            for kind, events in r["top_events_ms"].items():
                print(f"  {kind}: " + "; ".join(f"{event} {ms:.1f}" for event, ms in events.items()))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
