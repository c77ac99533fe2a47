"""Generation speed of a compiled backend (`cpu`, or `cuda` on a GPU) against transformers eager on the same
device, same weights, same dtype, same token ids, same logits computed.

Measures, in one run:
- export: the first export into an empty compile cache (the graphs compile; by default the AOTInductor cache
  is a fresh directory too), then `--export-loads` exports that find the graphs in the compile cache;
- prefill tok/s at each prompt length (one row): ours `generate(max_new_tokens=1)`, transformers
  `model(input_ids, logits_to_keep=1, use_cache=True)`: both compute the logits of the last prompt token
  only (ours also one row per prefill chunk: `logit_rows_per_prefill` in the JSON), and fill a cache;
- decode tok/s at batch 1 and at the compiled batch: `generate(max_new_tokens=decode_steps + 1)`, greedy,
  no EOS, on both sides; a streamer timestamps every new token, and the rate is rows x decode_steps over the
  time from the first new token (after prefill) to the last, so prefill time does not enter it;
- the device's read bandwidth and the batch-1 decode roofline (bytes of weights read per token / bandwidth);
- with `--fp8 mlp linear` / `--int4 mlp linear` (`--int4-group-size`): the same model with those linear
  layers quantized to FP8 / 4 bits at export (same compute dtype), each with its weight bytes and the
  resident memory its load added, measured in the same rounds (each over every peer, per round);
- with `--llama-bench BIN --gguf q8_0=FILE ...` (or $LLAMA_BENCH): llama.cpp's `llama-bench` on GGUF files
  of the same checkpoint, same threads: its batch-1 decode of --decode-steps tokens alternated round by round
  with ours (one `llama-bench -r 1` per round; the table adds the per-round ratio), its prefill at the same
  prompt lengths after ours; without them the JSON and the table say it was skipped. `--write-checkpoint DIR`
  writes the default random checkpoint (with the tokenizer files and chat template) for the GGUF converter
  and exits;
- with `--vllm-python PY` (or $OPTIMUM_QWEN36_VLLM_PYTHON; `--vllm-env SCRIPT` is sourced first, e.g.
  ../shared/peers/vllm_env.sh): vLLM-CPU's offline `LLM.generate` on the same token ids (prefill at each
  length, decode at batch 1 and the compiled batch), kept loaded in its own process and alternated round by
  round with ours; else said skipped. The table gives ours over each peer per round and as a ratio of
  medians.
Every figure is `--repeats` runs after a warm-up, every side alternated run by run (all see the same machine
load); the JSON keeps every run and min / median / max; the median is the headline figure.

Default model: a random ~0.75B model of the Qwen3.6 shape family (hidden 1024, 24 layers 3:1, 8/2 attention
heads of 256, 16/16 GDN heads of 128, vocab 248320, tied embeddings).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_generate.py    # ~15 min on 2 cores, ~8 of them compiling
    python benchmarks/bench_generate.py --layers 2 --prompt-lengths 64 --batch-size 2 --decode-steps 4 \\
        --repeats 3 --prefill-chunk-size 64 --output /tmp/bench_generate.json                  # a smoke run
    python benchmarks/bench_generate.py --model PATH_OR_ID   # a real checkpoint
    python benchmarks/bench_generate.py --backend cuda       # on a GPU (.ci/device_check runs it)
    python benchmarks/bench_generate.py --write-checkpoint /tmp/ckpt   # then: peers/to_gguf.sh /tmp/ckpt q8_0
    python benchmarks/bench_generate.py --model /tmp/ckpt --dtype float32 --fp8 mlp linear \\
        --llama-bench "$BIN/llama-bench" --gguf bf16=... --gguf q8_0=...  # FP8 and llama.cpp side by side
    python benchmarks/bench_generate.py --model /tmp/ckpt --decode-steps 64 --repeats 3 \\
        --llama-bench "$BIN/llama-bench" --gguf bf16=... --gguf q8_0=... \\
        --vllm-python $PEERS_DIR/vllm-venv/bin/python --vllm-env ../shared/peers/vllm_env.sh  # every peer

Writes benchmarks/results/bench_generate.json and .png (or --output and its .png) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from timing import (
    VLLM_PYTHON_ENV,
    PeerProcess,
    add_vllm_arguments,
    alternate,
    command_line,
    fmt,
    machine,
    paired_ratios,
    portable,
    rates,
    spread,
    wall,
)
from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.network.neuron_config import MODULE_SETS
from optimum_qwen36.ops import huge_pages
from optimum_qwen36.tokenizer import save_qwen36_tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
OURS, THEIRS = "ours", "transformers eager"
GREEDY = {"do_sample": False, "pad_token_id": 0}  # and no EOS (the models' eos_token_id is set to None)


def layer_types(layers: int) -> list[str]:
    """Qwen3.6's pattern, 3 GDN layers then one attention layer; at least one attention layer."""
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def random_checkpoint(directory: Path, layers: int, dtype: torch.dtype) -> Path:
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(text_config(layers, dtype)).to(dtype).save_pretrained(directory)
    return directory


