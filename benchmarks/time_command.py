"""Wall time of a whole command, repeated, each run with empty compile caches: for figures such as "the
example's whole run, export included, takes N s" (README.md).

Each run gets fresh, empty directories as $OPTIMUM_QWEN36_CACHE (optimum-qwen36's compile cache) and
$TORCHINDUCTOR_CACHE_DIR (AOTInductor's), so every run compiles as a first-time user's would (--keep-caches:
the caller's caches, e.g. to time a cache-hit run). The runs are sequential; the JSON keeps each run's wall
time and exit status, with min / median / max.

    python benchmarks/time_command.py --name example -- .venv/bin/python examples/generate.py
    python benchmarks/time_command.py --name smoke --output /tmp/time_smoke.json -- python -c "print(1)"

Writes benchmarks/results/time_<name>.json (or --output). Exits non-zero if a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import fmt, machine, spread

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--name", required=True, help="what is timed (names the JSON file)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep-caches", action="store_true", help="use the caller's compile caches")
    parser.add_argument("--output", type=Path, help="default: benchmarks/results/time_<name>.json")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (the JSON reports min / median / max)")
    runs = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="time-command-") as tmp:
            env = dict(os.environ)
            if not args.keep_caches:
                env["OPTIMUM_QWEN36_CACHE"] = str(Path(tmp) / "optimum-qwen36")
                env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
            start = time.perf_counter()
            status = subprocess.run(command, env=env, check=False).returncode
            seconds = time.perf_counter() - start
        runs.append({"seconds": seconds, "returncode": status})
        print(f"run {i + 1}/{args.repeats}: {seconds:.1f} s, exit status {status}", flush=True)
    ok = all(r["returncode"] == 0 for r in runs)
    result = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "timed_command": shlex.join(command),
        "caches": "the caller's"
        if args.keep_caches
        else "empty per run (OPTIMUM_QWEN36_CACHE, TORCHINDUCTOR_CACHE_DIR)",
        "machine": machine(),
        "env": {
            k: os.environ[k]
            for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "OPTIMUM_QWEN36_COMPILE_WORKERS")
            if k in os.environ
        },
        "all_succeeded": ok,
        "runs": runs,
        "wall_seconds": spread([r["seconds"] for r in runs]),
    }
    output = args.output or RESULTS / f"time_{args.name}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.name}: {fmt(result['wall_seconds'], 1, ' s')} over {args.repeats} runs; wrote {output}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
