"""Where the continuous-batching engine's time goes on bench_engine.py's burst workload: its model runner's
prefill, packed prefill and decode calls (count, seconds, tokens; decode calls by their number of rows) and
the rest of each step (scheduling, sampling, detokenising), over one engine run after a warm-up.

    python benchmarks/profile_engine.py --model /tmp/ckpt      # bench_generate.py --write-checkpoint
    python benchmarks/profile_engine.py --layers 4 --requests 8 --prompt-tokens 64 512 --output /tmp/p.json

Writes benchmarks/results/profile_engine.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_engine import add_workload_arguments, run_engine, workload, workload_model, workload_report

from optimum_qwen36.engine.runner import ModelRunner

RESULTS = Path(__file__).resolve().parent / "results"


class CallTimes:
    """Times ModelRunner.prefill, .prefill_packed and .decode while installed (class attributes: every
    engine's runner)."""

    def __init__(self) -> None:
        self.calls: dict[str, dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "seconds": 0.0, "tokens": 0}
        )
        names = ("prefill", "prefill_packed", "decode")
        self._originals = {name: getattr(ModelRunner, name) for name in names}

    def _timed(self, name: str, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(runner: ModelRunner, tokens: Any, *args: Any) -> torch.Tensor:
            start = time.perf_counter()
            out = original(runner, tokens, *args)
            seconds = time.perf_counter() - start
            keys = [name] + ([f"decode of {len(tokens)} row(s)"] if name == "decode" else [])
            count = sum(len(chunk.tokens) for chunk in tokens) if name == "prefill_packed" else len(tokens)
            for key in keys:
                entry = self.calls[key]
                entry["calls"] += 1
                entry["seconds"] += seconds
                entry["tokens"] += count
            return out

        return call

    def __enter__(self) -> CallTimes:
        for name, original in self._originals.items():
            setattr(ModelRunner, name, self._timed(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(ModelRunner, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_arguments(parser)
    parser.add_argument("--output", type=Path, default=RESULTS / "profile_engine.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="profile-engine-") as tmp:
        _, model = workload_model(args, Path(tmp))
        works = workload(args, model.config.vocab_size, "burst")
        run_engine(model, works[:2])  # warm-up (first calls allocate)
        with CallTimes() as timed:
            start = time.perf_counter()
            served = run_engine(model, works)
            total = time.perf_counter() - start
    in_calls = sum(entry["seconds"] for name, entry in timed.calls.items() if " of " not in name)
    report = {
        **workload_report(args),
        "total_s": total,
        "generated_tokens": sum(len(s.tokens) for s in served),
        "calls": dict(sorted(timed.calls.items())),
        "outside_calls_s": total - in_calls,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"total {total:.1f} s, {report['generated_tokens']} tokens generated")
    for name, entry in report["calls"].items():
        per_call = entry["seconds"] / entry["calls"] * 1e3
        print(f"{name:24s} {entry['calls']:5d} calls {entry['seconds']:7.1f} s ({per_call:.0f} ms each), "
              f"{entry['tokens']} tokens")  # fmt: skip
    print(f"outside the calls: {report['outside_calls_s']:.1f} s")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