def text_config(layers: int, dtype: torch.dtype) -> Qwen3_5TextConfig:
    """The random ~0.75B model's config (`layers` decoder layers)."""
    return Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=layers,
        layer_types=layer_types(layers),
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        dtype=str(dtype).removeprefix("torch."),
    )


def read_bandwidth_gbs(device: str, repeats: int, gigabytes: float = 1.0) -> dict:
    """spread() of GB/s of a 1 GiB float32 sum (read once per run), on the CPU in transparent huge pages,
    the memory the cpu backend streams its weights from (in 4 KB pages the same sum reads slower, and a
    decode step could beat its roofline)."""
    data = huge_pages.zeros((int(gigabytes * 2**30 / 4),), torch.float32, device).fill_(1.0)
    seconds = alternate({"sum": wall(lambda: data.sum())}, repeats)["sum"]
    return rates(data.numel() * 4 / 1e9, seconds)


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter once, except the embedding table (one row is
    gathered) unless it is tied to the output projection, which reads all of it. `model` has transformers'
    layout (`model.embed_tokens`, `lm_head`): ours or transformers' Qwen3_5ForCausalLM."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == embedding.data_ptr()
    return total if tied else total - embedding.numel() * embedding.element_size()


def prompts(length: int, rows: int, vocab: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(length)
    return torch.randint(1, min(vocab, 200_000), (rows, length), generator=generator).to(device)


class TokenTimes:
    """A streamer that timestamps every put: the prompt, then each step's new tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_seconds(self, steps: int) -> float:
        """Time from the first new token to the last: `steps` decode forward passes."""
        if len(self.times) != steps + 2:  # the prompt, the first token (prefill), then one per decode step
            raise RuntimeError(f"expected {steps + 1} new tokens, the streamer saw {len(self.times) - 1}")
        return self.times[-1] - self.times[1]


class CompileLog(logging.Handler):
    """Collects optimum_qwen36's INFO messages about compiling (per-graph export and AOTInductor times)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(("Compil", "Export", "Reusing")):
            self.records.append(record)

    def summary(self) -> dict:
        graphs: dict[str, dict] = {}
        for r in self.records:
            # regions.py "Exported %s in %.1f s", compile_workers.py "Compiled %s in %.1f s" (with
            # " (worker process)" when a worker compiled it); %s is the package's file name.
            if not (isinstance(r.args, tuple) and len(r.args) == 2 and str(r.args[0]).endswith(".pt2")):
                continue
            graph = graphs.setdefault(Path(str(r.args[0])).stem, {})
            if r.msg.startswith("Exported %s in"):
                graph["export_s"] = r.args[1]
            elif r.msg.startswith("Compiled %s in"):
                graph["aoti_s"] = r.args[1]
                graph["in_worker_process"] = r.msg.endswith("(worker process)")
        return {
            "compiled": any(r.getMessage().startswith("Compiling") for r in self.records),
            "graphs": graphs,
            "log": [r.getMessage() for r in self.records],
        }


def export(
    checkpoint: str, args: argparse.Namespace, cache_dir: Path | None, **quantization: str | int
) -> tuple[object, float, dict]:
    """One `from_pretrained(export=True)`: (model, seconds, what the compile log says)."""
    log = CompileLog()
    logger = logging.getLogger("optimum_qwen36")
    level = logger.level
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    try:
        start = time.perf_counter()
        model = NeuronQwen36ForCausalLM.from_pretrained(
            checkpoint,
            export=True,
            backend=args.backend,
            dtype=args.dtype,
            batch_size=args.batch_size,
            sequence_length=max(args.prompt_lengths) + args.decode_steps + 16,
            prefill_chunk_size=args.prefill_chunk_size,
            compile_cache_dir=cache_dir,
            **quantization,
        )
        seconds = time.perf_counter() - start
    finally:
        logger.removeHandler(log)
        logger.setLevel(level)
    return model, seconds, log.summary()


def measure_export(checkpoint: str, args: argparse.Namespace, scratch: Path) -> tuple[object, dict, Path]:
    """The first export (into an empty compile cache unless --compile-cache-dir), then --export-loads exports
    that hit the compile cache. Returns the last model, the export report and the compile cache used."""
    if args.compile_cache_dir is None:
        cache_dir = scratch / "compile-cache"
        # An empty AOTInductor cache too, so that the first export is what a first-time user waits for.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor-cache")
        where = "a fresh temporary directory (and a fresh TORCHINDUCTOR_CACHE_DIR)"
    else:
        cache_dir, where = args.compile_cache_dir, str(args.compile_cache_dir)
    model, first, log = export(checkpoint, args, cache_dir)
    loads = []
    for _ in range(args.export_loads):
        del model
        model, seconds, hit_log = export(checkpoint, args, cache_dir)
        if hit_log["compiled"]:
            raise RuntimeError("an export after the first one compiled again: the compile cache missed")
        loads.append(seconds)
    files = getattr(model.backend, "files_dir", None)  # the compile-cache entry the graphs were loaded from
    report = {
        "compile_cache": where,
        # One run: a cold compile takes minutes (the 0.75B model: ~8 on 2 cores); the cache hits are repeated.
        "first_export_s": first,
        "first_export_compiled": log["compiled"],
        "first_export_graphs": log["graphs"],
        "first_export_log": log["log"],
        "cache_hit_export_s": spread(loads) if loads else None,
        "compiled_file_bytes": {p.name: p.stat().st_size for p in sorted(Path(files).iterdir())}
        if files is not None
        else None,
    }
    return model, report, cache_dir


def resident_bytes() -> int:
    """This process's resident memory (VmRSS), 0 where /proc is not available."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def quantized_variants(args: argparse.Namespace) -> dict[str, dict]:
    """The export settings of each --fp8 and --int4 set of linear layers, by variant name."""
    variants = {
        f"optimum-qwen36 {args.backend} fp8 {modules}": dict(quantization="fp8", fp8_modules=modules)
        for modules in args.fp8
    }
    for modules in args.int4:
        settings = dict(quantization="int4", int4_modules=modules, int4_group_size=args.int4_group_size)
        variants[f"optimum-qwen36 {args.backend} int4 {modules} g{args.int4_group_size}"] = settings
    return variants


def export_quantized_variants(
    checkpoint: str, args: argparse.Namespace, cache_dir: Path | None
) -> tuple[dict[str, object], dict]:
    """The model with each --fp8 / --int4 set of linear layers quantized at export: (models by name,
    per-variant export seconds and the resident memory its load added)."""
    models, report = {}, {}
    for name, settings in quantized_variants(args).items():
        before = resident_bytes()
        model, seconds, log = export(checkpoint, args, cache_dir, **settings)
        model.generation_config.eos_token_id = None
        models[name] = model
        report[name] = {
            "export_s": seconds,
            "compiled": log["compiled"],
            "rss_added_bytes": resident_bytes() - before,
        }
    return models, report


def prefill_measures(systems: dict, reference, length: int) -> dict[str, Callable[[], float]]:
    first = next(iter(systems.values()))
    ids = prompts(length, 1, first.config.vocab_size)
    mask = torch.ones_like(ids)

    def ours(model) -> Callable[[], float]:
        return wall(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=1, **GREEDY))

    measures = {name: ours(model) for name, model in systems.items()}
    if reference is not None:
        ref_ids = ids.to(reference.device)

        @torch.no_grad()
        def theirs() -> None:
            logits = reference(input_ids=ref_ids, logits_to_keep=1, use_cache=True).logits
            assert logits.shape[1] == 1, "transformers computed more than the last position's logits"

        measures[THEIRS] = wall(theirs)
    return measures


def decode_measures(systems: dict, reference, rows: int, steps: int) -> dict[str, Callable[[], float]]:
    ids = prompts(16, rows, next(iter(systems.values())).config.vocab_size)

    def measure(model, ids: torch.Tensor) -> Callable[[], float]:
        def run() -> float:
            timer = TokenTimes()
            with torch.no_grad():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=steps + 1,
                    streamer=timer,
                    **GREEDY,
                )
            return timer.decode_seconds(steps)

        return run

    measures = {name: measure(model, ids) for name, model in systems.items()}
    if reference is not None:
        measures[THEIRS] = measure(reference, ids.to(reference.device))
    return measures


PeerMeasures = dict[str, dict[str, Callable[[], float]]]  # work label -> peer name -> seconds of one run


def run_benchmarks(
    systems: dict, reference, args: argparse.Namespace, peer_measures: PeerMeasures
) -> tuple[dict, dict]:
    """(results per system: prefill_tok_s / decode_tok_s per length / batch as spreads, speed-ups of each of
    our systems over transformers, of each FP8 variant over the unquantized model and of ours over each peer
    measure that runs in the same rounds, per round). `peer_measures`: by work label ("prefill 512",
    "decode batch 8"), the peers' measures of it (name -> seconds of one run)."""
    peers = list(dict.fromkeys(name for measures in peer_measures.values() for name in measures))
    sides = (*systems, THEIRS, *peers)
    results: dict = {name: {"prefill_tok_s": {}, "decode_tok_s": {}} for name in sides}
    main, *variants = systems
    pairs = [(name, THEIRS) for name in systems] + [(name, main) for name in variants]
    pairs += [(name, peer) for name in systems for peer in peers]
    speedup: dict = {}
    work = []
    for length in args.prompt_lengths:
        work.append((f"prefill {length}", "prefill_tok_s", str(length), length, (systems, reference, length)))
    for rows in args.decode_rows:
        tokens = rows * args.decode_steps
        work.append((f"decode batch {rows}", "decode_tok_s", str(rows), tokens, (systems, reference, rows)))
    for label, metric, key, tokens, setup in work:
        make = prefill_measures if metric == "prefill_tok_s" else decode_measures
        measures = make(*setup) if make is prefill_measures else make(*setup, args.decode_steps)
        measures.update(peer_measures.get(label, {}))
        runs = alternate(measures, args.repeats)
        for side, seconds in runs.items():
            results[side][metric][key] = rates(tokens, seconds)
        for faster, slower in pairs:
            if faster in runs and slower in runs:  # time slower / time faster
                speedup.setdefault(f"{faster} / {slower}", {})[label] = paired_ratios(
                    runs[slower], runs[faster]
                )
        cells = [f"{side} {fmt(results[side][metric][key])} tok/s" for side in runs]
        print(f"{label}: " + ", ".join(cells), flush=True)
    return {name: r for name, r in results.items() if r["prefill_tok_s"] or r["decode_tok_s"]}, speedup


def llama_bench_command(binary: str, gguf: str, prompts: str, steps: int, repeats: int) -> list[str]:
    return [
        binary, "-m", gguf, "-p", prompts, "-n", str(steps), "-t", str(torch.get_num_threads()),
        "-r", str(repeats), "-o", "json",
    ]  # fmt: skip


def llama_decode_measure(command: list[str], steps: int) -> Callable[[], float]:
    """One llama-bench batch-1 decode of `steps` tokens (`command`: one repetition), as seconds: a measure
    that `alternate` runs in the same rounds as ours (on a shared machine the drift between two separate runs
    is as large as the difference measured)."""

    def run() -> float:
        (test,) = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        return steps / test["samples_ts"][0]

    return run


def llama_ggufs(args: argparse.Namespace) -> tuple[dict[str, str], dict]:
    """({'llama.cpp <label>': GGUF path} of the runnable ones, why each requested or possible run is
    skipped)."""
    if not args.llama_bench or not Path(args.llama_bench).is_file():
        reason = f"llama-bench not found at {args.llama_bench!r}" if args.llama_bench else "no --llama-bench"
        return {}, {"llama.cpp": f"skipped: {reason} (nor $LLAMA_BENCH); ../shared/peers/ builds it"}
    ggufs, skipped = {}, {}
    for spec in args.gguf:
        label, _, path = spec.partition("=")
        if Path(path).is_file():
            ggufs[f"llama.cpp {label}"] = path
        else:
            skipped[f"llama.cpp {label}"] = f"skipped: no GGUF file at {path!r}"
    if not args.gguf:
        skipped["llama.cpp"] = "skipped: no --gguf LABEL=FILE given"
    return ggufs, skipped


def llama_bench_prefill(command: list[str]) -> dict:
    """llama-bench's prefill rates (`command`: -p lengths -n 0), as spreads of its repetitions."""
    print(" ".join(command), flush=True)
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    print(out, flush=True)
    return {str(test["n_prompt"]): spread(test["samples_ts"]) for test in json.loads(out)}


VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
spec = json.load(open(sys.argv[1]))
llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
          max_num_seqs=spec["batch_size"], enable_prefix_caching=False, enforce_eager=True,
          disable_log_stats=False, seed=0)

def generate(prompts, new_tokens):
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return outs, wall

print("VLLM_READY " + json.dumps({"vllm": __import__("vllm").__version__}), flush=True)
for line in sys.stdin:  # one run per line, {"prefill": length} or {"decode": rows}, when ours has run
    command = json.loads(line)
    if "prefill" in command:
        seconds = generate([spec["prefill"][command["prefill"]]], 1)[1]
    else:
        outs, _ = generate(spec["decode"][command["decode"]], spec["decode_steps"] + 1)
        seconds = max(o.metrics.last_token_ts for o in outs) - max(o.metrics.first_token_ts for o in outs)
    print("VLLM_RESULT " + json.dumps({"seconds": seconds}), flush=True)
"""


def start_vllm(checkpoint: str, vocab: int, args: argparse.Namespace) -> tuple[PeerProcess | None, dict]:
    """vLLM-CPU's offline `LLM.generate`, loaded in its own process for the token ids ours runs (timing.
    PeerProcess), or None and why it is skipped."""
    if not args.vllm_python:
        reason = f"skipped: no --vllm-python (nor ${VLLM_PYTHON_ENV}); ../shared/peers/ installs it"
        return None, {"vLLM": reason}
    spec = {
        "model": checkpoint,
        "dtype": args.dtype,
        "max_model_len": max(4096, max(args.prompt_lengths) + args.decode_steps + 16),
        "batch_size": args.batch_size,
        "prefill": {str(n): prompts(n, 1, vocab)[0].tolist() for n in args.prompt_lengths},
        "decode": {str(b): prompts(16, b, vocab).tolist() for b in args.decode_rows},
        "decode_steps": args.decode_steps,
    }
    print(f"vLLM: {args.vllm_python} (environment: {args.vllm_env or 'as is'})", flush=True)
    return PeerProcess("vLLM-CPU", VLLM_SCRIPT, spec, args.vllm_python, args.vllm_env), {}


def vllm_measures(vllm: PeerProcess, args: argparse.Namespace) -> PeerMeasures:
    """vLLM's measure of each prefill length and decode batch, by work label (for run_benchmarks: one
    `generate` per round, right after ours)."""

    def measure(command: dict) -> Callable[[], float]:
        return lambda: vllm.request(json.dumps(command), "VLLM_RESULT ")["seconds"]

    name = f"vLLM-CPU {vllm.ready['vllm']}"
    measures = {f"prefill {n}": {name: measure({"prefill": str(n)})} for n in args.prompt_lengths}
    measures.update({f"decode batch {b}": {name: measure({"decode": str(b)})} for b in args.decode_rows})
    return measures


def peer_ratios(results: dict, ours: str) -> dict:
    """ours / each peer, as the ratio of the medians (the only ratio of llama.cpp's prefill, which runs after
    ours; what runs in the same rounds, vLLM-CPU and llama.cpp's batch-1 decode, also has its per-round
    ratio among the speed-ups)."""
    ratios: dict = {}
    peers = [name for name in results if name.startswith(("llama.cpp", "vLLM"))]
    for name in peers:
        for metric, label in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode batch")):
            for key, cell in results[name][metric].items():
                ratios.setdefault(f"{ours} / {name}", {})[f"{label} {key}"] = (
                    results[ours][metric][key]["median"] / cell["median"]
                )
    return ratios


def table(report: dict) -> str:
    results = report["results"]
    first = next(iter(results.values()))
    columns = [("prefill_tok_s", k, f"prefill {k}") for k in first["prefill_tok_s"]]
    columns += [("decode_tok_s", k, f"decode batch {k}") for k in first["decode_tok_s"]]
    lines = [
        "| tok/s, median (min-max) of "
        + str(report["repeats"])
        + " | "
        + " | ".join(c[2] for c in columns)
        + " |",
        "| --- |" + " --- |" * len(columns),
    ]
    for name, r in results.items():
        cells = [fmt(r[m][k]) if k in r[m] else "-" for m, k, _ in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for pair, ratios in report["speedup"].items():
        cells = [fmt(ratios[label], 2, "x") if label in ratios else "-" for *_, label in columns]
        lines.append(f"| speed-up {pair} (per round) | " + " | ".join(cells) + " |")
    for pair, ratios in report["peer_ratios"].items():
        cells = [f"{ratios[label]:.2f}x" if label in ratios else "-" for *_, label in columns]
        lines.append(f"| {pair} (medians) | " + " | ".join(cells) + " |")
    for name, reason in report["skipped"].items():
        lines.append(f"| {name} | {reason} |" + " |" * (len(columns) - 1))
    return "\n".join(lines)


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    systems = list(report["results"])
    for axis, metric, title in ((left, "prefill_tok_s", "prefill"), (right, "decode_tok_s", "decode")):
        keys = list(report["results"][systems[0]][metric])
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            cells = [report["results"][system][metric].get(k) for k in keys]
            if None in cells:  # llama-bench decodes one row only
                keys_here = [k for k, c in zip(keys, cells, strict=True) if c is not None]
                cells = [c for c in cells if c is not None]
            else:
                keys_here = keys
            medians = [c["median"] for c in cells]
            errors = [[c["median"] - c["min"] for c in cells], [c["max"] - c["median"] for c in cells]]
            xs = [keys.index(k) + i * width for k in keys_here]
            axis.bar(xs, medians, width, yerr=errors, capsize=3, label=system)
        axis.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(keys))])
        label = "prompt tokens" if metric == "prefill_tok_s" else "batch"
        axis.set_xticklabels([f"{label} {k}" for k in keys])
        axis.set_ylabel(f"tokens / s (median, min-max of {report['repeats']})")
        where = report["device"] if report["backend"] == "cuda" else f"{report['machine']['threads']} threads"
        axis.set_title(f"{title} ({report['dtype']}, {where})")
    for name, roofline in report["decode_roofline_tok_s"].items():
        color = f"C{systems.index(name)}"  # the bars' colour
        right.axhline(
            roofline["median"], color=color, linestyle="--", linewidth=0.8, label=f"roofline, {name}"
        )
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint directory or Hub id (default: a random ~0.75B model)")
    parser.add_argument("--layers", type=int, default=24, help="layers of the random model (default 24)")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch-size", type=int, default=8, help="compiled batch (decode is also run at 1)")
    parser.add_argument(
        "--decode-rows",
        type=int,
        nargs="+",
        help="rows decoded together, each run separately (default: 1 and --batch-size)",
    )
    parser.add_argument("--prefill-chunk-size", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=16, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (after one warm-up)")
    parser.add_argument(
        "--compile-cache-dir",
        type=Path,
        help="compile cache to export into (default: a fresh temporary one, so the first export compiles)",
    )
    parser.add_argument(
        "--export-loads", type=int, default=3, help="exports timed after the first (cache hits)"
    )
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--fp8",
        nargs="*",
        default=[],
        choices=MODULE_SETS,
        help="FP8 variants to run beside (fp8_modules)",
    )
    parser.add_argument(
        "--int4",
        nargs="*",
        default=[],
        choices=MODULE_SETS,
        help="4-bit variants to run beside (int4_modules), quantized at export",
    )
    parser.add_argument("--int4-group-size", type=int, default=128, help="int4_group_size of --int4 (128)")
    parser.add_argument(
        "--llama-bench", default=os.environ.get("LLAMA_BENCH"), help="llama.cpp's llama-bench ($LLAMA_BENCH)"
    )
    parser.add_argument(
        "--gguf", action="append", default=[], metavar="LABEL=FILE", help="a GGUF of --model for llama-bench"
    )
    add_vllm_arguments(parser)
    parser.add_argument("--write-checkpoint", type=Path, help="write the random checkpoint here and exit")
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_generate.json")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (the JSON reports min / median / max)")
    args.decode_rows = sorted(set(args.decode_rows or (1, args.batch_size)))
    if not all(0 < rows <= args.batch_size for rows in args.decode_rows):
        parser.error(
            f"--decode-rows must be within 1..--batch-size ({args.batch_size}), got {args.decode_rows}"
        )
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    if args.write_checkpoint:
        random_checkpoint(args.write_checkpoint, args.layers, dtype)
        # The GGUF converter needs the tokenizer files, chat clients (bench_serving.py) the chat template.
        save_qwen36_tokenizer(args.write_checkpoint)
        print(f"wrote {args.write_checkpoint}")
        return

    with tempfile.TemporaryDirectory() as tmp:
        phase = time.perf_counter()
        checkpoint = args.model or str(random_checkpoint(Path(tmp) / "model", args.layers, dtype))
        phases = {"checkpoint_s": time.perf_counter() - phase}
        phase = time.perf_counter()
        ours, export_report, cache_dir = measure_export(checkpoint, args, Path(tmp))
        phases["export_s"] = time.perf_counter() - phase
        ours.generation_config.eos_token_id = None  # random weights: never stop early
        systems = {f"optimum-qwen36 {args.backend}": ours}
        quantized_models, quantized_report = export_quantized_variants(checkpoint, args, cache_dir)
        systems.update(quantized_models)
        device = ours.backend.device
        bandwidth = read_bandwidth_gbs(device, args.repeats)
        per_token = {name: weight_bytes_per_token(model.model) for name, model in systems.items()}
        reference = None
        if not args.skip_transformers:
            reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval().to(device)
            reference.generation_config.eos_token_id = None
        ggufs, skipped = llama_ggufs(args)
        lengths = ",".join(map(str, args.prompt_lengths))
        commands = {
            name: {
                "decode": llama_bench_command(args.llama_bench, path, "0", args.decode_steps, 1),
                "prefill": llama_bench_command(args.llama_bench, path, lengths, 0, args.repeats),
            }
            for name, path in ggufs.items()
        }
        peer_measures = {
            "decode batch 1": {
                name: llama_decode_measure(c["decode"], args.decode_steps) for name, c in commands.items()
            }
        }
        vllm, vllm_skipped = start_vllm(checkpoint, ours.config.vocab_size, args)
        skipped.update(vllm_skipped)
        phase = time.perf_counter()
        try:
            for label, measures in (vllm_measures(vllm, args) if vllm else {}).items():
                peer_measures.setdefault(label, {}).update(measures)
            results, speedup = run_benchmarks(systems, reference, args, peer_measures)
        finally:
            if vllm:
                vllm.close()
        phases["benchmarks_s"] = time.perf_counter() - phase
        for name, command in commands.items():
            peer = results.setdefault(name, {"prefill_tok_s": {}, "decode_tok_s": {}})
            peer["prefill_tok_s"] = llama_bench_prefill(command["prefill"])
            peer["commands"] = {kind: portable(" ".join(c)) for kind, c in command.items()}
        parameters = sum(p.numel() for p in ours.model.parameters())
    report = {
        "command": command_line(),
        "model": args.model or f"random Qwen3.6-shaped, {args.layers} layers",
        "parameters": parameters,
        "dtype": args.dtype,
        "backend": args.backend,
        "device": torch.cuda.get_device_name(device) if args.backend == "cuda" else "cpu",
        "machine": machine(),
        "transformers": transformers.__version__,
        "transformers_attn_implementation": getattr(
            getattr(reference, "config", None), "_attn_implementation", None
        ),
        "batch_size": args.batch_size,
        "sequence_length": max(args.prompt_lengths) + args.decode_steps + 16,
        "prefill_chunk_size": args.prefill_chunk_size,
        "decode_steps": args.decode_steps,
        "repeats": args.repeats,
        "work": {
            "prefill": "one row of the same random token ids on both sides; ours generate(max_new_tokens=1), "
            "transformers model(input_ids, logits_to_keep=1, use_cache=True)",
            "logit_rows_per_prefill": {
                str(n): {OURS: math.ceil(n / args.prefill_chunk_size), THEIRS: 1} for n in args.prompt_lengths
            },
            "decode": "generate(max_new_tokens=decode_steps + 1), greedy, no EOS, the same 16-token prompts "
            "on both sides; rate = rows * decode_steps / (time of the last new token - time of the first)",
            "llama.cpp": "decode: llama-bench -p 0 -n <decode steps> -t <threads> -r 1, once per round "
            "alternated with ours (tg = tokens / s generating from an empty context, one row); prefill: "
            "llama-bench -p <prompt lengths> -n 0 -t <threads> -r <repeats>, run right after ours (pp = "
            "prompt tokens / s for one sequence, logits of the last token)",
            "read_bandwidth": "torch.sum of 1 GiB of float32 in transparent huge pages (the memory the cpu "
            "backend streams its weights from), right before the rounds",
            "vLLM": "vllm.LLM (enforce_eager, prefix caching off, max_num_seqs = batch) on our token ids, "
            "kept loaded in its own process, one generate per round alternated with ours: prefill = prompt "
            "tokens / wall time of generate(max_tokens=1); decode = rows * decode_steps / (last token time - "
            "first token time) with max_tokens = decode_steps + 1",
        },
        "export": export_report,
        "read_bandwidth_gb_s": bandwidth,
        "read_bandwidth_in_huge_pages": (
            torch.device(device).type == "cpu" and huge_pages.transparent_huge_pages()
        ),
        "weight_bytes_per_token": per_token,
        # Batch-1 decode roofline of each of our systems: its weight bytes read per token / read bandwidth.
        "decode_roofline_tok_s": {
            name: {k: v * 1e9 / size for k, v in bandwidth.items() if k != "runs"}
            for name, size in per_token.items()
        },
        "quantized_variants": quantized_report,
        "results": results,
        "speedup": speedup,
        "peer_ratios": peer_ratios(results, f"optimum-qwen36 {args.backend}"),
        "skipped": skipped,
        "phase_seconds": {**phases, "total_s": time.perf_counter() - started},
    }
    report["decode_batch1_fraction_of_roofline"] = {
        name: results[name]["decode_tok_s"]["1"]["median"] / roofline["median"]
        for name, roofline in report["decode_roofline_tok_s"].items()
        if "1" in results[name]["decode_tok_s"]
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    chart(report, args.output.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k not in ("results", "speedup")}, indent=2))
    print(table(report))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
